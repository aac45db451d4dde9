/* FP8 weights with block scales (quant/fp8.py: DeepSeek-V3 / R1, Kimi K2, the Qwen3 FP8 uploads), for kernels.c's
 * FP8 format: `q` the float8_e4m3fn codes [N, K] (row_bytes K), `s` the `weight_scale_inv` [ceil(N / bn),
 * ceil(K / gs)] (gs = bk, a multiple of 32, so each 32-value step of a row has one scale), `sdt` the scales' dtype
 * (S_F32 / S_F16 / S_BF16) in its low byte and the block's rows bn above it (scale dtype | bn << 8: _lib.py layout).
 *
 * A weight is fp8_e4m3_float(code) * scale, one float32 product of two exact values: bitwise transformers' and
 * dequantize_fp8's. e4m3fn has no infinities: code 0x7f / 0xff is NaN (the bits torch's conversion gives, 0x7ff00000
 * with the sign), codes 0x01-0x07 the subnormals m * 2^-9. The AVX2 path computes the same products through half
 * floats (fp8x16), so both paths give the same weights, and FP8 rows are dotted in the AVX2 path's order on both
 * (fp8_dot_scalar), so the same outputs too. */
#ifndef SLUICE_NATIVE_FP8_H
#define SLUICE_NATIVE_FP8_H

#include "common.h"

/* bytes ahead of the codes being converted that the AVX2 path prefetches (the next row's, past a row's end). Without
 * it a row's dot product over codes out of cache took 0.397 ns a weight against 0.108 in cache (int8 codes: 0.093
 * and 0.054); prefetched 256 bytes ahead 0.375, 1024 0.144, 2048 0.116, 4096 0.112 (one thread, 2-core Sapphire
 * Rapids VM: benchmarks/fp8/dot.c, benchmarks/results/fp8/dot.txt). With it a DeepSeek-V3 expert at T = 1 takes
 * 7.3 ms, Q8_0 blocks of the same shape 4.8, bf16 weights through F.linear 6.6 (benchmarks/fp8/kernel.py,
 * results/fp8/kernel.txt) */
#define FP8_PREFETCH 2048

static inline float fp8_e4m3_float(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80) << 24, em = b & 0x7f;
    if (em == 0x7f) return f32_bits(sign | 0x7ff00000u);
    if (em < 8) {  /* zero or subnormal: m * 2^-9, exact */
        float f = (float)em * (1.0f / 512.0f);
        return sign ? -f : f;
    }
    return f32_bits(sign | ((em << 20) + (120u << 23)));  /* exponent e - 7 + 127, mantissa m at the top */
}

/* scale i of the scales (row-major [ceil(N / bn), ceil(K / gs)]) */
static inline float fp8_scale(const wdesc *w, int64_t i) {
    int dt = w->sdt & 0xff;
    if (dt == S_F32) { float f; memcpy(&f, w->s + 4 * i, 4); return f; }
    uint16_t h = rd16(w->s + 2 * i);
    return dt == S_F16 ? f16_to_f32(h) : bf16_float(h);
}

/* the index of row n's first scale */
static inline int64_t fp8_row_scales(const wdesc *w, int64_t n) {
    return (n / (w->sdt >> 8)) * ((w->K + w->gs - 1) / w->gs);
}

static inline void fp8_row_scalar(const wdesc *w, int64_t n, float *o) {
    const uint8_t *row = w->q + n * w->row_bytes;
    int64_t i = fp8_row_scales(w, n);
    for (int64_t b = 0; b < w->K; b += w->gs, i++) {
        float s = fp8_scale(w, i);
        int64_t end = b + w->gs < w->K ? b + w->gs : w->K;
        for (int64_t k = b; k < end; k++) o[k] = fp8_e4m3_float(row[k]) * s;
    }
}

/* one row against x in the AVX2 path's order (kernels.c dot1 / hsum): 4 accumulators of 8 lanes over 32-value steps,
 * fused multiply-adds, then ((a0 + a1) + (a2 + a3)) lane-wise, its halves added, then (v0 + v2) + (v1 + v3) */
static inline float fp8_dot_scalar(const float *w, const float *x, int64_t K) {
    float a[4][8] = {{0}};
    for (int64_t k = 0; k < K; k += 32)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 8; l++) a[j][l] = fmaf(w[k + 8 * j + l], x[k + 8 * j + l], a[j][l]);
    float s[8], v[4];
    for (int l = 0; l < 8; l++) s[l] = (a[0][l] + a[1][l]) + (a[2][l] + a[3][l]);
    for (int l = 0; l < 4; l++) v[l] = s[l] + s[l + 4];
    return (v[0] + v[2]) + (v[1] + v[3]);
}

#if SLUICE_X86
/* 16 codes times their block's scale s -> lo (codes 0-7), hi (8-15), fp8_e4m3_float(code) * s bit for bit. A code's
 * value / 256 is an exact half float (e4m3 is f16 with 3 fewer exponent bits: sign, then the 7 other bits shifted
 * down by 1, NaN 0x7f given f16's NaN 0x7f80, which widens to 0x7ff00000 as torch's), widened by F16C and multiplied
 * by s256 = s * 256: the same real product as code * s, so the same rounding, while s * 256 is exact, i.e. finite
 * (scales are amax / 448 < 2^120). 0.091 ns a weight, against 0.106 multiplying by 256 then by s and 0.196 for a
 * first version decoding in 32-bit integer lanes (fp8_e4m3_float's steps, blends for subnormals and NaN): in L1, one
 * thread (benchmarks/fp8/convert.c, benchmarks/results/fp8/convert.txt). `big` (s * 256 overflows): the scalar
 * products. */
AVX2_INLINE void fp8x16(const uint8_t *p, float s, __m256 s256, int big, __m256 *lo, __m256 *hi) {
    if (big) {
        float v[16];
        for (int j = 0; j < 16; j++) v[j] = fp8_e4m3_float(p[j]) * s;
        *lo = _mm256_loadu_ps(v);
        *hi = _mm256_loadu_ps(v + 8);
        return;
    }
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i em = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(em, 7),
                                _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    __m256i nan = _mm256_cmpeq_epi16(em, _mm256_set1_epi16(0x7f));
    h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000)));
    *lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s256);
    *hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s256);
}

/* 8 weights v for the values at o: stored at o (x NULL), or dotted with x's values at the same offset into acc[j]
 * (kernels.c emit16's contract) */
AVX2_INLINE void fp8_emit8(__m256 v, float *o, int j, const float *x, const float *o0, __m256 *acc) {
    if (x) acc[j] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + (o - o0)), acc[j]);
    else _mm256_storeu_ps(o, v);
}
#endif

#endif
