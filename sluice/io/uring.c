/* The direct reader's io_uring driver: one thread keeps up to `depth` reads in flight in an io_uring, instead of
 * `depth` threads each blocked in its own preadv (preader.c's pool; the same batches, op lists, read plans, errors
 * and counters: preader.h).
 *
 * Why: a streamed decode step of the issue-30 model reads 61 MiB in 806 reads a token; on the 2-core AMD EPYC VM the
 * thread pool spent ~32 ms of system CPU a token on them and ~1,500 context switches beside the model's two
 * threads, against ~11-15 ms for the same reads submitted in batches to an io_uring (a C prototype, 806 O_DIRECT
 * reads of 76 KiB in batches of 20: benchmarks/results/hybrid/uring-proto.txt). Each batch the caller queues is one
 * wake-up of this thread (an eventfd read in the ring) and one io_uring_enter for all its reads that fit.
 *
 * The driver takes tasks first to last, as the workers do, and issues their reads in order; a read that comes back
 * short is issued again for the rest (as preadv_full loops); a complete read's copies (staging, duplicates) run
 * here; a task is over when its last read is; the first error of a batch is kept and its other reads not issued.
 * Each slot (a read in flight) keeps its own staging buffer, grown on demand, and its plan's iovecs (stable while
 * the kernel may read them).
 */
#include "preader.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#if defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#define HAVE_URING 1
#endif
#endif

#ifndef HAVE_URING /* built without the kernel's io_uring header: the engine reports itself unavailable */
struct uring *uring_open(pool_t *P, int depth) {
    (void)P;
    (void)depth;
    errno = ENOSYS;
    return NULL;
}
void *uring_driver(void *arg) {
    (void)arg;
    return NULL;
}
void uring_kick(struct uring *U) { (void)U; }
void uring_close(struct uring *U) { (void)U; }
#else
#include <linux/io_uring.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>

#define KICK_TAG 1 /* the eventfd read's user_data; a slot's is its (aligned) address */

typedef struct slot {
    plan_t r;
    scratch_t s; /* its staging; the driver's gap buffer */
    task_t *t;
    int i;            /* the first buffer not yet full */
    int64_t pos;      /* the file position it continues from */
    int64_t read;     /* its index in the batch's ops (errors name it) */
    struct slot *next_free;
} slot_t;

struct uring {
    pool_t *P;
    int fd, efd, depth, inflight;
    unsigned to_submit;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map, *sqe_map;
    size_t sq_len, cq_len, sqe_len;
    slot_t *slots, *free;
    uint8_t *gap;
    uint64_t kick_val;
    struct iovec kick_iov;
};

static int sys_setup(unsigned entries, struct io_uring_params *p) {
    return (int)syscall(__NR_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned submit, unsigned wait) {
    return (int)syscall(__NR_io_uring_enter, fd, submit, wait, wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
}

void uring_close(struct uring *U) {
    if (!U) return;
    if (U->sqe_map && U->sqe_map != MAP_FAILED) munmap(U->sqe_map, U->sqe_len);
    if (U->cq_map && U->cq_map != MAP_FAILED && U->cq_map != U->sq_map) munmap(U->cq_map, U->cq_len);
    if (U->sq_map && U->sq_map != MAP_FAILED) munmap(U->sq_map, U->sq_len);
    if (U->fd >= 0) close(U->fd);
    if (U->efd >= 0) close(U->efd);
    if (U->slots)
        for (int k = 0; k < U->depth; k++) free(U->slots[k].s.stage);
    free(U->slots);
    free(U->gap);
    free(U);
}

struct uring *uring_open(pool_t *P, int depth) {
    struct uring *U = (struct uring *)calloc(1, sizeof(struct uring));
    if (!U) {
        errno = ENOMEM;
        return NULL;
    }
    U->P = P;
    U->depth = depth;
    U->fd = U->efd = -1;
    unsigned entries = 2;
    while (entries < (unsigned)depth + 1) entries *= 2; /* the reads in flight and the eventfd read */
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int e = 0;
    if ((U->fd = sys_setup(entries, &p)) < 0) goto failed;
    U->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    U->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (U->cq_len > U->sq_len) U->sq_len = U->cq_len;
        U->cq_len = U->sq_len;
    }
    U->sq_map = mmap(NULL, U->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, U->fd, IORING_OFF_SQ_RING);
    if (U->sq_map == MAP_FAILED) goto failed;
    U->cq_map = (p.features & IORING_FEAT_SINGLE_MMAP)
                    ? U->sq_map
                    : mmap(NULL, U->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, U->fd,
                           IORING_OFF_CQ_RING);
    if (U->cq_map == MAP_FAILED) goto failed;
    U->sqe_len = p.sq_entries * sizeof(struct io_uring_sqe);
    U->sqe_map = mmap(NULL, U->sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, U->fd, IORING_OFF_SQES);
    if (U->sqe_map == MAP_FAILED) goto failed;
    char *sq = (char *)U->sq_map, *cq = (char *)U->cq_map;
    U->sq_head = (unsigned *)(sq + p.sq_off.head);
    U->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    U->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    U->sq_array = (unsigned *)(sq + p.sq_off.array);
    U->cq_head = (unsigned *)(cq + p.cq_off.head);
    U->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    U->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    U->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    U->sqes = (struct io_uring_sqe *)U->sqe_map;
    if ((U->efd = eventfd(0, EFD_CLOEXEC)) < 0) goto failed;
    U->slots = (slot_t *)calloc((size_t)depth, sizeof(slot_t));
    U->gap = (uint8_t *)malloc((size_t)(P->max_gap > 0 ? P->max_gap : 1));
    if (!U->slots || !U->gap) {
        errno = ENOMEM;
        goto failed;
    }
    for (int k = 0; k < depth; k++) {
        U->slots[k].s.gap = U->gap;
        U->slots[k].next_free = k + 1 < depth ? &U->slots[k + 1] : NULL;
    }
    U->free = U->slots;
    U->kick_iov = (struct iovec){&U->kick_val, sizeof U->kick_val};
    return U;
failed:
    e = errno;
    uring_close(U);
    errno = e;
    return NULL;
}

/* wake the driver: new tasks queued, or close() */
void uring_kick(struct uring *U) {
    uint64_t one = 1;
    while (write(U->efd, &one, sizeof one) < 0 && errno == EINTR) {
    }
}

/* an SQE at the ring's tail (only this thread writes it; the ring holds depth + 1 entries, never more in use) */
static void push(struct uring *U, int fd, const struct iovec *iov, int niov, int64_t off, uint64_t tag) {
    unsigned tail = *U->sq_tail, idx = tail & *U->sq_mask;
    struct io_uring_sqe *e = &U->sqes[idx];
    memset(e, 0, sizeof *e);
    e->opcode = IORING_OP_READV;
    e->fd = fd;
    e->addr = (uint64_t)(uintptr_t)iov;
    e->len = (uint32_t)niov;
    e->off = (uint64_t)off;
    e->user_data = tag;
    U->sq_array[idx] = idx;
    __atomic_store_n(U->sq_tail, tail + 1, __ATOMIC_RELEASE);
    U->to_submit++;
}

static void push_read(struct uring *U, slot_t *s) {
    push(U, s->r.fd, s->r.iov + s->i, s->r.nbuf - s->i, s->pos, (uint64_t)(uintptr_t)s);
}

static void release(struct uring *U, slot_t *s) {
    task_t *t = s->t;
    U->inflight--;
    s->next_free = U->free;
    U->free = s;
    if (--t->pending == 0 && t->next_op >= t->end) task_over(t, 0); /* may free the batch: t is not touched after */
}

/* the task's next read into a free slot: 1 when issued (or, reading nothing, done here), 0 when the task has none
 * left to issue */
static int issue(struct uring *U, task_t *t) {
    batch_t *b = t->b;
    if (t->next_op >= t->end || atomic_load(&b->err_kind) != ERR_NONE) {
        t->next_op = t->end;
        return 0;
    }
    slot_t *s = U->free;
    const int64_t *at = t->next_op;
    int rc = plan_read(&t->next_op, &s->s, U->P->max_gap, &s->r);
    if (rc) {
        fail(b, rc, (int64_t)(at - b->ops), 0, 0);
        t->next_op = t->end;
        return 0;
    }
    if (s->r.need <= 0) { /* nothing to read (a read of 0 bytes): its copies, if any, now */
        atomic_fetch_add(&U->P->copied, finish_read(&s->r));
        return 1;
    }
    U->free = s->next_free;
    s->t = t;
    s->i = 0;
    s->pos = s->r.start;
    s->read = (int64_t)(at - b->ops);
    t->pending++;
    U->inflight++;
    push_read(U, s);
    return 1;
}

static void complete(struct uring *U, slot_t *s, int res) {
    batch_t *b = s->t->b;
    if (res == -EINTR || res == -EAGAIN) {
        push_read(U, s);
        return;
    }
    if (res < 0) {
        fail(b, ERR_OS, s->read, -res, s->pos);
    } else {
        int rc = read_progress(&s->r, &s->i, &s->pos, res);
        if (rc == 0) {
            push_read(U, s);
            return;
        }
        if (rc == 1)
            atomic_fetch_add(&U->P->copied, finish_read(&s->r));
        else
            fail(b, rc, s->read, 0, s->pos);
    }
    release(U, s);
}

/* the SQEs the kernel refused to take (io_uring_enter failed with something other than EINTR / EAGAIN / EBUSY):
 * their reads fail with that errno, the ring's tail goes back to its head; returns whether the eventfd read was
 * among them (to be armed again) */
static int refuse(struct uring *U, int err) {
    int kick = 0;
    unsigned head = __atomic_load_n(U->sq_head, __ATOMIC_ACQUIRE), tail = *U->sq_tail;
    for (unsigned k = head; k != tail; k++) {
        struct io_uring_sqe *e = &U->sqes[U->sq_array[k & *U->sq_mask]];
        if (e->user_data == KICK_TAG) {
            kick = 1;
            continue;
        }
        slot_t *s = (slot_t *)(uintptr_t)e->user_data;
        fail(s->t->b, ERR_OS, s->read, err, s->pos);
        release(U, s);
    }
    __atomic_store_n(U->sq_tail, head, __ATOMIC_RELEASE);
    U->to_submit = 0;
    return kick;
}

/* every completion there is; returns whether the eventfd read was one */
static int reap(struct uring *U) {
    int kicked = 0;
    unsigned head = *U->cq_head;
    while (head != __atomic_load_n(U->cq_tail, __ATOMIC_ACQUIRE)) {
        struct io_uring_cqe *c = &U->cqes[head & *U->cq_mask];
        uint64_t tag = c->user_data;
        int res = c->res;
        __atomic_store_n(U->cq_head, ++head, __ATOMIC_RELEASE);
        if (tag == KICK_TAG)
            kicked = 1;
        else
            complete(U, (slot_t *)(uintptr_t)tag, res);
    }
    return kicked;
}

void *uring_driver(void *arg) {
    pool_t *P = (pool_t *)arg;
    struct uring *U = P->ring;
    task_t *cur = NULL;
    int quit = 0, armed = 0;
    struct rusage r0, r1;
    getrusage(RUSAGE_THREAD, &r0);
    for (;;) {
        if (!armed) { /* the eventfd's counter read: completes when a batch is queued, or at close() */
            push(U, U->efd, &U->kick_iov, 1, 0, KICK_TAG);
            armed = 1;
        }
        while (U->inflight < U->depth) { /* tasks first to last, their reads in order, up to the depth */
            if (!cur) {
                pthread_mutex_lock(&P->mu);
                cur = P->head;
                if (cur) {
                    P->head = cur->next;
                    if (!P->head) P->tail = NULL;
                }
                quit = P->quit;
                pthread_mutex_unlock(&P->mu);
                if (!cur) break;
                cur->next_op = cur->ops;
                cur->pending = 0;
            }
            if (!issue(U, cur) || cur->next_op >= cur->end) { /* nothing more to issue */
                task_t *t = cur;
                cur = NULL;
                if (t->pending == 0) task_over(t, 0); /* else its last read's completion ends it (release) */
            }
        }
        if (quit && !cur && U->inflight == 0) break; /* close(): the queue is empty and every read is over */
        int n = sys_enter(U->fd, U->to_submit, 1);
        if (n >= 0) {
            U->to_submit -= (unsigned)n < U->to_submit ? (unsigned)n : U->to_submit;
        } else if (errno != EINTR && errno != EAGAIN && errno != EBUSY) {
            if (refuse(U, errno)) armed = 0;
        }
        if (reap(U)) armed = 0;
        getrusage(RUSAGE_THREAD, &r1);
        atomic_fetch_add(&P->majflt, r1.ru_majflt - r0.ru_majflt);
        atomic_fetch_add(&P->minflt, r1.ru_minflt - r0.ru_minflt);
        r0 = r1;
    }
    return NULL;
}
#endif
