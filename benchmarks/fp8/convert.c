/* How fast AVX2 turns e4m3 codes into weights (code value * block scale), three ways, on 2,048 codes in L1, one
 * thread: what sluice/quant/native/fp8.h's fp8x16 chose.
 *
 *     gcc -O3 -ffp-contract=off -std=c11 -Isluice/quant/native benchmarks/fp8/convert.c -o /tmp/fp8_convert -lm
 *     /tmp/fp8_convert
 *
 * lanes: the first version, fp8_e4m3_float's steps in 32-bit integer lanes (exponent rebias, blends for the
 *        subnormals and NaN), then * s;
 * f16x2: the code as a half float (value / 256, exact), widened by F16C, * 256, then * s;
 * f16:   the same with 256 folded into the scale (fp8x16: * (s * 256)).
 * Each is checked against fp8_e4m3_float(code) * s bit for bit over all 256 codes first. Prints ns per weight, the
 * median of 9 runs of 100,000 passes. */
#include "fp8.h"

#include <stdio.h>
#include <time.h>

#define N 2048

AVX2_INLINE __m256 lanes8(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
    __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em)));
    __m256i nan = _mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7f));
    v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7ff00000)), _mm256_castsi256_ps(nan));
    return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

AVX2 static void lanes(const uint8_t *q, float *o, float s) {
    __m256 vs = _mm256_set1_ps(s);
    for (int k = 0; k < N; k += 8) _mm256_storeu_ps(o + k, _mm256_mul_ps(lanes8(q + k), vs));
}

AVX2 static void f16x2(const uint8_t *q, float *o, float s) {
    __m256 k256 = _mm256_set1_ps(256.0f), vs = _mm256_set1_ps(s);
    for (int k = 0; k < N; k += 16) {
        __m256 lo, hi;
        fp8x16(q + k, 1.0f / 256.0f, _mm256_set1_ps(1.0f), 0, &lo, &hi);  /* the half floats widened: value / 256 */
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_mul_ps(lo, k256), vs));
        _mm256_storeu_ps(o + k + 8, _mm256_mul_ps(_mm256_mul_ps(hi, k256), vs));
    }
}

AVX2 static void f16(const uint8_t *q, float *o, float s) {
    __m256 s256 = _mm256_set1_ps(s * 256.0f);
    for (int k = 0; k < N; k += 16) {
        __m256 lo, hi;
        fp8x16(q + k, s, s256, 0, &lo, &hi);
        _mm256_storeu_ps(o + k, lo);
        _mm256_storeu_ps(o + k + 8, hi);
    }
}

static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

int main(void) {
    static uint8_t q[N];
    static float o[N];
    void (*fns[3])(const uint8_t *, float *, float) = {lanes, f16x2, f16};
    const char *names[3] = {"lanes", "f16x2", "f16"};
    for (int i = 0; i < N; i++) q[i] = (uint8_t)(i * 37);  /* every code, 8 times */
    for (int f = 0; f < 3; f++) {
        fns[f](q, o, 0.0123f);
        for (int i = 0; i < N; i++) {
            float want = fp8_e4m3_float(q[i]) * 0.0123f;
            if (memcmp(&want, o + i, 4)) { printf("%s: code 0x%02x differs\n", names[f], q[i]); return 1; }
        }
    }
    for (int f = 0; f < 3; f++) {
        double t[9];
        for (int r = 0; r < 9; r++) {
            clock_t c = clock();
            for (int p = 0; p < 100000; p++) fns[f](q, o, 0.0123f + (float)p);
            t[r] = (double)(clock() - c) / CLOCKS_PER_SEC * 1e9 / (100000.0 * N);
        }
        qsort(t, 9, sizeof t[0], cmp);
        printf("%s %.3f ns/weight\n", names[f], t[4]);
    }
    return 0;
}
