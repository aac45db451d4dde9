/* preader.c and uring.c: the direct reader's batches, tasks and pool, and one read's plan (the iovecs it reads into,
 * the copies after it), shared by the thread pool (preader.c) and the io_uring driver (uring.c). */
#pragma once
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/uio.h>

#define ALIGN 4096 /* staging buffers start at a page: any file's O_DIRECT alignment (512-4096) divides it */
#define MAX_IOV 1024 /* IOV_MAX on Linux; a read has at most 500 segments (ranges.MAX_SEGMENTS), 2 buffers each */

enum { ERR_NONE = 0, ERR_OS = 1, ERR_EOF = 2, ERR_NOMEM = 3, ERR_BAD = 4 };

typedef struct batch batch_t;

typedef struct task {
    batch_t *b;
    const int64_t *ops, *end;
    struct task *next;
    const int64_t *next_op; /* uring.c: the next read to issue, and reads issued and not yet over */
    int pending;
} task_t;

struct batch {
    atomic_int remaining; /* parts not yet over */
    atomic_int refs;      /* the caller's reference + 1 while parts remain: the last one frees */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;                   /* under mu */
    atomic_int err_kind;        /* the first error wins (CAS from ERR_NONE) */
    int64_t err_read, err_errno, err_pos;
    struct pool *pool;
    int64_t *ops;
    task_t *tasks;
    int64_t nparts;
};

typedef struct pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    task_t *head, *tail;
    int quit, nthreads;
    pthread_t *tids;
    int64_t max_gap;
    atomic_llong copied, majflt, minflt; /* the reader's stats, all batches together */
    struct uring *ring; /* uring.c's driver (its one thread is tids[0]); NULL: nthreads workers doing preadv */
} pool_t;

typedef struct { /* a worker's buffers, grown on demand */
    uint8_t *stage;
    int64_t stage_n;
    uint8_t *gap;
} scratch_t;

enum { READ_GAPS = 0, READ_WINDOW = 1, READ_DIRECT = 2 };

typedef struct { /* one read, planned: preadv into iov[i..nbuf) at file position pos until pos - start >= need */
    const int64_t *op, *seg0;  /* its ops (fd at op[0]), its first segment */
    int fd, mode, nbuf;
    int64_t al, start, need;
    uint8_t *st;               /* the staging window (READ_WINDOW, READ_DIRECT) */
    struct iovec iov[MAX_IOV];
} plan_t;

void fail(batch_t *b, int kind, int64_t read, int64_t err, int64_t pos);
int plan_read(const int64_t **pp, scratch_t *s, int64_t max_gap, plan_t *r);
int read_progress(plan_t *r, int *i, int64_t *pos, int64_t n);
int64_t finish_read(const plan_t *r);
void task_over(task_t *t, int64_t copied);

/* uring.c */
struct uring *uring_open(pool_t *P, int depth);
void *uring_driver(void *arg);
void uring_kick(struct uring *U);
void uring_close(struct uring *U);
