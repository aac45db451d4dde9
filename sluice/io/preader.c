/* The direct reader's workers in C: a pool of threads doing preadv straight into the destinations, with no Python
 * and no GIL between a batch's submission and its last byte (io/native_pool.py wraps it; io/direct.py uses it).
 *
 * Why: the Python workers took the GIL for every read (buffers, staging copies, counters) and competed with the
 * model's thread for it and for the CPUs. A streamed decode step of the issue-30 model (806 reads of 61 MiB per
 * token) spent 7.5 ms of CPU per token in each of its 8 reader threads (60 ms in all, beside a 70 ms main thread,
 * on a 2-core AMD EPYC: benchmarks/results/hybrid/stream_threads.txt), and the main thread's torch calls waited
 * for the GIL the readers held (`.float()` 7x slower than resident: benchmarks/results/hybrid/README.md).
 *
 * A batch arrives as one int64 op list (the Python side flattens its read plan: io/native_pool.py `_ops`), cut into
 * parts (one task each, the Python reader's split_even chunks); workers take tasks first to last; the batch is over
 * when its last part is. Per read:
 *   fd, align (the file's O_DIRECT alignment, 512-4096; 0: buffered), offset, nbytes, overlapping, nseg, then per
 *   segment: rel, nbytes, ndests, dest addresses...
 * exactly the Python reader's operations (io/direct.py _Pool._execute / _read_direct), so the same bytes land: reads
 * into the destinations where the window allows it (O_DIRECT: whole blocks whose address agrees with the file offset
 * modulo the file's alignment), everything else through a per-worker page-aligned staging buffer, duplicates copied from the first
 * destination. The first error of a batch is kept (kind, read index, errno, file position); a part stops at it.
 */
#include "preader.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static void batch_free(batch_t *b) {
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b->ops);
    free(b->tasks);
    free(b);
}

static void batch_unref(batch_t *b) {
    if (atomic_fetch_sub(&b->refs, 1) == 1) batch_free(b);
}

void fail(batch_t *b, int kind, int64_t read, int64_t err, int64_t pos) {
    int none = ERR_NONE;
    if (atomic_compare_exchange_strong(&b->err_kind, &none, kind)) {
        b->err_read = read;
        b->err_errno = err;
        b->err_pos = pos;
    }
}

static uint8_t *staging(scratch_t *s, int64_t n) {
    if (n > s->stage_n) {
        int64_t size = (n + ALIGN - 1) / ALIGN * ALIGN;
        if (size < 2 * s->stage_n) size = 2 * s->stage_n;
        free(s->stage);
        s->stage = (uint8_t *)aligned_alloc(ALIGN, (size_t)size);
        s->stage_n = s->stage ? size : 0;
    }
    return s->stage;
}

/* skip n bytes of iov[i..]: returns the first buffer not yet full, the partly filled one trimmed */
static int advance(struct iovec *iov, int i, int nbuf, int64_t n) {
    while (n && i < nbuf) {
        if ((int64_t)iov[i].iov_len <= n) {
            n -= (int64_t)iov[i].iov_len;
            i++;
        } else {
            iov[i].iov_base = (uint8_t *)iov[i].iov_base + n;
            iov[i].iov_len -= (size_t)n;
            n = 0;
        }
    }
    return i;
}

/* O_DIRECT: whether segment q (of a read at `offset`) has whole blocks [*a, *b) (file offsets, multiples of al) to
 * read straight into its first destination, past *pos (the window read so far, advanced to *b when so): its address
 * agrees with the file offset modulo al and it shares no bytes with another segment. plan_read and finish_read ask
 * it in the same order. */
static int direct_run(const int64_t *q, int64_t offset, int overlapping, int64_t al, int64_t *pos, int64_t *a,
                      int64_t *b) {
    int64_t o = offset + q[0];
    *a = (o + al - 1) / al * al;
    *b = (o + q[1]) / al * al;
    if (overlapping || *b <= *a || *a < *pos || ((((intptr_t)q[3] - o) % al) + al) % al) return 0;
    *pos = *b;
    return 1;
}

/* plan the read at *pp (advanced past it) into r: the buffers its bytes go to, in file order, from r->start.
 * Returns 0 or an error kind. Buffered and no segments overlap (READ_GAPS): the destinations themselves, the gaps
 * between segments into the gap buffer; overlapping (READ_WINDOW): the window into staging; O_DIRECT
 * (READ_DIRECT): the aligned window, a segment's whole blocks straight into its first destination when that
 * destination's address agrees with its file offset modulo the alignment, the rest into staging. */
int plan_read(const int64_t **pp, scratch_t *s, int64_t max_gap, plan_t *r) {
    const int64_t *p = *pp;
    int overlapping = (int)p[4];
    int64_t al = p[1], offset = p[2], nbytes = p[3], nseg = p[5];
    const int64_t *q = p + 6;
    for (int64_t k = 0; k < nseg; k++) q += 3 + q[2];
    *pp = q;
    r->op = p;
    r->seg0 = p + 6;
    r->fd = (int)p[0];
    r->al = al;
    r->nbuf = 0;
    r->st = NULL;
    q = r->seg0;
    if (!al && !overlapping) {
        int64_t pos = 0;
        r->mode = READ_GAPS;
        r->start = offset;
        for (int64_t k = 0; k < nseg; k++, q += 3 + q[2]) {
            if (r->nbuf + 2 > MAX_IOV || q[0] - pos > max_gap) return ERR_BAD;
            if (q[0] > pos) r->iov[r->nbuf++] = (struct iovec){s->gap, (size_t)(q[0] - pos)};
            if (q[1]) r->iov[r->nbuf++] = (struct iovec){(void *)(intptr_t)q[3], (size_t)q[1]};
            pos = q[0] + q[1];
        }
        r->need = pos;
        return 0;
    }
    if (!al) {
        r->mode = READ_WINDOW;
        r->start = offset;
        r->need = nbytes;
        if (!(r->st = staging(s, nbytes))) return ERR_NOMEM;
        r->iov[r->nbuf++] = (struct iovec){r->st, (size_t)nbytes};
        return 0;
    }
    if (al < 0 || ALIGN % al) return ERR_BAD;
    int64_t start = offset - offset % al, end = offset + nbytes, window = (end - start + al - 1) / al * al;
    r->mode = READ_DIRECT;
    r->start = start;
    r->need = end - start; /* the window is rounded up to whole blocks; a read past `end` may come back short */
    if (!(r->st = staging(s, window))) return ERR_NOMEM;
    int64_t pos = start;
    for (int64_t k = 0; k < nseg; k++, q += 3 + q[2]) {
        int64_t was = pos, a, b;
        if (!direct_run(q, offset, overlapping, al, &pos, &a, &b)) continue;
        if (r->nbuf + 2 > MAX_IOV) return ERR_BAD;
        if (a > was) r->iov[r->nbuf++] = (struct iovec){r->st + (was - start), (size_t)(a - was)};
        r->iov[r->nbuf++] = (struct iovec){(void *)((intptr_t)q[3] + (a - offset - q[0])), (size_t)(b - a)};
    }
    if (pos < start + window) r->iov[r->nbuf++] = (struct iovec){r->st + (pos - start), (size_t)(start + window - pos)};
    return 0;
}

/* after n bytes (>= 0) landed at *pos in r->iov[*i..]: 1 when the read is complete, 0 when more is to be read (*i,
 * *pos and the iovecs advanced), ERR_EOF when the file ended first (an O_DIRECT read comes back short, off the
 * block grid, only at the end of the file) */
int read_progress(plan_t *r, int *i, int64_t *pos, int64_t n) {
    if (n == 0) return ERR_EOF;
    *pos += n;
    if (*pos - r->start >= r->need) return 1;
    if (r->al && n % r->al) return ERR_EOF;
    *i = advance(r->iov, *i, r->nbuf, n);
    return *i < r->nbuf ? 0 : 1;
}

/* a complete read's copies: staging to the destinations, first destinations to duplicates; returns bytes copied */
int64_t finish_read(const plan_t *r) {
    int64_t copied = 0, offset = r->op[2], nseg = r->op[5];
    int overlapping = (int)r->op[4];
    const int64_t *q = r->seg0;
    if (r->mode == READ_GAPS) {
        for (int64_t k = 0; k < nseg; k++, q += 3 + q[2])
            for (int64_t d = 1; d < q[2]; d++) {
                memcpy((void *)(intptr_t)q[3 + d], (void *)(intptr_t)q[3], (size_t)q[1]);
                copied += q[1];
            }
        return copied;
    }
    if (r->mode == READ_WINDOW) {
        for (int64_t k = 0; k < nseg; k++, q += 3 + q[2])
            for (int64_t d = 0; d < q[2]; d++) {
                memcpy((void *)(intptr_t)q[3 + d], r->st + q[0], (size_t)q[1]);
                copied += q[1];
            }
        return copied;
    }
    /* READ_DIRECT: the bytes outside each direct run came through staging (direct_run again, segment by segment) */
    int64_t pos = r->start;
    for (int64_t k = 0; k < nseg; k++, q += 3 + q[2]) {
        int64_t o = offset + q[0], a, b, ra = 0, rb = 0;
        intptr_t dst = (intptr_t)q[3];
        if (direct_run(q, offset, overlapping, r->al, &pos, &a, &b)) {
            ra = a - o;
            rb = b - o;
        }
        const uint8_t *src = r->st + (o - r->start);
        if (ra > 0) memcpy((void *)dst, src, (size_t)ra);
        if (q[1] > rb) memcpy((void *)(dst + rb), src + rb, (size_t)(q[1] - rb));
        copied += ra + (q[1] - rb);
        for (int64_t d = 1; d < q[2]; d++) {
            memcpy((void *)(intptr_t)q[3 + d], (void *)dst, (size_t)q[1]);
            copied += q[1];
        }
    }
    return copied;
}

/* one read on this thread (its op list at p, advanced past it); returns 0 or an error kind */
static int one_read(const int64_t **pp, scratch_t *s, int64_t max_gap, plan_t *r, int64_t *copied, int64_t *err,
                    int64_t *at) {
    int rc = plan_read(pp, s, max_gap, r);
    if (rc) return rc;
    if (r->need <= 0) { /* nothing to read (a read of 0 bytes) */
        *copied += finish_read(r);
        return 0;
    }
    int i = 0;
    int64_t pos = r->start;
    for (;;) {
        ssize_t n = preadv(r->fd, r->iov + i, r->nbuf - i, pos);
        if (n < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            *at = pos;
            return ERR_OS;
        }
        rc = read_progress(r, &i, &pos, n);
        if (rc == 1) break;
        if (rc) {
            *at = pos;
            return rc;
        }
    }
    *copied += finish_read(r);
    return 0;
}

/* a task's reads are over: its bytes copied to the pool's counter; the batch is over with its last task */
void task_over(task_t *t, int64_t copied) {
    batch_t *b = t->b;
    atomic_fetch_add(&b->pool->copied, copied);
    if (atomic_fetch_sub(&b->remaining, 1) == 1) {
        pthread_mutex_lock(&b->mu);
        b->done = 1;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        batch_unref(b);
    }
}

static void run_task(task_t *t, scratch_t *s, plan_t *r, int64_t max_gap) {
    batch_t *b = t->b;
    struct rusage r0, r1;
    getrusage(RUSAGE_THREAD, &r0);
    int64_t copied = 0;
    const int64_t *p = t->ops;
    while (p < t->end && atomic_load(&b->err_kind) == ERR_NONE) {
        const int64_t *at_read = p;
        int64_t err = 0, at = 0;
        int rc = one_read(&p, s, max_gap, r, &copied, &err, &at);
        if (rc) fail(b, rc, (int64_t)(at_read - b->ops), err, at);
    }
    getrusage(RUSAGE_THREAD, &r1);
    atomic_fetch_add(&b->pool->majflt, r1.ru_majflt - r0.ru_majflt);
    atomic_fetch_add(&b->pool->minflt, r1.ru_minflt - r0.ru_minflt);
    task_over(t, copied);
}

static void *worker(void *arg) {
    pool_t *P = (pool_t *)arg;
    scratch_t s = {NULL, 0, (uint8_t *)malloc((size_t)(P->max_gap > 0 ? P->max_gap : 1))};
    plan_t r; /* 16 KiB of iovecs, on this thread's stack */
    for (;;) {
        pthread_mutex_lock(&P->mu);
        while (!P->head && !P->quit) pthread_cond_wait(&P->cv, &P->mu);
        task_t *t = P->head;
        if (!t) { /* quit, and nothing queued: batches queued before close() finish first */
            pthread_mutex_unlock(&P->mu);
            break;
        }
        P->head = t->next;
        if (!P->head) P->tail = NULL;
        int more = P->head != NULL;
        pthread_mutex_unlock(&P->mu);
        if (more) pthread_cond_signal(&P->cv); /* the next idle worker, woken by this one (sluice_io_submit_many) */
        if (!s.gap) fail(t->b, ERR_NOMEM, 0, 0, 0);
        run_task(t, &s, &r, P->max_gap);
    }
    free(s.stage);
    free(s.gap);
    return NULL;
}

static pool_t *pool_new(int64_t max_gap, int nthreads) {
    pool_t *P = (pool_t *)calloc(1, sizeof(pool_t));
    if (!P) return NULL;
    P->tids = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    if (!P->tids) {
        free(P);
        return NULL;
    }
    pthread_mutex_init(&P->mu, NULL);
    pthread_cond_init(&P->cv, NULL);
    P->max_gap = max_gap;
    return P;
}

static void pool_free(pool_t *P) {
    pthread_mutex_destroy(&P->mu);
    pthread_cond_destroy(&P->cv);
    free(P->tids);
    free(P);
}

/* a pool of `workers` threads; NULL when none could start */
void *sluice_io_open(int workers, int64_t max_gap) {
    pool_t *P = workers >= 1 ? pool_new(max_gap, workers) : NULL;
    if (!P) return NULL;
    for (int i = 0; i < workers; i++) {
        if (pthread_create(&P->tids[i], NULL, worker, P)) break;
        char name[16]; /* what `top -H` / `ps -L` show, and what the tests count: 15 characters at most */
        snprintf(name, sizeof name, "sluice-io-%d", i & 0xffff);
        pthread_setname_np(P->tids[i], name);
        P->nthreads++;
    }
    if (P->nthreads == 0) {
        pool_free(P);
        return NULL;
    }
    return P;
}

/* a pool of one thread driving an io_uring with up to `depth` reads in flight (uring.c); NULL, errno set, when
 * the kernel refuses io_uring (ENOSYS: before 5.1 or built without it; EPERM: a seccomp filter or
 * kernel.io_uring_disabled) or the thread cannot start */
void *sluice_io_open_uring(int depth, int64_t max_gap) {
    pool_t *P = depth >= 1 ? pool_new(max_gap, 1) : NULL;
    if (!P) {
        errno = depth >= 1 ? ENOMEM : EINVAL;
        return NULL;
    }
    if (!(P->ring = uring_open(P, depth))) {
        int e = errno;
        pool_free(P);
        errno = e;
        return NULL;
    }
    if (pthread_create(&P->tids[0], NULL, uring_driver, P)) {
        uring_close(P->ring);
        pool_free(P);
        errno = EAGAIN;
        return NULL;
    }
    pthread_setname_np(P->tids[0], "sluice-io-ring");
    P->nthreads = 1;
    return P;
}

int sluice_io_threads(void *pool) { return ((pool_t *)pool)->nthreads; }

void sluice_io_counters(void *pool, int64_t *out);

/* queued batches finish, the threads stop, their counters go to out[0..2] (sluice_io_counters), the pool is freed */
void sluice_io_close(void *pool, int64_t *out) {
    pool_t *P = (pool_t *)pool;
    pthread_mutex_lock(&P->mu);
    P->quit = 1;
    pthread_cond_broadcast(&P->cv);
    pthread_mutex_unlock(&P->mu);
    if (P->ring) uring_kick(P->ring);
    for (int i = 0; i < P->nthreads; i++) pthread_join(P->tids[i], NULL);
    sluice_io_counters(P, out);
    if (P->ring) uring_close(P->ring);
    pool_free(P);
}

/* a batch of `nparts` parts: ops[0 : ends[0]], ops[ends[0] : ends[1]], ... (copied here, the ends relative to
 * ops); NULL without memory. Not queued yet. */
static batch_t *batch_new(pool_t *P, const int64_t *ops, const int64_t *ends, int64_t nparts) {
    int64_t nops = nparts > 0 ? ends[nparts - 1] : 0;
    batch_t *b = (batch_t *)calloc(1, sizeof(batch_t));
    if (!b) return NULL;
    b->ops = (int64_t *)malloc((size_t)(nops > 0 ? nops : 1) * sizeof(int64_t));
    b->tasks = (task_t *)calloc((size_t)(nparts > 0 ? nparts : 1), sizeof(task_t));
    if (!b->ops || !b->tasks) {
        free(b->ops);
        free(b->tasks);
        free(b);
        return NULL;
    }
    memcpy(b->ops, ops, (size_t)nops * sizeof(int64_t));
    b->pool = P;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    atomic_init(&b->err_kind, ERR_NONE);
    atomic_init(&b->remaining, (int)nparts);
    b->nparts = nparts;
    atomic_init(&b->refs, nparts > 0 ? 2 : 1);
    b->done = nparts <= 0;
    int64_t a = 0;
    for (int64_t i = 0; i < nparts; i++) {
        b->tasks[i] = (task_t){b, b->ops + a, b->ops + ends[i], i + 1 < nparts ? &b->tasks[i + 1] : NULL};
        a = ends[i];
    }
    return b;
}

/* `nbatches` batches in one call, queued in order behind one lock and one wake-up (a streamed decode step queues a
 * layer's missed experts, one batch each: ~6 per layer, ~235 a token of the issue-30 model): batch k has parts[k]
 * parts, its ops and part ends following the previous batch's in `ops` / `ends` (the ends relative to the batch's
 * own ops). out[k]: batch k (the caller's reference: sluice_io_release). Returns 0, or -1 without memory (nothing
 * queued, nothing to release). */
/* the batches out[0 .. nbatches) made by batch_new, queued in order (their first tasks behind the queue's last) */
static void queue(pool_t *P, void **out, int64_t nbatches) {
    pthread_mutex_lock(&P->mu);
    for (int64_t k = 0; k < nbatches; k++) {
        batch_t *b = (batch_t *)out[k];
        int64_t parts = b->nparts;
        if (parts <= 0) continue;
        if (P->tail)
            P->tail->next = &b->tasks[0];
        else
            P->head = &b->tasks[0];
        P->tail = &b->tasks[parts - 1];
    }
    /* One worker woken here; each worker that takes a task and leaves more behind wakes the next. A broadcast woke
     * every idle worker from this call, the model's thread: ~8 wake-ups (cross-CPU interrupts, costly in a VM) a
     * streamed layer, 7.8-8.3 ms of a ~106 ms token of the issue-30 model in this call and its futures
     * (benchmarks/results/hybrid/acquire-parts.txt), against 3.6-4.3 for the io_uring driver's one thread. */
    pthread_cond_signal(&P->cv);
    pthread_mutex_unlock(&P->mu);
    if (P->ring) uring_kick(P->ring);
}

int sluice_io_submit_many(void *pool, const int64_t *ops, const int64_t *ends, const int64_t *parts,
                          int64_t nbatches, void **out) {
    pool_t *P = (pool_t *)pool;
    const int64_t *o = ops, *e = ends;
    for (int64_t k = 0; k < nbatches; k++) {
        out[k] = batch_new(P, o, e, parts[k]);
        if (!out[k]) {
            for (int64_t j = 0; j < k; j++) batch_free((batch_t *)out[j]);  /* none queued: nobody else holds one */
            return -1;
        }
        o += parts[k] > 0 ? e[parts[k] - 1] : 0;
        e += parts[k];
    }
    queue(P, out, nbatches);
    return 0;
}

/* sluice_io_submit_many for batches planned once (io/templates.py ReadTemplate): batch k described by desc[6k ..
 * 6k + 6) = the address of its op list, the address and count of the op indices that hold destination addresses
 * (relative to a base), the address and count of its part ends, and the base this submission adds to them.
 * Each batch's ops are copied and moved to its base here, in C: in Python (numpy concatenation and fancy-indexed
 * adds) it took ~70 us of the model's thread a streamed layer. out[k]: batch k. Returns 0, or -1 without memory
 * (nothing queued). */
int sluice_io_submit_templates(void *pool, const int64_t *desc, int64_t nbatches, void **out) {
    pool_t *P = (pool_t *)pool;
    for (int64_t k = 0; k < nbatches; k++) {
        const int64_t *d = desc + 6 * k;
        const int64_t *ops = (const int64_t *)(intptr_t)d[0], *dests = (const int64_t *)(intptr_t)d[1];
        const int64_t *ends = (const int64_t *)(intptr_t)d[3];
        batch_t *b = batch_new(P, ops, ends, d[4]);
        out[k] = b;
        if (!b) {
            for (int64_t j = 0; j < k; j++) batch_free((batch_t *)out[j]);
            return -1;
        }
        for (int64_t i = 0; i < d[2]; i++) b->ops[dests[i]] += d[5];
    }
    queue(P, out, nbatches);
    return 0;
}

/* -1 while the batch runs; once it is over, its error kind (0: every byte landed) */
int sluice_io_done(void *batch) {
    batch_t *b = (batch_t *)batch;
    return atomic_load(&b->remaining) <= 0 ? atomic_load(&b->err_kind) : -1;
}

/* wait until the batch is over, at most timeout_ns (< 0: no limit); then as sluice_io_done */
int sluice_io_wait(void *batch, int64_t timeout_ns) {
    batch_t *b = (batch_t *)batch;
    if (atomic_load(&b->remaining) <= 0) return atomic_load(&b->err_kind);
    pthread_mutex_lock(&b->mu);
    if (timeout_ns < 0) {
        while (!b->done) pthread_cond_wait(&b->cv, &b->mu);
    } else {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_sec += timeout_ns / 1000000000;
        t.tv_nsec += timeout_ns % 1000000000;
        if (t.tv_nsec >= 1000000000) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000;
        }
        while (!b->done && pthread_cond_timedwait(&b->cv, &b->mu, &t) != ETIMEDOUT) {
        }
    }
    int done = b->done;
    pthread_mutex_unlock(&b->mu);
    return done ? atomic_load(&b->err_kind) : -1;
}

/* a failed batch's error: out[0..3] = error kind, op index of the failed read, errno, file position */
void sluice_io_error(void *batch, int64_t *out) {
    batch_t *b = (batch_t *)batch;
    out[0] = atomic_load(&b->err_kind);
    out[1] = b->err_read;
    out[2] = b->err_errno;
    out[3] = b->err_pos;
}

/* the pool's counters so far: out[0..2] = bytes copied out of staging or into duplicates, major and minor faults of
 * its threads */
void sluice_io_counters(void *pool, int64_t *out) {
    pool_t *P = (pool_t *)pool;
    out[0] = atomic_load(&P->copied);
    out[1] = atomic_load(&P->majflt);
    out[2] = atomic_load(&P->minflt);
}

/* the caller's reference dropped (its parts still running keep the batch until they are over) */
void sluice_io_release(void *batch) { batch_unref((batch_t *)batch); }
