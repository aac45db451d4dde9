/* One low-bit super-block type's AVX2 row kernel (q8_low.c's low_q8_dot_avx2 at one x row), timed alone: the weights
 * and the coded x row come from files that benchmarks/lowbit_block.py writes (random valid blocks with sane f16
 * scales, x coded by sluice's own quantizer), every row of the [N x K] matrix once per call, the best of `reps` calls
 * in thread CPU time; prints that and an FNV-1a hash of the outputs' bits (two builds that compute the same bits print
 * the same hash). Built by lowbit_block.py against a source tree's q8_low.c and lowbit.c:
 *
 *     lowbit_block FMT N K WEIGHTS.bin X.bin REPS
 */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "lowbit.h"
#include "q8.h"

static double thread_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *slurp(const char *path, size_t want) {
    FILE *f = fopen(path, "rb");
    void *p = malloc(want);
    if (!f || !p || fread(p, 1, want, f) != want) {
        fprintf(stderr, "lowbit_block: cannot read %zu bytes from %s\n", want, path);
        exit(2);
    }
    fclose(f);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: lowbit_block FMT N K WEIGHTS.bin X.bin REPS\n");
        return 2;
    }
    const int fmt = atoi(argv[1]), reps = atoi(argv[6]);
    const int64_t N = atoll(argv[2]), K = atoll(argv[3]);
    if (!low_q8_sb(fmt) || K % 256) {
        fprintf(stderr, "lowbit_block: format %d is not a 256-value type, or K %% 256 != 0\n", fmt);
        return 2;
    }
    const int64_t row = K / 256 * lowbit_block_bytes(fmt), xb = K / 256 * SB1;
    const uint8_t *w = slurp(argv[4], (size_t)(N * row)), *x = slurp(argv[5], (size_t)xb);
    float *y = malloc((size_t)N * sizeof(float));
    const dot_fn dot = low_q8_dot_avx2(fmt, 4, 1);  /* layout 4: one plane in super-blocks (q8.h SB1) */
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t = thread_s();
        for (int64_t n = 0; n < N; n++) dot(w + n * row, x, xb, K, y + n, N);
        const double s = thread_s() - t;
        best = s < best ? s : best;
    }
    uint64_t h = 1469598103934665603ull;
    const uint8_t *yb = (const uint8_t *)y;
    for (size_t i = 0; i < (size_t)N * sizeof(float); i++) h = (h ^ yb[i]) * 1099511628211ull;
    printf("%.2f %016llx\n", best * 1e6, (unsigned long long)h);
    return 0;
}
