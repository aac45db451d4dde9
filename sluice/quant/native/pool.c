/* Threads inside the extension: one decode step's native work split over the CPUs without Python in between.
 *
 * Why here and not a Python pool: a Python thread pool costs a future, a lock handoff and the GIL per job; a decode
 * token of the peers model ran 128 expert calls and ~70 projections through it, and its experts took 25-29 ms
 * split over 2 threads against ~28 ms of pure C work on one (benchmarks/quantized/expert_threads.py, removed: its
 * command is in benchmarks/results/quantized/README.md). Here a job is a list of tasks (rows of one or several
 * projections, experts of a layer) handed out by an atomic counter; the calling thread works too, and the workers
 * spin briefly between jobs (a decode step runs several jobs per layer, and a futex wake-up costs tens of us), then
 * sleep.
 *
 * Every task writes its own outputs and computes them as one thread would (the same kernel call on the same
 * bytes), so a result has the same bits whichever thread ran which task and for any thread count.
 * One job at a time: a call made while another thread's job runs (or from inside a task) runs its tasks on the
 * calling thread, so nothing waits on itself. After fork() the child starts with no workers (pthread_atfork).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "common.h"

#if SLUICE_X86
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_THREADS 64
/* a worker spins spin_ns after a job (pause), then calls sched_yield until yield_ns (so an I/O thread on its CPU
 * still runs), then sleeps until the next one; native.pool_phase sets them for prompts and decode */
static _Atomic int64_t spin_ns = 50000, yield_ns = 1000000;

/* the wait above, process-wide (workers read it after each job) */
void sluice_set_spin(int64_t spin, int64_t yield) {
    atomic_store(&spin_ns, spin);
    atomic_store(&yield_ns, yield);
}

static struct {
    pthread_mutex_t mu, run;
    pthread_cond_t wake, done;
    int threads;  /* wanted, the caller included */
    int started;  /* workers running */
    pthread_t tid[MAX_THREADS];
    int quit;
    task_fn fn;
    void *ctx;
    int64_t ntasks;
    atomic_llong next;
    atomic_int busy;
    atomic_uint gen;
    int atfork;
} S = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 1};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void take_tasks(void) {
    for (;;) {
        int64_t i = atomic_fetch_add(&S.next, 1);
        if (i >= S.ntasks) return;
        S.fn(S.ctx, i);
    }
}

static void *worker(void *arg) {
    unsigned seen = (unsigned)(uintptr_t)arg;
    for (;;) {
        unsigned g = atomic_load(&S.gen);
        if (g == seen) {
            int64_t t0 = now_ns(), t;
            int n = 0;
            while ((g = atomic_load(&S.gen)) == seen) {
                if ((++n & 63) == 0 && (t = now_ns() - t0) > atomic_load(&spin_ns)) {
                    if (t > atomic_load(&yield_ns)) break;
                    sched_yield();
                } else {
                    CPU_RELAX();
                }
            }
            if (g == seen) {
                pthread_mutex_lock(&S.mu);
                while ((g = atomic_load(&S.gen)) == seen) pthread_cond_wait(&S.wake, &S.mu);
                pthread_mutex_unlock(&S.mu);
            }
        }
        seen = g;
        if (S.quit) return NULL;
        take_tasks();
        if (atomic_fetch_sub(&S.busy, 1) == 1) {
            pthread_mutex_lock(&S.mu);
            pthread_cond_signal(&S.done);
            pthread_mutex_unlock(&S.mu);
        }
    }
}

/* the child of a fork has no workers; its locks start free */
/* ---- one kept scratch buffer for a prompt's native calls (prompt.c, attend.c) ----
 * A prompt runs ~2 calls per expert and layer, each wanting 1-10 MB of scratch: malloc serves that size with fresh
 * mmap'd (or trimmed and re-grown) pages, so every call paid a page fault per 4 KiB it wrote. The buffer grows to
 * the largest call of a prompt and is freed when decode starts (native.pool_phase). A call made while another
 * thread holds it gets its own allocation. */
static pthread_mutex_t keep_mu = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *keep_buf;
static size_t keep_size;

static void after_fork_child(void) {
    pthread_mutex_init(&keep_mu, NULL);  /* a parent thread may have held it: the child has no such thread */
    pthread_mutex_init(&S.mu, NULL);
    pthread_mutex_init(&S.run, NULL);
    pthread_cond_init(&S.wake, NULL);
    pthread_cond_init(&S.done, NULL);
    S.started = 0;
    S.quit = 0;
}

static void stop_workers(void) {  /* with S.run held */
    if (!S.started) return;
    pthread_mutex_lock(&S.mu);
    S.quit = 1;
    atomic_fetch_add(&S.gen, 1);
    pthread_cond_broadcast(&S.wake);
    pthread_mutex_unlock(&S.mu);
    for (int i = 0; i < S.started; i++) pthread_join(S.tid[i], NULL);
    S.started = 0;
    S.quit = 0;
}

/* starts threads - 1 workers; returns how many run (fewer when the system refuses) */
static int start_workers(void) {  /* with S.run held */
    if (!S.atfork) {
        pthread_atfork(NULL, NULL, after_fork_child);
        S.atfork = 1;
    }
    unsigned g = atomic_load(&S.gen);
    while (S.started < S.threads - 1) {
        if (pthread_create(&S.tid[S.started], NULL, worker, (void *)(uintptr_t)g)) break;
        S.started++;
    }
    return S.started;
}

/* the threads a job may use, the caller included (1..MAX_THREADS); joins the workers of the old count */
void sluice_set_threads(int threads) {
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    pthread_mutex_lock(&S.run);
    if (threads != S.threads) {
        stop_workers();
        S.threads = threads;
    }
    pthread_mutex_unlock(&S.run);
}

int sluice_threads(void) { return S.threads; }

void pool_run(task_fn fn, void *ctx, int64_t ntasks) {
    if (ntasks <= 0) return;
    if (ntasks == 1 || S.threads <= 1 || pthread_mutex_trylock(&S.run) != 0) {
        for (int64_t i = 0; i < ntasks; i++) fn(ctx, i);
        return;
    }
    int workers = S.started == S.threads - 1 ? S.started : start_workers();
    if (workers == 0) {
        pthread_mutex_unlock(&S.run);
        for (int64_t i = 0; i < ntasks; i++) fn(ctx, i);
        return;
    }
    S.fn = fn;
    S.ctx = ctx;
    S.ntasks = ntasks;
    atomic_store(&S.next, 0);
    atomic_store(&S.busy, workers);
    pthread_mutex_lock(&S.mu);
    atomic_fetch_add(&S.gen, 1);
    pthread_cond_broadcast(&S.wake);
    pthread_mutex_unlock(&S.mu);
    take_tasks();
    for (int n = 0; atomic_load(&S.busy) > 0 && n < 20000; n++) CPU_RELAX();
    if (atomic_load(&S.busy) > 0) {
        pthread_mutex_lock(&S.mu);
        while (atomic_load(&S.busy) > 0) pthread_cond_wait(&S.done, &S.mu);
        pthread_mutex_unlock(&S.mu);
    }
    pthread_mutex_unlock(&S.run);
}

uint8_t *keep_take(size_t n, int *owned) {
    n = (n + 63) / 64 * 64;
    if (pthread_mutex_trylock(&keep_mu) == 0) {
        if (n > keep_size) {
            free(keep_buf);
            keep_buf = (uint8_t *)aligned_alloc(64, n);
            keep_size = keep_buf ? n : 0;
        }
        if (keep_buf) {
            *owned = 0;
            return keep_buf;
        }
        pthread_mutex_unlock(&keep_mu);
    }
    *owned = 1;
    return (uint8_t *)aligned_alloc(64, n);
}

void keep_give(uint8_t *p, int owned) {
    if (owned)
        free(p);
    else
        pthread_mutex_unlock(&keep_mu);
}

void sluice_keep_release(void) {
    pthread_mutex_lock(&keep_mu);
    free(keep_buf);
    keep_buf = NULL;
    keep_size = 0;
    pthread_mutex_unlock(&keep_mu);
}

/* ---- one scratch buffer per thread (pool workers and callers), freed when the thread exits ----
 * For work split over the pool that needs its own room per task (a packed weight tile, an attention block's
 * scores): a task takes its thread's buffer, grown as needed; tasks of one thread run one at a time. */
static pthread_key_t thread_key;
static pthread_once_t thread_key_once = PTHREAD_ONCE_INIT;

static void thread_key_make(void) { pthread_key_create(&thread_key, free); }

uint8_t *thread_scratch(size_t n) {
    pthread_once(&thread_key_once, thread_key_make);
    uint8_t *p = (uint8_t *)pthread_getspecific(thread_key);
    size_t have = p ? *(size_t *)p : 0;  /* the first 64 bytes hold the size */
    if (n > have) {
        free(p);
        p = (uint8_t *)aligned_alloc(64, (n + 64 + 63) / 64 * 64);
        if (p) *(size_t *)p = n;
        pthread_setspecific(thread_key, p);
    }
    return p ? p + 64 : NULL;
}
