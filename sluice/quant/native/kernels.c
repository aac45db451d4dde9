/* y[T, N] = x[T, K] @ W^T straight from W's stored bytes (GGUF blocks as on disk, MLX affine 4/8-bit, or FP8 e4m3
 * codes with their block scales: fp8.h).
 *
 * Called through ctypes (sluice/quant/native/__init__.py checks every argument first); single-threaded, no
 * globals written after the first call, so several Python threads may run it at once (ctypes releases the GIL).
 *
 * Per output row n: the row is dequantized once into a float32 buffer (K floats, in L1), exactly as the reference
 * does it (sluice/quant/ggml.py, gguf.quants.dequantize: scale * code, then + bias, each rounded once in float32;
 * this file is built with -ffp-contract=off so the compiler never fuses those two), then dotted with every x row
 * with FMA accumulation. Each dot product has a fixed order (4 vector accumulators over 32-value steps, then a
 * fixed reduction tree) that depends on K only: not on T, on the row range of the call, or on the thread; so the
 * output is deterministic and row t of y is the same whatever T is.
 *
 * Two paths with the same structure: AVX2+FMA+F16C (functions marked AVX2, chosen at run time with
 * __builtin_cpu_supports) and portable scalar C (any x86-64 or aarch64). They agree on the weights bit for bit
 * and in the dot products too: the portable dots follow the AVX2 order with fused multiply-adds (dot_scalar,
 * FP8's fp8_dot_scalar), both within ~1e-6 relative of a float32 matmul.
 */
#include "common.h"
#include "fp8.h"
#include "lowbit.h"

static inline float mlx_scale(const uint8_t *p, int sdt, int64_t i) {
    if (sdt == S_F32) { float f; memcpy(&f, p + 4 * i, 4); return f; }
    uint16_t h = rd16(p + 2 * i);
    return sdt == S_F16 ? f16_to_f32(h) : bf16_float(h);
}


#define FP4_DOUBLED LB_FP4X2  /* lowbit.h: twice each e2m1 code's value */

/* per 32-value sub-block s of a Q4_K / Q5_K block: scale d * sc, bias -(dmin * m) (the reference's subtraction) */
static inline void k_affine(const uint8_t *blk, float *scale, float *bias) {
    uint8_t sc[8], mn[8];
    float d = rdf16(blk), dmin = rdf16(blk + 2);
    k_scale_min(blk + 4, sc, mn);
    for (int s = 0; s < 8; s++) {
        scale[s] = d * (float)sc[s];
        bias[s] = -(dmin * (float)mn[s]);
    }
}

/* ---- scalar path: one row of W -> K float32 values ---- */

static void deq_row_scalar(const wdesc *w, int64_t n, float *o) {
    const uint8_t *row = w->q + n * w->row_bytes;
    int64_t K = w->K;
    switch (w->fmt) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1:
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            int bb = w->fmt == Q4_0 ? 18 : w->fmt == Q4_1 ? 20 : w->fmt == Q5_0 ? 22 : 24;
            const uint8_t *blk = row + b * bb;
            float d = rdf16(blk), m = (w->fmt == Q4_1 || w->fmt == Q5_1) ? rdf16(blk + 2) : 0.0f;
            int five = w->fmt == Q5_0 || w->fmt == Q5_1, at = w->fmt == Q4_0 ? 2 : w->fmt == Q4_1 ? 4 : 0;
            uint32_t qh = 0;
            if (five) { at = w->fmt == Q5_0 ? 2 : 4; memcpy(&qh, blk + at, 4); at += 4; }  /* little-endian hosts */
            for (int j = 0; j < 32; j++) {
                int q = j < 16 ? blk[at + j] & 15 : blk[at + j - 16] >> 4;
                if (five) q |= ((qh >> j) & 1) << 4;
                if (w->fmt == Q4_0) o[j] = d * (float)(q - 8);
                else if (w->fmt == Q5_0) o[j] = d * (float)(q - 16);
                else { float v = d * (float)q; o[j] = v + m; }
            }
        }
        break;
    case Q8_0:
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            const uint8_t *blk = row + b * 34;
            float d = rdf16(blk);
            for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)blk[2 + j] * d;
        }
        break;
    case Q4_K: case Q5_K:
        for (int64_t b = 0; b < K / 256; b++, o += 256) {
            int five = w->fmt == Q5_K;
            const uint8_t *blk = row + b * (five ? 176 : 144), *qs = blk + (five ? 48 : 16), *qh = blk + 16;
            float scale[8], bias[8];
            k_affine(blk, scale, bias);
            for (int s = 0; s < 8; s++)
                for (int l = 0; l < 32; l++) {
                    int q = (s & 1) ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15;
                    if (five) q |= ((qh[l] >> s) & 1) << 4;
                    float v = scale[s] * (float)q;
                    o[32 * s + l] = v + bias[s];
                }
        }
        break;
    case Q6_K:
        for (int64_t b = 0; b < K / 256; b++, o += 256) {
            const uint8_t *blk = row + b * 210, *ql = blk, *qh = blk + 128;
            float d = rdf16(blk + 208);
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 4; k++)
                    for (int l = 0; l < 32; l++) {
                        int lo = ql[64 * h + 32 * (k & 1) + l], q = ((k < 2 ? lo & 15 : lo >> 4)
                                                                     | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
                        int i = 128 * h + 32 * k + l;
                        float sc = d * (float)(int8_t)blk[192 + i / 16];
                        o[i] = sc * (float)q;
                    }
        }
        break;
    case MXFP4:
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            const uint8_t *blk = row + b * 17;
            float h = e8m0_half(blk[0]);
            for (int j = 0; j < 32; j++)
                o[j] = h * (float)FP4_DOUBLED[j < 16 ? blk[1 + j] & 15 : blk[1 + j - 16] >> 4];
        }
        break;
    case MXFP4_OAI:
        for (int64_t g = 0; g < K / 32; g++, o += 32) {
            float h = e8m0_half(w->s[n * (K / 32) + g]);
            for (int j = 0; j < 32; j++) o[j] = h * (float)FP4_DOUBLED[(row[16 * g + j / 2] >> (4 * (j & 1))) & 15];
        }
        break;
    case FP8:
        fp8_row_scalar(w, n, o);
        break;
    case MLX4: case MLX8:
        for (int64_t g = 0; g < K / w->gs; g++, o += w->gs) {
            float sc = mlx_scale(w->s, w->sdt, n * (K / w->gs) + g), bi = mlx_scale(w->b, w->sdt, n * (K / w->gs) + g);
            for (int j = 0; j < w->gs; j++) {
                int64_t i = g * w->gs + j;
                int q = w->fmt == MLX8 ? row[i] : (row[i / 2] >> (4 * (i & 1))) & 15;
                float v = sc * (float)q;
                o[j] = v + bi;
            }
        }
        break;
    default:  /* Q2_K ... IQ1_M */
        lowbit_deq_row(w->fmt, row, K, o);
        break;
    }
}

/* one x row against the dequantized row: the AVX2 path's arithmetic exactly, so both give the same bits: 32 lanes
 * (lane 8j + v is accumulator j's value v there), each a fused multiply-add (fmaf: one rounding, as _mm256_fmadd_ps;
 * a product then a sum, as this loop did before, rounds twice and differed from the AVX2 path in the last bits, which
 * a prompt through the float row kernel carried to 0.14 of the logits at 40 tokens), reduced as hsum does:
 * (acc0 + acc1) + (acc2 + acc3), the halves, then (0 + 2) + (1 + 3) */
static float dot_scalar(const float *w, const float *x, int64_t K) {
    float a[32] = {0}, s[8];
    for (int64_t k = 0; k < K; k += 32)
        for (int l = 0; l < 32; l++) a[l] = fmaf(w[k + l], x[k + l], a[l]);
    for (int v = 0; v < 8; v++) s[v] = (a[v] + a[8 + v]) + (a[16 + v] + a[24 + v]);
    for (int v = 0; v < 4; v++) s[v] += s[v + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

/* ---- AVX2 + FMA + F16C path ---- */
#if SLUICE_X86
/* 16 int8 codes -> 16 weights scale * code (+ bias) (uns: the codes are uint8), for the values at o. Without x
 * they are stored at o; with x (the fused T = 1 path) they go straight into the dot product with x's values at the
 * same offset (xk), vector 8j + v of a 32-value step into accumulator j + v: the buffered path's order exactly. */
AVX2_INLINE void emit16(__m128i q, float scale, float bias, int has_bias, int uns, float *o, int j, const float *x,
                        const float *o0, __m256 *acc) {
    __m256 s = _mm256_set1_ps(scale), b = _mm256_set1_ps(bias);
    __m128i q1 = _mm_srli_si128(q, 8);
    __m256i i0 = uns ? _mm256_cvtepu8_epi32(q) : _mm256_cvtepi8_epi32(q);
    __m256i i1 = uns ? _mm256_cvtepu8_epi32(q1) : _mm256_cvtepi8_epi32(q1);
    __m256 v0 = _mm256_mul_ps(_mm256_cvtepi32_ps(i0), s), v1 = _mm256_mul_ps(_mm256_cvtepi32_ps(i1), s);
    if (has_bias) { v0 = _mm256_add_ps(v0, b); v1 = _mm256_add_ps(v1, b); }
    if (x) {
        const float *xk = x + (o - o0);
        acc[j] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(xk), acc[j]);
        acc[j + 1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xk + 8), acc[j + 1]);
    } else {
        _mm256_storeu_ps(o, v0);
        _mm256_storeu_ps(o + 8, v1);
    }
}
#define EMIT(q, scale, bias, has_bias, uns, o, j) emit16(q, scale, bias, has_bias, uns, o, j, x, o0, acc)

/* k_affine with vector products (the scalar one is ~25% of a Q4_K row's time); the negation flips the sign bit,
 * as the reference's neg does (0 - p would turn -(+0) into +0) */
AVX2_INLINE void k_affine_avx2(const uint8_t *blk, float *scale, float *bias) {
    uint8_t sc[8], mn[8];
    k_scale_min(blk + 4, sc, mn);
    __m256 vs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    __m256 vm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_set1_ps(f16c(blk)), vs));
    _mm256_storeu_ps(bias, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(f16c(blk + 2)), vm), _mm256_set1_ps(-0.0f)));
}

/* one row of W: stored at o (x NULL), or dotted with x into acc[4] (o then only marks offsets) */
AVX2_INLINE void row_avx2(const wdesc *w, int64_t n, float *o, const float *x, __m256 *acc) {
    const float *o0 = o;
    const uint8_t *row = w->q + n * w->row_bytes;
    const int64_t K = w->K;
    const __m128i m4 = _mm_set1_epi8(15);
    const __m256i m4y = _mm256_set1_epi8(15);
    switch (w->fmt) {
    case Q4_0: case Q4_1:
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            int one = w->fmt == Q4_1;
            const uint8_t *blk = row + b * (one ? 20 : 18);
            float d = f16c(blk), m = one ? f16c(blk + 2) : 0.0f;
            __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (one ? 4 : 2)));
            __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
            if (one) { EMIT(lo, d, m, 1, 0, o, 0); EMIT(hi, d, m, 1, 0, o + 16, 2); }
            else {
                __m128i e = _mm_set1_epi8(8);
                EMIT(_mm_sub_epi8(lo, e), d, 0, 0, 0, o, 0);
                EMIT(_mm_sub_epi8(hi, e), d, 0, 0, 0, o + 16, 2);
            }
        }
        break;
    case Q5_0: case Q5_1:
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            int one = w->fmt == Q5_1;
            const uint8_t *blk = row + b * (one ? 24 : 22);
            float d = f16c(blk), m = one ? f16c(blk + 2) : 0.0f;
            uint32_t qh;
            memcpy(&qh, blk + (one ? 4 : 2), 4);
            __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (one ? 8 : 6)));
            __m128i lo = _mm_or_si128(_mm_and_si128(qs, m4), bits16(qh));
            __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), bits16(qh >> 16));
            if (one) { EMIT(lo, d, m, 1, 0, o, 0); EMIT(hi, d, m, 1, 0, o + 16, 2); }
            else {
                __m128i e = _mm_set1_epi8(16);
                EMIT(_mm_sub_epi8(lo, e), d, 0, 0, 0, o, 0);
                EMIT(_mm_sub_epi8(hi, e), d, 0, 0, 0, o + 16, 2);
            }
        }
        break;
    case Q8_0:
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            const uint8_t *blk = row + b * 34;
            float d = f16c(blk);
            EMIT(_mm_loadu_si128((const __m128i *)(blk + 2)), d, 0, 0, 0, o, 0);
            EMIT(_mm_loadu_si128((const __m128i *)(blk + 18)), d, 0, 0, 0, o + 16, 2);
        }
        break;
    case Q4_K: case Q5_K:
        for (int64_t b = 0; b < K / 256; b++, o += 256) {
            int five = w->fmt == Q5_K;
            const uint8_t *blk = row + b * (five ? 176 : 144), *qs = blk + (five ? 48 : 16);
            float scale[8], bias[8];
            k_affine_avx2(blk, scale, bias);
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            for (int i = 0; i < 4; i++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                __m256i c[2] = {_mm256_and_si256(v, m4y), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4y)};
                for (int h = 0; h < 2; h++) {
                    int s = 2 * i + h;
                    if (five) {
                        __m256i bit = _mm256_set1_epi8((char)(1 << s));
                        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                        c[h] = _mm256_or_si256(c[h], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
                    }
                    EMIT(_mm256_castsi256_si128(c[h]), scale[s], bias[s], 1, 0, o + 32 * s, 0);
                    EMIT(_mm256_extracti128_si256(c[h], 1), scale[s], bias[s], 1, 0, o + 32 * s + 16, 2);
                }
            }
        }
        break;
    case Q6_K:
        for (int64_t b = 0; b < K / 256; b++, o += 256) {
            const uint8_t *blk = row + b * 210;
            float sc[16];  /* d * scale per 16 values: float32 products, as the reference */
            __m256 d = _mm256_set1_ps(f16c(blk + 208));
            __m128i s8 = _mm_loadu_si128((const __m128i *)(blk + 192));
            _mm256_storeu_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
            _mm256_storeu_ps(sc + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)))));
            const __m256i m2 = _mm256_set1_epi8(3), e = _mm256_set1_epi8(32);
            for (int h = 0; h < 2; h++) {
                __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i lo[4] = {_mm256_and_si256(l0, m4y), _mm256_and_si256(l1, m4y),
                                 _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4y),
                                 _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4y)};
                for (int k = 0; k < 4; k++) {
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
                    __m256i c = _mm256_sub_epi8(_mm256_or_si256(lo[k], _mm256_slli_epi16(hi, 4)), e);
                    int s = 8 * h + 2 * k;
                    float *ok = o + 128 * h + 32 * k;
                    EMIT(_mm256_castsi256_si128(c), sc[s], 0, 0, 0, ok, 0);
                    EMIT(_mm256_extracti128_si256(c, 1), sc[s + 1], 0, 0, 0, ok + 16, 2);
                }
            }
        }
        break;
    case MXFP4: {
        const __m128i table = _mm_loadu_si128((const __m128i *)FP4_DOUBLED);
        for (int64_t b = 0; b < K / 32; b++, o += 32) {
            const uint8_t *blk = row + b * 17;
            float hs = e8m0_half(blk[0]);
            __m128i qs = _mm_loadu_si128((const __m128i *)(blk + 1));
            EMIT(_mm_shuffle_epi8(table, _mm_and_si128(qs, m4)), hs, 0, 0, 0, o, 0);
            EMIT(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(qs, 4), m4)), hs, 0, 0, 0, o + 16, 2);
        }
        break;
    }
    case MXFP4_OAI: {
        const __m128i table = _mm_loadu_si128((const __m128i *)FP4_DOUBLED);
        for (int64_t g = 0; g < K / 32; g++, o += 32) {
            float hs = e8m0_half(w->s[n * (K / 32) + g]);
            __m128i qs = _mm_loadu_si128((const __m128i *)(row + 16 * g));
            __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
            EMIT(_mm_shuffle_epi8(table, _mm_unpacklo_epi8(lo, hi)), hs, 0, 0, 0, o, 0);
            EMIT(_mm_shuffle_epi8(table, _mm_unpackhi_epi8(lo, hi)), hs, 0, 0, 0, o + 16, 2);
        }
        break;
    }
    case FP8: {
        int64_t i = fp8_row_scales(w, n);
        for (int64_t b = 0; b < K; b += w->gs, i++) {
            float s = fp8_scale(w, i), s256 = s * 256.0f;
            int big = isinf(s256) && !isinf(s);
            for (int64_t k = b; k < b + w->gs && k < K; k += 32, o += 32) {
                _mm_prefetch((const char *)(row + k + FP8_PREFETCH), _MM_HINT_T0);  /* never faults */
                for (int h = 0; h < 2; h++) {
                    __m256 lo, hi;
                    fp8x16(row + k + 16 * h, s, _mm256_set1_ps(s256), big, &lo, &hi);
                    fp8_emit8(lo, o + 16 * h, 2 * h, x, o0, acc);
                    fp8_emit8(hi, o + 16 * h + 8, 2 * h + 1, x, o0, acc);
                }
            }
        }
        break;
    }
    case MLX4: case MLX8: {
        const int64_t G = K / w->gs;
        for (int64_t g = 0; g < G; g++) {
            float sc = mlx_scale(w->s, w->sdt, n * G + g), bi = mlx_scale(w->b, w->sdt, n * G + g);
            for (int j = 0; j < w->gs; j += 32, o += 32) {
                int64_t i = g * w->gs + j;
                if (w->fmt == MLX8) {
                    EMIT(_mm_loadu_si128((const __m128i *)(row + i)), sc, bi, 1, 1, o, 0);
                    EMIT(_mm_loadu_si128((const __m128i *)(row + i + 16)), sc, bi, 1, 1, o + 16, 2);
                } else {  /* byte i holds value 2i (low nibble) and 2i + 1 (high nibble) */
                    __m128i qs = _mm_loadu_si128((const __m128i *)(row + i / 2));
                    __m128i lo = _mm_and_si128(qs, m4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m4);
                    EMIT(_mm_unpacklo_epi8(lo, hi), sc, bi, 1, 0, o, 0);
                    EMIT(_mm_unpackhi_epi8(lo, hi), sc, bi, 1, 0, o + 16, 2);
                }
            }
        }
        break;
    }
    default:  /* Q2_K ... IQ1_M (q8_low.c: the same bits as the portable lowbit_deq_row); never fused (rows_avx2) */
        lowbit_deq_row_avx2(w->fmt, row, K, o);
        break;
    }
}

AVX2_INLINE float hsum(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

AVX2 static void deq_row_avx2(const wdesc *w, int64_t n, float *o) { row_avx2(w, n, o, NULL, NULL); }

/* T = 1: the row's weights never leave registers: 0.85 -> 0.74 ms per Q4_K expert [768 x 2048 x 3] (dev VM, load
 * 10, best of 200), Q8_0 0.59 -> 0.49 */
AVX2 static float dot_row_avx2(const wdesc *w, int64_t n, float *buf, const float *x) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    row_avx2(w, n, buf, x, acc);
    return hsum(acc[0], acc[1], acc[2], acc[3]);
}

/* R x rows (R <= 3) against one dequantized row: 4 accumulators each, one weight load shared by the R rows */
#define DOT_ROWS(R)                                                                                                    \
    AVX2 static void dot##R(const float *w, const float *x, int64_t K, float *y, int64_t ldy) {                        \
        __m256 a[R][4];                                                                                                \
        for (int r = 0; r < R; r++)                                                                                    \
            for (int j = 0; j < 4; j++) a[r][j] = _mm256_setzero_ps();                                                 \
        for (int64_t k = 0; k < K; k += 32)                                                                            \
            for (int j = 0; j < 4; j++) {                                                                              \
                __m256 wv = _mm256_loadu_ps(w + k + 8 * j);                                                            \
                for (int r = 0; r < R; r++)                                                                            \
                    a[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k + 8 * j), a[r][j]);                    \
            }                                                                                                          \
        for (int r = 0; r < R; r++) y[r * ldy] = hsum(a[r][0], a[r][1], a[r][2], a[r][3]);                            \
    }
DOT_ROWS(1)
DOT_ROWS(2)
DOT_ROWS(3)

AVX2 static void rows_avx2(const wdesc *w, const float *x, int64_t T, float *y, int64_t n0, int64_t n1, float *buf) {
    if (T == 1 && !is_lowbit(w->fmt)) {
        for (int64_t n = n0; n < n1; n++) y[n] = dot_row_avx2(w, n, buf, x);
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        deq_row_avx2(w, n, buf);
        int64_t t = 0;
        for (; t + 3 <= T; t += 3) dot3(buf, x + t * w->K, w->K, y + t * w->N + n, w->N);
        if (T - t == 2) dot2(buf, x + t * w->K, w->K, y + t * w->N + n, w->N);
        else if (T - t == 1) dot1(buf, x + t * w->K, w->K, y + t * w->N + n, w->N);
    }
}

static int have_avx2(void) {
    static int known = -1;  /* every thread computes the same value: a race on it is harmless */
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return known;
}
#else
static int have_avx2(void) { return 0; }
#endif

static void rows_scalar(const wdesc *w, const float *x, int64_t T, float *y, int64_t n0, int64_t n1, float *buf) {
    for (int64_t n = n0; n < n1; n++) {
        deq_row_scalar(w, n, buf);
        for (int64_t t = 0; t < T; t++)  /* FP8: in the AVX2 path's order, so its bits (fp8.h) */
            y[t * w->N + n] = (w->fmt == FP8 ? fp8_dot_scalar : dot_scalar)(buf, x + t * w->K, w->K);
    }
}

/* row n's float32 weights into o: the AVX2 path where it runs (and scalar allows it), else the portable one */
static void deq_row(const wdesc *w, int64_t n, float *o, int scalar) {
    (void)scalar;  /* unused where only the portable path is compiled */
#if SLUICE_X86
    if (sluice_avx2_ok(scalar) && have_avx2()) { deq_row_avx2(w, n, o); return; }
#endif
    deq_row_scalar(w, n, o);
}

/* ---- entry points (arguments checked by the Python wrapper) ---- */

/* 1 when the AVX2 path runs on this CPU */
int sluice_simd(void) { return have_avx2(); }

static wdesc desc(int fmt, int64_t N, int64_t K, const uint8_t *q, int64_t row_bytes, const uint8_t *s,
                  const uint8_t *b, int sdt, int gs) {
    wdesc w = {fmt, N, K, q, row_bytes, s, b, sdt, gs};
    return w;
}

/* y[t, n] for n in [n0, n1) (y is [T, N], row stride N); scalar caps the path (common.h: 1 the portable one).
 * Returns 0, or -1 when the row buffer cannot be allocated, -2 for an unknown format. */
int sluice_linear(int fmt, int64_t N, int64_t K, const uint8_t *q, int64_t row_bytes, const uint8_t *s,
                  const uint8_t *b, int sdt, int gs, const float *x, int64_t T, float *y, int64_t n0, int64_t n1,
                  int scalar) {
    (void)scalar;  /* unused where only the portable path is compiled */
    if (fmt < 0 || fmt >= N_FORMATS) return -2;
    wdesc w = desc(fmt, N, K, q, row_bytes, s, b, sdt, gs);
    float *buf = (float *)malloc((size_t)K * sizeof(float) + 64);
    if (!buf) return -1;
#if SLUICE_X86
    if (sluice_avx2_ok(scalar) && have_avx2()) rows_avx2(&w, x, T, y, n0, n1, buf);
    else
#endif
        rows_scalar(&w, x, T, y, n0, n1, buf);
    free(buf);
    return 0;
}

/* the float32 weights of rows [n0, n1) into out [N, K] (row stride K): the reference dequantization, bitwise */
int sluice_dequantize(int fmt, int64_t N, int64_t K, const uint8_t *q, int64_t row_bytes, const uint8_t *s,
                      const uint8_t *b, int sdt, int gs, float *out, int64_t n0, int64_t n1, int scalar) {
    if (fmt < 0 || fmt >= N_FORMATS) return -2;
    wdesc w = desc(fmt, N, K, q, row_bytes, s, b, sdt, gs);
    for (int64_t n = n0; n < n1; n++) deq_row(&w, n, out + n * K, scalar);
    return 0;
}

/* float32 -> bf16 bits, n values, as bf16_round (round to nearest even, NaN -> 0x7FC0: torch's .to(bfloat16)) */
#if SLUICE_X86
AVX2 static void to_bf16_avx2(const float *x, uint16_t *o, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = bf16_bits8(_mm256_loadu_si256((const __m256i *)(x + i)));
        __m256i b = bf16_bits8(_mm256_loadu_si256((const __m256i *)(x + i + 8)));
        /* packus works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, then the middle quadwords swap */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
        _mm256_storeu_si256((__m256i *)(o + i), p);
    }
    for (; i < n; i++) o[i] = bf16_round(x[i]);
}

/* The same with the AVX512_BF16 conversion, 32 values an instruction: it rounds to nearest even as bf16_round does
 * but quiets a NaN its own way and flushes subnormals to zero, so a block of 32 holding either (never a GGUF weight:
 * the smallest is an f16 subnormal scale times a code, ~6e-8) goes through bf16_round. A [1024 x 1024] Q4_K +
 * [1024 x 512] Q6_K expert dequantized to bf16 on one thread (`benchmarks/prefill/knobs.py dequant`): 0.215 ms with
 * the AVX2 rounding, 0.131-0.141 with this one, 0.097-0.103 to float32 without rounding. */
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
AVX512BF16 static void to_bf16_avx512(const float *x, uint16_t *o, int64_t n) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        /* fpclass 0xA1: quiet NaN (0x01), subnormal (0x20), signalling NaN (0x80) */
        if (_mm512_fpclass_ps_mask(a, 0xA1) | _mm512_fpclass_ps_mask(b, 0xA1)) {
            for (int k = 0; k < 32; k++) o[i + k] = bf16_round(x[i + k]);
            continue;
        }
        _mm512_storeu_si512((void *)(o + i), (__m512i)_mm512_cvtne2ps_pbh(b, a));  /* a's values first */
    }
    for (; i < n; i++) o[i] = bf16_round(x[i]);
}

int sluice_cpu_avx512bf16(void) {
    static int known = -1;  /* every thread computes the same value: a race on it is harmless */
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
                && __builtin_cpu_supports("avx512bf16");
    }
    return known;
}

int sluice_cpu_avx512f(void) {
    static int known = -1;  /* as above */
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f");
    }
    return known;
}
#else
int sluice_cpu_avx512bf16(void) { return 0; }
int sluice_cpu_avx512f(void) { return 0; }
#endif

static void to_bf16_row(const float *x, uint16_t *o, int64_t n, int scalar) {
    (void)scalar;
#if SLUICE_X86
    if (sluice_avx512_ok(scalar) && sluice_cpu_avx512bf16()) { to_bf16_avx512(x, o, n); return; }
    if (sluice_avx2_ok(scalar) && have_avx2()) { to_bf16_avx2(x, o, n); return; }
#endif
    for (int64_t i = 0; i < n; i++) o[i] = bf16_round(x[i]);
}

/* float32 [n] -> bf16 [n], round to nearest even (torch's .to(torch.bfloat16)); q8.c's and prompt.c's bf16 outputs */
void sluice_to_bf16(int64_t n, const float *x, uint16_t *out, int scalar) { to_bf16_row(x, out, n, scalar); }

/* the weights of rows [n0, n1) as bf16 into out16 [N, K]: each row dequantized (bitwise sluice_dequantize's) into
 * a float32 row buffer, then rounded to bf16. Returns 0, -1 (no memory). */
static int dequantize_bf16_rows(const wdesc *w, uint16_t *out16, int64_t n0, int64_t n1, int scalar) {
    float *buf = (float *)malloc((size_t)w->K * sizeof(float));
    if (!buf) return -1;
    for (int64_t n = n0; n < n1; n++) {
        deq_row(w, n, buf, scalar);
        to_bf16_row(buf, out16 + n * w->K, w->K, scalar);
    }
    free(buf);
    return 0;
}

/* ---- one projection's output rows over the pool (pool.c): a prefill's experts with 5-32 rows, the dequantized
 * weights of larger ones ---- */

typedef struct {
    wdesc w;
    const float *x;
    int64_t T, step;
    float *y;    /* sluice_linear's y, or NULL: dequantize into out */
    float *out;
    int scalar, failed;
    uint16_t *out16;  /* non-NULL: dequantize into bf16 out16 instead */
} split_job;

static void split_task(void *c, int64_t i) {
    split_job *j = (split_job *)c;
    int64_t n0 = i * j->step, n1 = n0 + j->step < j->w.N ? n0 + j->step : j->w.N;
    if (j->out16) {
        if (dequantize_bf16_rows(&j->w, j->out16, n0, n1, j->scalar)) j->failed = 1;
        return;
    }
    if (!j->y) {
        sluice_dequantize(j->w.fmt, j->w.N, j->w.K, j->w.q, j->w.row_bytes, j->w.s, j->w.b, j->w.sdt, j->w.gs,
                          j->out, n0, n1, j->scalar);
        return;
    }
    if (sluice_linear(j->w.fmt, j->w.N, j->w.K, j->w.q, j->w.row_bytes, j->w.s, j->w.b, j->w.sdt, j->w.gs, j->x,
                      j->T, j->y, n0, n1, j->scalar))
        j->failed = 1;  /* only ever set to 1: a race between tasks is harmless */
}

/* sluice_linear (y non-NULL: y [T, N] from x [T, K]) or sluice_dequantize (y NULL: out [N, K]) over all N rows, in
 * tasks of ~64K weights times T split over the pool. Each row is the one call's work on the same bytes, so the
 * result has the same bits for any thread count. Returns 0, -1 (no memory), -2 (unknown format). */
int sluice_rows_pool(int fmt, int64_t N, int64_t K, const uint8_t *q, int64_t row_bytes, const uint8_t *s,
                     const uint8_t *b, int sdt, int gs, const float *x, int64_t T, float *y, float *out, int scalar) {
    if (fmt < 0 || fmt >= N_FORMATS) return -2;
    int64_t work = K * (y ? T : 1), step = work >= 65536 ? 1 : 65536 / work;
    split_job j = {desc(fmt, N, K, q, row_bytes, s, b, sdt, gs), x, T, step, y, out, scalar, 0, NULL};
    pool_run(split_task, &j, (N + step - 1) / step);
    return j.failed ? -1 : 0;
}

/* the weights [N, K] as bf16 into out16, rows over the pool: bitwise sluice_dequantize's float32 rounded to bf16 to
 * nearest even (a bf16 GEMM's operand, quant/linear.py). Returns 0, -1 (no memory), -2 (unknown format). */
int sluice_dequantize_bf16(int fmt, int64_t N, int64_t K, const uint8_t *q, int64_t row_bytes, const uint8_t *s,
                           const uint8_t *b, int sdt, int gs, uint16_t *out16, int scalar) {
    if (fmt < 0 || fmt >= N_FORMATS) return -2;
    int64_t step = K >= 65536 ? 1 : 65536 / K;
    split_job j = {desc(fmt, N, K, q, row_bytes, s, b, sdt, gs), NULL, 0, step, NULL, NULL, scalar, 0, out16};
    pool_run(split_task, &j, (N + step - 1) / step);
    return j.failed ? -1 : 0;
}
