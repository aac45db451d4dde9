/* One output row's dot product from FP8 codes (fp8.h's fp8x16, then FMA into 4 accumulators, as kernels.c's T = 1
 * path) against the same from int8 codes (Q8_0's decoding), rows of 2,048 weights, in cache (4 rows) and out of it
 * (16,384 rows: 32 MiB), and with the FP8 codes prefetched 256 / 1024 / 2048 / 4096 bytes ahead: where
 * sluice/quant/native/fp8.h's FP8_PREFETCH comes from. One thread; ns per weight over ~2e9 weights per arm.
 *
 *     gcc -O3 -ffp-contract=off -std=c11 -Isluice/quant/native benchmarks/fp8/dot.c -o /tmp/fp8_dot -lm
 *     /tmp/fp8_dot
 */
#include "fp8.h"

#include <stdio.h>
#include <time.h>

#define K 2048

AVX2_INLINE float hsum4(__m256 *acc) {
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    return ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
}

AVX2 static float dot_fp8(const uint8_t *q, const float *x, float s, int64_t pf) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 s256 = _mm256_set1_ps(s * 256.0f);
    for (int64_t k = 0; k < K; k += 32) {
        if (pf) _mm_prefetch((const char *)(q + k + pf), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256 lo, hi;
            fp8x16(q + k + 16 * h, s, s256, 0, &lo, &hi);
            acc[2 * h] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + k + 16 * h), acc[2 * h]);
            acc[2 * h + 1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + k + 16 * h + 8), acc[2 * h + 1]);
        }
    }
    return hsum4(acc);
}

AVX2 static float dot_int8(const uint8_t *q, const float *x, float s, int64_t pf) {
    (void)pf;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 vs = _mm256_set1_ps(s);
    for (int64_t k = 0; k < K; k += 32)
        for (int j = 0; j < 4; j++) {
            __m128i c = _mm_loadl_epi64((const __m128i *)(q + k + 8 * j));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), vs);
            acc[j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + k + 8 * j), acc[j]);
        }
    return hsum4(acc);
}

static void run(const char *name, float (*f)(const uint8_t *, const float *, float, int64_t), const uint8_t *q,
                const float *x, int64_t rows, int64_t pf) {
    volatile float sink = 0;
    long passes = 2000000000L / (K * rows);
    clock_t c = clock();
    for (long p = 0; p < passes; p++)
        for (int64_t r = 0; r < rows; r++) sink += f(q + r * K, x, 0.5f, pf);
    printf("%-5s rows %5ld prefetch %4ld: %.3f ns/weight\n", name, (long)rows, (long)pf,
           (double)(clock() - c) / CLOCKS_PER_SEC * 1e9 / ((double)passes * K * rows));
}

int main(void) {
    const int64_t big = 16384;
    uint8_t *q = aligned_alloc(64, K * big);
    float *x = aligned_alloc(64, K * 4);
    for (int64_t i = 0; i < K * big; i++) q[i] = (uint8_t)(i * 37 % 126);  /* finite codes */
    for (int i = 0; i < K; i++) x[i] = 0.001f * i;
    int64_t pfs[] = {0, 256, 1024, 2048, 4096};
    for (int i = 0; i < 5; i++) run("fp8", dot_fp8, q, x, 4, pfs[i]);
    run("int8", dot_int8, q, x, 4, 0);
    for (int i = 0; i < 5; i++) run("fp8", dot_fp8, q, x, big, pfs[i]);
    run("int8", dot_int8, q, x, big, 0);
    return 0;
}
