/* Threads inside the extension: one decode step's native work split over the CPUs without Python in between.
 *
 * Why here and not a Python pool: a Python thread pool costs a future, a lock handoff and the GIL per job; a decode
 * token of the peers model ran 128 expert calls and ~70 projections through it, and its experts took 25-29 ms
 * split over 2 threads against ~28 ms of pure C work on one (benchmarks/quantized/expert_threads.py, removed: its
 * command is in benchmarks/results/quantized/README.md). Here a job is a list of tasks (rows of one or several
 * projections, experts of a layer) handed out by a claim word (job id, next task: CAS); the calling thread works
 * too, and the workers spin briefly between jobs (a decode step runs several jobs per layer, and a futex wake-up
 * costs tens of us), then sleep. A job is over when its tasks are, whichever threads ran them: the caller never
 * waits for a worker that has not shown up (asleep, or its CPU taken by the reader threads of a streamed step), it
 * runs the tasks left itself.
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
 * still runs), then sleeps until the next one; engine.py sets them per model (native/pool.py set_wait) */
static _Atomic int64_t spin_ns = 50000, yield_ns = 1000000;

/* the wait above, process-wide (workers read it after each job) */
void sluice_set_spin(int64_t spin, int64_t yield) {
    atomic_store(&spin_ns, spin);
    atomic_store(&yield_ns, yield);
}

int64_t sluice_pool_wait(void) { return atomic_load(&yield_ns); }

/* A job's description. Two, used in turn (job id & 1). A worker that learned id from `gen` reads jobs[id & 1], then
 * `claim`: the caller wrote that description before it published id, and rewrites it only for job id + 2, after it
 * stored job id + 1 in `claim`; so when the worker's `claim` still shows id, what it read was job id's own (these
 * atomics are all seq_cst), and when it does not, the worker runs nothing. With one description a late worker could
 * read job id + 1's task count while `claim` still showed job id's end, and run a task past it with a mix of both
 * jobs. The id is 32 bits: mistaking one job for another (ABA) takes a worker stalled between reading `gen` and
 * `claim` while 2^32 jobs run. */
typedef struct {
    _Atomic(task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t ntasks;
} job_t;

static struct {
    pthread_mutex_t mu, run;
    pthread_cond_t wake, done;
    int threads;  /* wanted, the caller included */
    int started;  /* workers running */
    pthread_t tid[MAX_THREADS];
    atomic_int quit;  /* atomic: a worker late for a job reads it with no lock or job end to order it */
    job_t jobs[2];
    /* (job id << 32) | the next task index: a thread takes task i of job id by moving it to i + 1 (CAS), so a
     * worker that woke up late for a job already over takes nothing */
    atomic_ullong claim;
    atomic_llong finished;  /* tasks of the current job run to their end: the job is over at ntasks */
    atomic_uint gen;        /* the current job's id (also bumped to stop the workers) */
    int waiting;            /* the caller sleeps on `done` (under mu) */
    int atfork;
} S = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 1};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* run the tasks of job `id` nobody has taken yet; returns at once when that job is over or superseded. `finished`
 * counts the tasks run to their end (not the threads that showed up), so the caller never waits for a worker that
 * was asleep or off its CPU: it runs the tasks itself and goes on. (Before, the caller waited until every worker had
 * come and gone: in a streamed decode step the reader threads hold the 2 CPUs between expert calls, the workers
 * sleep, and each job paid their wake-up and a turn on a CPU. This change alone, a 20-layer qwen3_5_moe q4_0
 * streamed at 256 MiB on the 2-core VM, medians of 5 paired rounds: with other processes on the CPUs 216.8 -> 66.9
 * ms/token, process CPU 216.6 -> 69.3; quiet, I/O-bound, 65.7 -> 64.3 and 116.7 -> 111.3, within the rounds'
 * spread; benchmarks/results/hybrid/README.md, stream_cpu.py.) */
static void take_tasks(unsigned id) {
    job_t *job = &S.jobs[id & 1];
    task_fn fn = atomic_load(&job->fn);
    void *ctx = atomic_load(&job->ctx);
    int64_t n = atomic_load(&job->ntasks);
    unsigned long long v = atomic_load(&S.claim);
    for (;;) {
        /* another job's id: this one is over, and what was read above may be the next one's (never used) */
        if ((unsigned)(v >> 32) != id || (int64_t)(uint32_t)v >= n) return;
        if (!atomic_compare_exchange_weak(&S.claim, &v, v + 1)) continue;  /* v reloaded */
        /* the claim held job id when it moved, so the job was not over and fn / ctx / n were its own */
        fn(ctx, (int64_t)(uint32_t)v);
        if (atomic_fetch_add(&S.finished, 1) + 1 == n) {
            pthread_mutex_lock(&S.mu);
            if (S.waiting) pthread_cond_signal(&S.done);
            pthread_mutex_unlock(&S.mu);
        }
        v = atomic_load(&S.claim);
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
        if (atomic_load(&S.quit)) return NULL;
        take_tasks(g);
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
    atomic_store(&S.quit, 0);
    S.waiting = 0;
}

static void stop_workers(void) {  /* with S.run held */
    if (!S.started) return;
    pthread_mutex_lock(&S.mu);
    atomic_store(&S.quit, 1);
    atomic_fetch_add(&S.gen, 1);
    pthread_cond_broadcast(&S.wake);
    pthread_mutex_unlock(&S.mu);
    for (int i = 0; i < S.started; i++) pthread_join(S.tid[i], NULL);
    S.started = 0;
    atomic_store(&S.quit, 0);
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

/* publish a job to the workers with S.run held (the caller's); 0 where no worker runs (S.run released) */
static int publish(task_fn fn, void *ctx, int64_t ntasks) {
    int workers = S.started == S.threads - 1 ? S.started : start_workers();
    if (workers == 0) {
        pthread_mutex_unlock(&S.run);
        return 0;
    }
    unsigned id = atomic_load(&S.gen) + 1;  /* only a thread holding S.run moves gen */
    job_t *job = &S.jobs[id & 1];
    atomic_store(&job->fn, fn);
    atomic_store(&job->ctx, ctx);
    atomic_store(&job->ntasks, ntasks);
    atomic_store(&S.finished, 0);
    atomic_store(&S.claim, (unsigned long long)id << 32);
    pthread_mutex_lock(&S.mu);
    atomic_store(&S.gen, id);
    pthread_cond_broadcast(&S.wake);
    pthread_mutex_unlock(&S.mu);
    return 1;
}

/* the published job's tasks nobody has taken, on this thread, then the wait for those still running on a worker
 * (each a task's time at most); releases S.run */
static void join(void) {
    unsigned id = atomic_load(&S.gen);
    int64_t ntasks = atomic_load(&S.jobs[id & 1].ntasks);
    take_tasks(id);
    for (int n = 0; atomic_load(&S.finished) < ntasks && n < 20000; n++) CPU_RELAX();
    if (atomic_load(&S.finished) < ntasks) {
        pthread_mutex_lock(&S.mu);
        S.waiting = 1;
        while (atomic_load(&S.finished) < ntasks) pthread_cond_wait(&S.done, &S.mu);
        S.waiting = 0;
        pthread_mutex_unlock(&S.mu);
    }
    pthread_mutex_unlock(&S.run);
}

void pool_run(task_fn fn, void *ctx, int64_t ntasks) {
    if (ntasks <= 0) return;
    if (ntasks == 1 || ntasks > INT32_MAX || S.threads <= 1 || pthread_mutex_trylock(&S.run) != 0
        || !publish(fn, ctx, ntasks)) {
        for (int64_t i = 0; i < ntasks; i++) fn(ctx, i);
        return;
    }
    join();
}

/* A job the workers run while the caller does something else (a decode token's first expert projections while
 * the model's thread queues the next layer's guessed reads: models/layers/moe_decode.py), finished by pool_finish
 * on the same thread. The pool stays the job's until then: a pool_run meanwhile, from this thread or another, runs
 * its tasks on its own thread. Every task is the same call whichever thread runs it: the same bits. */
int pool_start(task_fn fn, void *ctx, int64_t ntasks) {
    if (ntasks <= 0 || ntasks > INT32_MAX || S.threads <= 1 || pthread_mutex_trylock(&S.run) != 0) return 0;
    return publish(fn, ctx, ntasks);
}

void pool_finish(void) { join(); }

/* ---- the pool's own check (tests/quant/test_pool.py) ----
 * `jobs` jobs back to back, job k of ntasks[k % nsizes] tasks: its context is counter row k % 3 of `counts`
 * ([3][stride] int64) and its function adds 1 (k even) or 1 << 20 (k odd) to entry i of that row, after spinning
 * `spin` pauses (so a caller finds a worker mid-task and has to wait for it). Each task run exactly once,
 * with its own job's function and context, leaves counts the caller can compute; a task run twice or never, or
 * with another job's function or context, does not. Returns the jobs whose pool_run returned before all their
 * tasks had ended (0). */
typedef struct {
    int64_t *row, n, spin;
    _Atomic int64_t ended;
} check_job;

static void check_one(void *c, int64_t i, int64_t add) {
    check_job *j = (check_job *)c;
    for (int64_t s = 0; s < j->spin; s++) CPU_RELAX();
    atomic_fetch_add((_Atomic int64_t *)&j->row[i], add);
    atomic_fetch_add(&j->ended, 1);
}

static void check_even(void *c, int64_t i) { check_one(c, i, 1); }
static void check_odd(void *c, int64_t i) { check_one(c, i, (int64_t)1 << 20); }

int64_t sluice_pool_check(int64_t jobs, const int64_t *ntasks, int64_t nsizes, int64_t *counts, int64_t stride,
                          int64_t spin) {
    check_job js[3];  /* one per row: back-to-back jobs have different contexts */
    int64_t early = 0;
    for (int64_t k = 0; k < jobs; k++) {
        check_job *j = &js[k % 3];
        j->row = counts + (k % 3) * stride;
        j->n = ntasks[k % nsizes];
        j->spin = spin;
        atomic_store(&j->ended, 0);
        pool_run(k % 2 ? check_odd : check_even, j, j->n);
        early += atomic_load(&j->ended) != j->n;
    }
    return early;
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
