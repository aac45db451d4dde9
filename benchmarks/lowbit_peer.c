/* llama.cpp's own CPU dot kernels on a projection, for benchmarks/lowbit_kernels.py: the ggml CPU type traits of a
 * weight type (from_float: x to the type's vec_dot_type, Q8_K or Q8_0; vec_dot: one weight row against it), found
 * through ggml_get_type_traits_cpu in the peers' libggml-cpu.so (benchmarks/peers/setup.sh) and called as ggml's
 * mul_mat calls them for one x row: x converted once, then vec_dot per weight row, on this thread. Built by the
 * script with gcc; only the struct below is declared here (ggml-cpu.h's ggml_type_traits_cpu, 0.3.36's sdist).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

typedef void (*from_float_t)(const float *x, void *y, int64_t k);
typedef void (*vec_dot_t)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc);
typedef struct {
    from_float_t from_float;
    vec_dot_t vec_dot;
    int vec_dot_type;  /* enum ggml_type */
    int64_t nrows;
} traits_cpu;
typedef const traits_cpu *(*get_traits_t)(int type);
typedef size_t (*row_size_t)(int type, int64_t ne);

static double now_ns(void) {  /* this thread's CPU time, as the script's other arms (time.thread_time) */
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return 1e9 * (double)t.tv_sec + (double)t.tv_nsec;
}

/* y [N] = W [N, K] (type `type`, rows of row_bytes) x [K], `reps` times; ns[i]: the i-th call's thread CPU time.
 * Returns 0, -1 when the type has no CPU vec_dot, -2 when memory is short. */
int peer_time(void *get_traits, void *row_size, int type, const uint8_t *w, size_t row_bytes, int64_t N, int64_t K,
              const float *x, float *y, int reps, double *ns) {
    const traits_cpu *t = ((get_traits_t)get_traits)(type);
    if (!t || !t->vec_dot || !t->nrows) return -1;
    const traits_cpu *q = ((get_traits_t)get_traits)(t->vec_dot_type);
    void *xq = malloc(((row_size_t)row_size)(t->vec_dot_type, K) + 64);
    if (!xq) return -2;
    for (int i = 0; i < reps; i++) {
        double t0 = now_ns();
        q->from_float(x, xq, K);
        for (int64_t n = 0; n < N; n++) t->vec_dot((int)K, y + n, 0, w + n * row_bytes, 0, xq, 0, 1);
        ns[i] = now_ns() - t0;
    }
    free(xq);
    return 0;
}
