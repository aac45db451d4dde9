/* The integer decode path: y[T, N] = x[T, K] @ W^T with x quantized to 8-bit codes once per row and integer dot
 * products against the stored codes (the scheme of llama.cpp's ggml-cpu vec_dot kernels; this code is sluice's own).
 *
 * Activations: each x row becomes blocks of 32 values: float d, float s = d * sum(code), then P planes of int8
 * (40 or 72 bytes). hi = round(x / D), D = amax / 127 (half to even, |hi| <= 127); with P = 2 also lo =
 * round((x / D - hi) * 256) (clamped to +-127), code = 256 * hi + lo and d = D / 256 (x to ~1/65,000 of the block
 * max, finer than bf16), else code = hi and d = D. Every format reads this layout except the K-quants, which read
 * super-blocks of 256 (SB and SB1 below: with one plane that is llama.cpp's Q8_K); a call quantizes x once per
 * layout its projections read (Q4_K_M files mix Q4_K, Q6_K and sometimes Q8_0). P is LoadOptions.activations:
 * "int16" 2, "int8" 1 (peers Q4_K_M, resident: 25.3 vs 20.0 ms/token, decode logits 1.05e-2 vs 1.25e-2 relative
 * L2 off the float32 run, greedy tokens 98% its own either way; `benchmarks/knobs.py arms`).
 * Why 32 values and why two planes: llama.cpp's one plane with one scale per 256 activations for the K-quants (Q8_K)
 * took the tiny Q5_K model of tests/quant/test_gguf_models.py from 3.1e-2 (float kernel) to 5.2e-2 relative L2 of
 * the logits, one plane per 32 to 7.6e-2, past transformers' own bf16 run (4.4e-2: that random model amplifies
 * small errors); two planes give 2.9e-2, the float kernel's quality, for ~20% more time than one.
 *
 * Dot products: the integer sums are exact; the float operations are fixed and the same on both paths. Per
 * 32-value (sub-)block j of the row, with w the integer codes (Q4_0 / Q5_0 / Q6_K: offset removed, signed) and the
 * sub-block's integer scale sc (K-quants; 1 otherwise; Q6_K: one per 16 values):
 *   lane[j & 1][l] += (d_w * d_x) * (float)(sc * sum of w * code over values 4l..4l+3)      l = 0..7
 *   m += min * s_x                      Q4_1 / Q5_1: min = m; Q4_K / Q5_K: min = dmin * mins[j], subtracted
 *   y = reduce8(lane[0] + lane[1]) + m  reduce8(a) = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))
 * so the AVX2 path (maddubs / madd, one float lane per l) and the portable scalar path give the same bits, and row t
 * of y does not depend on T or on the row range of the call. Error against F.linear on the exactly dequantized
 * weights: relative L2 5e-3 - 1.1e-2 with one plane, 2e-5 - 4e-5 with two (tests/quant/test_q8.py).
 */
#include <math.h>

#include "q8.h"

/* Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K here, the low-bit types in q8_low.c */
static int has_q8(int fmt) { return (fmt >= Q4_0 && fmt <= Q6_K) || low_q8_has(fmt); }


static int is_k(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K; }

/* the x layout a format's rows read with P planes: 3 (super-blocks) for the K-quants with two planes, else P */
/* benchmark hook (native.set_super_blocks): 0 makes the K-quants read the 32-value layout, as before it existed */
static int super_blocks = 1;
void sluice_set_super_blocks(int on) { super_blocks = on; }

static int xf_for(int fmt, int P) {
    if (low_q8_has(fmt)) return low_q8_sb(fmt) ? sb_xf(P) : P;  /* (their kernels read one layout each) */
    return is_k(fmt) && super_blocks ? sb_xf(P) : P;
}

/* bytes of one quantized x row of K values: XF 1 or 2 (planes of 32-value blocks, K a multiple of 32) or 3 / 4
 * (super-blocks with 2 / 1 planes, K a multiple of 256) */
int64_t sluice_q8_row_bytes(int64_t K, int XF) {
    return XF >= 3 ? K / 256 * SB_BYTES(sb_planes(XF)) : K / 32 * XB(XF);
}

/* the layout fmt reads with P planes (for the Python wrapper: quantize_q8(spec=...)) */
int sluice_q8_layout(int fmt, int P) { return xf_for(fmt, P); }

/* n values -> int8 codes hi (and, lo != NULL, the residual plane lo); returns D = amax / 127. Non-finite or huge
 * values clamp to +-127 (no undefined conversion). Inlined into a portable and an AVX2-target copy of the row
 * quantizers: the same IEEE operations (abs, compare, one multiply, round to nearest even), so the same bytes; the
 * AVX2 copy (vectorized by the compiler) takes ~1 us per 1024 values. */
static inline __attribute__((always_inline)) float quant_codes(const float *v, int n, int8_t *hi, int8_t *lo) {
    float amax = 0.0f;
    for (int j = 0; j < n; j++) {
        float a = fabsf(v[j]);
        if (a > amax) amax = a;
    }
    float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int j = 0; j < n; j++) {
        float f = v[j] * id, r = nearbyintf(f);
        int h = r >= 127.0f ? 127 : r >= -127.0f ? (int)r : -127;
        hi[j] = (int8_t)h;
        if (lo) {  /* the residual in 1/256ths of D: f - h is exact; |.| <= 128, clamped to 127 */
            float l = nearbyintf((f - (float)h) * 256.0f);
            lo[j] = (int8_t)(l >= 127.0f ? 127 : l >= -127.0f ? (int)l : -127);
        }
    }
    return d;
}

/* 32 values -> P planes of codes at q (lo at q + 32); returns d (D / 256 with two planes) */
static inline __attribute__((always_inline)) float quant_block(const float *v, int8_t *q, int P) {
    float d = quant_codes(v, 32, q, P == 2 ? q + 32 : NULL);
    return P == 2 ? d * (1.0f / 256.0f) : d;
}

/* block header: float d (the value of one unit of the combined code 256 * hi + lo, or of hi when P = 1), float s =
 * d * (sum of the combined codes), then the planes */
static inline __attribute__((always_inline)) void quant_row(const float *x, int64_t K, uint8_t *o, int P) {
    for (int64_t b = 0; b < K / 32; b++, o += XB(P)) {
        int8_t *q = (int8_t *)(o + 8);
        float d = quant_block(x + 32 * b, q, P);
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += P == 2 ? 256 * q[j] + q[32 + j] : q[j];
        float s = d * (float)sum;
        memcpy(o, &d, 4);
        memcpy(o + 4, &s, 4);
    }
}

/* one x row in super-blocks (XF = 3 or 4): quant_codes over 256 values, P planes */
static inline __attribute__((always_inline)) void quant_row_sb(const float *x, int64_t K, uint8_t *o, int P) {
    for (int64_t b = 0; b < K / 256; b++, o += SB_BYTES(P), x += 256) {
        int8_t *hi = (int8_t *)(o + SB_HI), *lo = P == 2 ? (int8_t *)(o + SB_LO) : NULL;
        float d = quant_codes(x, 256, hi, lo);
        int32_t bs[16];
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int j = 16 * g; j < 16 * g + 16; j++) sum += P == 2 ? 256 * hi[j] + lo[j] : hi[j];
            bs[g] = sum;
        }
        if (P == 2) d = d * (1.0f / 256.0f);
        memcpy(o, &d, 4);
        memcpy(o + 4, bs, 64);
    }
}


static const int BLOCK_BYTES[] = {[Q4_0] = 18, [Q4_1] = 20, [Q5_0] = 22, [Q5_1] = 24, [Q8_0] = 34,
                                  [Q4_K] = 144, [Q5_K] = 176, [Q6_K] = 210};

/* ---- portable scalar path ---- */

/* the 32 integer weights of one 32-block (signed for Q4_0 / Q5_0 / Q8_0, 0..31 for Q4_1 / Q5_1) */
static void codes32(int fmt, const uint8_t *blk, int8_t *w) {
    if (fmt == Q8_0) { memcpy(w, blk + 2, 32); return; }
    int five = fmt == Q5_0 || fmt == Q5_1, at = fmt == Q4_0 || fmt == Q5_0 ? 2 : 4;
    uint32_t qh = 0;
    if (five) { memcpy(&qh, blk + at, 4); at += 4; }
    int off = fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;
    for (int j = 0; j < 32; j++) {
        int q = j < 16 ? blk[at + j] & 15 : blk[at + j - 16] >> 4;
        if (five) q |= ((qh >> j) & 1) << 4;
        w[j] = (int8_t)(q - off);
    }
}

/* the 256 codes of a K-quant block (Q6_K: minus 32, signed) */
static void codes256(int fmt, const uint8_t *blk, int8_t *c) {
    if (fmt == Q6_K) {
        for (int i = 0; i < 256; i++) {
            int h = i / 128, k = (i / 32) & 3, l = i & 31, lo = blk[64 * h + 32 * (k & 1) + l];
            c[i] = (int8_t)(((k < 2 ? lo & 15 : lo >> 4) | (((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4)) - 32);
        }
        return;
    }
    int five = fmt == Q5_K;
    const uint8_t *qs = blk + (five ? 48 : 16), *qh = blk + 16;
    for (int s = 0; s < 8; s++)
        for (int l = 0; l < 32; l++) {
            int q = (s & 1) ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15;
            c[32 * s + l] = (int8_t)(five ? q | (((qh[l] >> s) & 1) << 4) : q);
        }
}

/* one 32-value sub-block: lane[l] += f * (float)(sc[l / 4] * sum of w * code over 4l..4l+3), code = q (P = 1) or
 * 256 * q + q[32 + .] (P = 2) */
static inline void lanes_scalar(const int8_t *w, const int8_t *q, const int *sc, float f, float *lane, int P) {
    for (int l = 0; l < 8; l++) {
        int s = 0;
        for (int j = 4 * l; j < 4 * l + 4; j++) s += w[j] * (P == 2 ? 256 * q[j] + q[32 + j] : q[j]);
        lane[l] = lane[l] + f * (float)(sc[l / 4] * s);
    }
}

static float dot_scalar_q8(int fmt, const uint8_t *row, const uint8_t *xq, int64_t K, int P) {
    float lane[2][8] = {{0}}, m = 0.0f;
    const int one[2] = {1, 1};
    if (fmt <= Q8_0) {
        for (int64_t b = 0; b < K / 32; b++, xq += XB(P)) {
            const uint8_t *blk = row + b * BLOCK_BYTES[fmt];
            int8_t w[32];
            codes32(fmt, blk, w);
            lanes_scalar(w, (const int8_t *)(xq + 8), one, rdf16(blk) * rdf32(xq), lane[b & 1], P);
            if (fmt == Q4_1 || fmt == Q5_1) m = m + rdf16(blk + 2) * rdf32(xq + 4);
        }
        return reduce16(lane[0], lane[1]) + m;
    }
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *blk = row + b * BLOCK_BYTES[fmt];
        int8_t c[256];
        uint8_t sc[8] = {0}, mn[8] = {0};
        codes256(fmt, blk, c);
        float d = rdf16(fmt == Q6_K ? blk + 208 : blk), dmin = fmt == Q6_K ? 0.0f : rdf16(blk + 2);
        if (fmt != Q6_K) k_scale_min(blk + 4, sc, mn);
        for (int s = 0; s < 8; s++, xq += XB(P)) {
            int scs[2] = {sc[s], sc[s]};  /* Q6_K: one scale per 16 values */
            if (fmt == Q6_K) scs[0] = (int8_t)blk[192 + 2 * s], scs[1] = (int8_t)blk[193 + 2 * s];
            lanes_scalar(c + 32 * s, (const int8_t *)(xq + 8), scs, d * rdf32(xq), lane[s & 1], P);
            if (fmt != Q6_K) m = m + (dmin * (float)mn[s]) * rdf32(xq + 4);
        }
    }
    return reduce16(lane[0], lane[1]) - m;
}

/* K-quant row against a super-block x row (XF = 3; XF = 4 is P = 1: no Alo, and lane += f * (float)Ahi[l]).
 * Per 256-block: int32 Ahi[l], Alo[l] (l = 0..7, values 4l..4l+3 of each 32-value sub-block s, times the
 * sub-block's integer scale: Q6_K one per 16 values, so l < 4 / l >= 4)
 * sum hi and lo codes against the unsigned codes (Q6_K: 0..63, its -32 moved into the correction), then
 *   lane[b & 1][l] += (d_w * d_x) * ((float)Ahi[l] * 256 + (float)Alo[l])
 *   m[l] += c * (float)M_l    M_l = w[l] * bsum16[l] + w[8 + l] * bsum16[8 + l] over the 16-value groups g, w[g]
 *                             Q4_K / Q5_K: c = dmin * d_x, w[g] = mins[g / 2];
 *                             Q6_K: c = d_w * d_x, w[g] = scale[g], and 32 * (float)M_l (exact)
 *   y = reduce16(lane) - reduce8(m)
 * as the AVX2 path computes it (madd lanes, one float conversion per block; the min term in 8 float lanes, summed
 * once per row, where a lane sum of M per block took ~20% of a one-plane Q4_K row: 2048x512 51-52 us against
 * 56-57, 768x2048 61-63 against 69-71, Q6_K 78-79 against 90-91 at 768x2048 (llama.cpp 48 / 60 / 72), AMD EPYC
 * znver3 AVX2, `benchmarks/lowbit_kernels.py --types Q4_K,Q6_K`, results/lowbit/kernels-amd-avx2-minlanes.txt). */
static float dot_scalar_sb(int fmt, const uint8_t *row, const uint8_t *xs, int64_t K, int P) {
    float lane[2][8] = {{0}}, m[8] = {0};
    for (int64_t b = 0; b < K / 256; b++, xs += SB_BYTES(P)) {
        const uint8_t *blk = row + b * BLOCK_BYTES[fmt];
        const int8_t *hi = (const int8_t *)(xs + SB_HI), *lo = (const int8_t *)(xs + SB_LO);
        int8_t c[256];
        uint8_t sc[8] = {0}, mn[8] = {0};
        codes256(fmt, blk, c);
        float dw = rdf16(fmt == Q6_K ? blk + 208 : blk), dx = rdf32(xs);
        if (fmt != Q6_K) k_scale_min(blk + 4, sc, mn);
        int32_t ahi[8] = {0}, alo[8] = {0};
        for (int s = 0; s < 8; s++)
            for (int l = 0; l < 8; l++) {
                int scale = fmt == Q6_K ? (int8_t)blk[192 + 2 * s + l / 4] : sc[s], h = 0, o = 0;
                for (int v = 32 * s + 4 * l; v < 32 * s + 4 * l + 4; v++) {
                    int w = fmt == Q6_K ? c[v] + 32 : c[v];
                    h += w * hi[v];
                    if (P == 2) o += w * lo[v];
                }
                ahi[l] += scale * h;
                alo[l] += scale * o;
            }
        float f = dw * dx;
        for (int l = 0; l < 8; l++)
            lane[b & 1][l] = lane[b & 1][l] + f * (P == 2 ? (float)ahi[l] * 256.0f + (float)alo[l] : (float)ahi[l]);
        /* the min term in 8 lanes, lane l the two 16-value groups l and 8 + l: M_l = w_l * S_l + w_{8+l} * S_{8+l},
         * w the group's min (Q4_K / Q5_K: sub-block l / 2's, two groups each) or Q6_K scale (then 32 M_l, exact in
         * float), S its x sum; m_l += f * (float)M_l, summed in reduce8's order at the end (dotsb_avx2's lanes) */
        float fm = fmt == Q6_K ? f : rdf16(blk + 2) * dx;
        for (int l = 0; l < 8; l++) {
            int32_t w0 = fmt == Q6_K ? (int8_t)blk[192 + l] : mn[l / 2];
            int32_t w1 = fmt == Q6_K ? (int8_t)blk[200 + l] : mn[4 + l / 2];
            float t = (float)(w0 * rdi32(xs + 4 + 4 * l) + w1 * rdi32(xs + 36 + 4 * l));
            m[l] = m[l] + fm * (fmt == Q6_K ? 32.0f * t : t);
        }
    }
    return reduce16(lane[0], lane[1]) - reduce8(m);
}

/* ---- AVX2 path ---- */
#if SLUICE_X86

/* the 32 integer codes of a 32-block (signed for Q4_0 / Q5_0 / Q8_0, 0..31 for Q4_1 / Q5_1) */
AVX2_INLINE __m256i codes32_avx2(const int fmt, const uint8_t *blk) {
    __m256i w;
    if (fmt == Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    if (fmt == Q4_0 || fmt == Q4_1) {
        w = nibbles32(blk + (fmt == Q4_0 ? 2 : 4));
        return fmt == Q4_0 ? _mm256_sub_epi8(w, _mm256_set1_epi8(8)) : w;
    }
    int at = fmt == Q5_0 ? 2 : 4;
    uint32_t qh;
    memcpy(&qh, blk + at, 4);
    w = _mm256_or_si256(nibbles32(blk + at + 4), _mm256_set_m128i(bits16(qh >> 16), bits16(qh)));
    return fmt == Q5_0 ? _mm256_sub_epi8(w, _mm256_set1_epi8(16)) : w;
}

/* one 32-block against R x rows (x block at xb + r * rb): lane[r] += its terms, m[r] += its Q4_1 / Q5_1 min term.
 * The weights are unpacked once for the R rows (the float row kernel's dequantize-once, for T > 1). */
AVX2_INLINE void acc32(const int fmt, const uint8_t *blk, const uint8_t *xb, int64_t rb, const int P, const int R,
                       __m256 *lane, float *m) {
    const __m256i w = codes32_avx2(fmt, blk);
    const int sign = fmt == Q4_0 || fmt == Q5_0 || fmt == Q8_0;
    const float dw = f16c(blk);
    for (int r = 0; r < R; r++) {
        const uint8_t *x = xb + r * rb;
        lane[r] = _mm256_add_ps(lane[r], lanes_avx2(w, x, _mm256_set1_epi16(1), dw * rdf32(x), sign, P));
        if (fmt == Q4_1 || fmt == Q5_1) m[r] = m[r] + f16c(blk + 2) * rdf32(x + 4);
    }
}

/* always inlined into one function per format, planes and row count (below), so every such test folds away;
 * f16c() gives rdf16's value. Blocks alternate between two named accumulator sets (lane[b & 1] of the scalar path:
 * an indexed pair of vectors went through memory, ~20% slower). y[r * ldy] for the R rows. */
AVX2_INLINE void dot32_avx2(const int fmt, const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, const int P,
                            const int R, float *y, int64_t ldy) {
    __m256 l0[4], l1[4];
    float m[4];
    for (int r = 0; r < R; r++) l0[r] = l1[r] = _mm256_setzero_ps(), m[r] = 0.0f;
    const int bb = BLOCK_BYTES[fmt], xb = XB(P);
    int64_t b = 0, nb = K / 32;
    for (; b + 2 <= nb; b += 2) {
        acc32(fmt, row + b * bb, xq + b * xb, rb, P, R, l0, m);
        acc32(fmt, row + (b + 1) * bb, xq + (b + 1) * xb, rb, P, R, l1, m);
    }
    if (b < nb) acc32(fmt, row + b * bb, xq + b * xb, rb, P, R, l0, m);
    for (int r = 0; r < R; r++) y[r * ldy] = finish(l0[r], l1[r], m[r]);
}

/* Q6_K sub-block s (values 32s..32s+31) from its codes c (0..63) against R x rows, scales per 16 values */
AVX2_INLINE void q6_acc(__m256i c, const uint8_t *blk, int s, const uint8_t *xs, int64_t rb, float d, const int P,
                        const int R, __m256 *lane) {
    __m256i sc = _mm256_set_m128i(_mm_set1_epi16((int8_t)blk[193 + 2 * s]), _mm_set1_epi16((int8_t)blk[192 + 2 * s]));
    __m256i w = _mm256_sub_epi8(c, _mm256_set1_epi8(32));
    for (int r = 0; r < R; r++) {
        const uint8_t *x = xs + r * rb;
        lane[r] = _mm256_add_ps(lane[r], lanes_avx2(w, x, sc, d * rdf32(x), 1, P));
    }
}

/* Q4_K / Q5_K sub-block s from its codes against R x rows; the min terms into m[r] */
AVX2_INLINE void k_acc(__m256i c, int s, const uint8_t *sc, const uint8_t *mn, float d, float dmin, const uint8_t *xs,
                       int64_t rb, const int P, const int R, __m256 *lane, float *m) {
    for (int r = 0; r < R; r++) {
        const uint8_t *x = xs + r * rb;
        m[r] = m[r] + (dmin * (float)mn[s]) * rdf32(x + 4);
        lane[r] = _mm256_add_ps(lane[r], lanes_avx2(c, x, _mm256_set1_epi16(sc[s]), d * rdf32(x), 0, P));
    }
}

/* sub-block s into accumulator set s & 1 (as dot32_avx2) */
AVX2_INLINE void dotk_avx2(const int fmt, const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, const int P,
                           const int R, float *y, int64_t ldy) {
    __m256 l0[4], l1[4];
    float m[4];
    for (int r = 0; r < R; r++) l0[r] = l1[r] = _mm256_setzero_ps(), m[r] = 0.0f;
    const __m256i m4 = _mm256_set1_epi8(15);
    const int xb = XB(P);
    for (int64_t b = 0; b < K / 256; b++, xq += 8 * xb) {
        const uint8_t *blk = row + b * BLOCK_BYTES[fmt];
        if (fmt == Q6_K) {
            const __m256i m2 = _mm256_set1_epi8(3);
            float d = f16c(blk + 208);
            for (int h = 0; h < 2; h++) {
                __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i lo[4] = {_mm256_and_si256(v0, m4), _mm256_and_si256(v1, m4),
                                 _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4)};
                for (int k = 0; k < 4; k += 2) {  /* s = 4h + k even, 4h + k + 1 odd */
                    __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), m2);
                    __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k + 2), m2);
                    int s = 4 * h + k;
                    q6_acc(_mm256_or_si256(lo[k], _mm256_slli_epi16(h0, 4)), blk, s, xq + s * xb, rb, d, P, R, l0);
                    q6_acc(_mm256_or_si256(lo[k + 1], _mm256_slli_epi16(h1, 4)), blk, s + 1, xq + (s + 1) * xb, rb, d,
                           P, R, l1);
                }
            }
            continue;
        }
        const int five = fmt == Q5_K;
        const uint8_t *qs = blk + (five ? 48 : 16);
        uint8_t sc[8], mn[8];
        k_scale_min(blk + 4, sc, mn);
        float d = f16c(blk), dmin = f16c(blk + 2);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        for (int i = 0; i < 4; i++) {  /* sub-blocks 2i (low nibbles) and 2i + 1 (high) */
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            __m256i c0 = _mm256_and_si256(v, m4), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                const __m256i x10 = _mm256_set1_epi8(0x10);
                __m256i b0 = _mm256_set1_epi8((char)(1 << 2 * i)), b1 = _mm256_set1_epi8((char)(2 << 2 * i));
                c0 = _mm256_or_si256(c0, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), x10));
                c1 = _mm256_or_si256(c1, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), x10));
            }
            k_acc(c0, 2 * i, sc, mn, d, dmin, xq + 2 * i * xb, rb, P, R, l0, m);
            k_acc(c1, 2 * i + 1, sc, mn, d, dmin, xq + (2 * i + 1) * xb, rb, P, R, l1, m);
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = finish(l0[r], l1[r], -m[r]);
}

/* one 32-value sub-block s (unsigned codes c, int16 scales sc) into the integer accumulators of R x rows */
AVX2_INLINE void sb_acc(__m256i c, __m256i sc, const uint8_t *xs, int s, int64_t rb, const int R, const int P,
                        __m256i *ahi, __m256i *alo) {
    for (int r = 0; r < R; r++) {
        const uint8_t *x = xs + r * rb;
        __m256i h = _mm256_loadu_si256((const __m256i *)(x + SB_HI + 32 * s));
        ahi[r] = _mm256_add_epi32(ahi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(c, h), sc));
        if (P == 2) {
            __m256i l = _mm256_loadu_si256((const __m256i *)(x + SB_LO + 32 * s));
            alo[r] = _mm256_add_epi32(alo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(c, l), sc));
        }
    }
}

/* dot_scalar_sb's arithmetic: K-quant rows against super-block x rows. The scales are picked from one register by
 * byte shuffles, and the min term's 8 lanes M_l (two (scale or min) x (x's 16-value sum) products each) are two
 * vector multiplies: exact in int32 (|M_l| < 2^27 with two planes: sums of 16 codes < 2^19.01, times mins <= 63
 * (Q4_K / Q5_K) or Q6_K scales <= 128), so the same M_l as the scalar path's. */
AVX2_INLINE void dotsb_avx2(const int fmt, const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, const int P,
                            const int R, float *y, int64_t ldy) {
    __m256 l0[4], l1[4], m[4];  /* m: the min term in 8 lanes (dot_scalar_sb's m[l]) */
    for (int r = 0; r < R; r++) l0[r] = l1[r] = m[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256 k256 = _mm256_set1_ps(256.0f), k32 = _mm256_set1_ps(32.0f);
    for (int64_t b = 0; b < K / 256; b++, xq += SB_BYTES(P)) {
        const uint8_t *blk = row + b * BLOCK_BYTES[fmt];
        __m256i ahi[4], alo[4];
        for (int r = 0; r < R; r++) ahi[r] = alo[r] = _mm256_setzero_si256();
        __m256i w0, w1;  /* the 16 int32 factors of M: mins (each twice, one per 16 values) or Q6_K's scales */
        float dw, dm;    /* the min term is m += (dm * d_x) * (float)M */
        if (fmt == Q6_K) {
            const __m256i m2 = _mm256_set1_epi8(3);
            dw = f16c(blk + 208);
            dm = dw;
            __m128i s16 = _mm_loadu_si128((const __m128i *)(blk + 192));
            w0 = _mm256_cvtepi8_epi32(s16);
            w1 = _mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8));
            /* scales 0-7 and 8-15 as int16, each in both lanes: sub-block s takes 2s (low lane) and 2s + 1 */
            __m256i sa = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(s16));
            __m256i sb = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(s16, 8)));
            for (int h = 0; h < 2; h++) {
                __m256i v0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                __m256i v1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m256i lo[4] = {_mm256_and_si256(v0, m4), _mm256_and_si256(v1, m4),
                                 _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4),
                                 _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4)};
                for (int k = 0; k < 4; k++) {
                    int s = 4 * h + k;
                    __m256i c = _mm256_or_si256(lo[k], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * k),
                                                                                          m2), 4));
                    sb_acc(c, pick16(h ? sb : sa, 2 * k, 2 * k + 1), xq, s, rb, R, P, ahi, alo);
                }
            }
        } else {
            const int five = fmt == Q5_K;
            const uint8_t *qs = blk + (five ? 48 : 16);
            uint8_t sc[8], mn[8];
            k_scale_min(blk + 4, sc, mn);
            dw = f16c(blk);
            dm = f16c(blk + 2);
            __m128i mv = _mm_loadl_epi64((const __m128i *)mn);
            mv = _mm_unpacklo_epi8(mv, mv);
            w0 = _mm256_cvtepu8_epi32(mv);
            w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(mv, 8));
            __m256i sv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            for (int i = 0; i < 4; i++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
                __m256i c0 = _mm256_and_si256(v, m4), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (five) {
                    const __m256i x10 = _mm256_set1_epi8(0x10);
                    __m256i b0 = _mm256_set1_epi8((char)(1 << 2 * i)), b1 = _mm256_set1_epi8((char)(2 << 2 * i));
                    c0 = _mm256_or_si256(c0, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), x10));
                    c1 = _mm256_or_si256(c1, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), x10));
                }
                sb_acc(c0, pick16(sv, 2 * i, 2 * i), xq, 2 * i, rb, R, P, ahi, alo);
                sb_acc(c1, pick16(sv, 2 * i + 1, 2 * i + 1), xq, 2 * i + 1, rb, R, P, ahi, alo);
            }
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *x = xq + r * rb;
            float dx = rdf32(x);
            __m256i bs0 = _mm256_loadu_si256((const __m256i *)(x + 4)), bs1 = _mm256_loadu_si256((const __m256i *)(x + 36));
            __m256 M = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_mullo_epi32(w0, bs0), _mm256_mullo_epi32(w1, bs1)));
            __m256 hi = _mm256_cvtepi32_ps(ahi[r]);
            __m256 v = P == 2 ? _mm256_add_ps(_mm256_mul_ps(hi, k256), _mm256_cvtepi32_ps(alo[r])) : hi;
            v = _mm256_mul_ps(_mm256_set1_ps(dw * dx), v);
            if (b & 1) l1[r] = _mm256_add_ps(l1[r], v);
            else l0[r] = _mm256_add_ps(l0[r], v);
            m[r] = _mm256_add_ps(m[r], _mm256_mul_ps(_mm256_set1_ps(dm * dx), fmt == Q6_K ? _mm256_mul_ps(k32, M) : M));
        }
    }
    for (int r = 0; r < R; r++) y[r * ldy] = finish(l0[r], l1[r], -sum8(m[r]));
}

#define DOT_PR(F, KIND, P, R)                                                                                          \
    AVX2 static void dot_##F##_##P##_##R(const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, float *y,      \
                                         int64_t ldy) {                                                              \
        KIND##_avx2(F, row, xq, rb, K, P, R, y, ldy);                                                                  \
    }
/* the rows_fn (q8.h) of a format, layout kind and plane count: the R = 1 dot in q8.h's row loop */
#define ROWS_PR(F, KIND, P)                                                                                            \
    AVX2 static void rows_##F##_##P(const uint8_t *q, int64_t row_bytes, const uint8_t *xq, int64_t K, float *y,       \
                                    int64_t n0, int64_t n1, int64_t pf) {                                              \
        ROWS_BODY(KIND##_avx2(F, row, xq, 0, K, P, 1, y + n, 1))                                                       \
    }
#define DOT_FMT(F, KIND)                                                                                               \
    DOT_PR(F, KIND, 1, 1) DOT_PR(F, KIND, 1, 2) DOT_PR(F, KIND, 1, 3) DOT_PR(F, KIND, 1, 4)                            \
    DOT_PR(F, KIND, 2, 1) DOT_PR(F, KIND, 2, 2) DOT_PR(F, KIND, 2, 3) DOT_PR(F, KIND, 2, 4)                            \
    static const dot_fn dots_##F[2][4] = {{dot_##F##_1_1, dot_##F##_1_2, dot_##F##_1_3, dot_##F##_1_4},              \
                                          {dot_##F##_2_1, dot_##F##_2_2, dot_##F##_2_3, dot_##F##_2_4}};               \
    ROWS_PR(F, KIND, 1) ROWS_PR(F, KIND, 2)
DOT_FMT(Q4_0, dot32)
DOT_FMT(Q4_1, dot32)
DOT_FMT(Q5_0, dot32)
DOT_FMT(Q5_1, dot32)
DOT_FMT(Q8_0, dot32)
DOT_FMT(Q4_K, dotk)
DOT_FMT(Q5_K, dotk)
DOT_FMT(Q6_K, dotk)
#define DOT_SB(F, P, R)                                                                                                \
    AVX2 static void dotsb_##F##_##P##_##R(const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, float *y,    \
                                           int64_t ldy) {                                                            \
        dotsb_avx2(F, row, xq, rb, K, P, R, y, ldy);                                                                   \
    }
#define ROWS_SB(F, P)                                                                                                  \
    AVX2 static void rowssb_##F##_##P(const uint8_t *q, int64_t row_bytes, const uint8_t *xq, int64_t K, float *y,     \
                                      int64_t n0, int64_t n1, int64_t pf) {                                            \
        ROWS_BODY(dotsb_avx2(F, row, xq, 0, K, P, 1, y + n, 1))                                                        \
    }
#define DOT_SB_FMT(F)                                                                                                  \
    DOT_SB(F, 1, 1) DOT_SB(F, 1, 2) DOT_SB(F, 1, 3) DOT_SB(F, 1, 4)                                                    \
    DOT_SB(F, 2, 1) DOT_SB(F, 2, 2) DOT_SB(F, 2, 3) DOT_SB(F, 2, 4)                                                    \
    static const dot_fn dotsbs_##F[2][4] = {{dotsb_##F##_1_1, dotsb_##F##_1_2, dotsb_##F##_1_3, dotsb_##F##_1_4},     \
                                            {dotsb_##F##_2_1, dotsb_##F##_2_2, dotsb_##F##_2_3, dotsb_##F##_2_4}};     \
    ROWS_SB(F, 1) ROWS_SB(F, 2)
DOT_SB_FMT(Q4_K)
DOT_SB_FMT(Q5_K)
DOT_SB_FMT(Q6_K)

/* the rows_fn for fmt and x layout XF (as dot_avx2_for's, at one x row) */
static rows_fn rows_avx2_for(int fmt, int XF) {
    if (low_q8_has(fmt)) return low_q8_rows_avx2(fmt, XF);
    if (XF >= 3) {
        static const rows_fn sb[][2] = {[Q4_K] = {rowssb_Q4_K_1, rowssb_Q4_K_2}, [Q5_K] = {rowssb_Q5_K_1, rowssb_Q5_K_2},
                                        [Q6_K] = {rowssb_Q6_K_1, rowssb_Q6_K_2}};
        return sb[fmt][sb_planes(XF) - 1];
    }
    static const rows_fn all[][2] = {[Q4_0] = {rows_Q4_0_1, rows_Q4_0_2}, [Q4_1] = {rows_Q4_1_1, rows_Q4_1_2},
                                     [Q5_0] = {rows_Q5_0_1, rows_Q5_0_2}, [Q5_1] = {rows_Q5_1_1, rows_Q5_1_2},
                                     [Q8_0] = {rows_Q8_0_1, rows_Q8_0_2}, [Q4_K] = {rows_Q4_K_1, rows_Q4_K_2},
                                     [Q5_K] = {rows_Q5_K_1, rows_Q5_K_2}, [Q6_K] = {rows_Q6_K_1, rows_Q6_K_2}};
    return all[fmt][XF - 1];
}

/* the kernel for fmt, x layout XF (1 or 2 planes of 32-blocks, 3 or 4 super-blocks of 2 or 1 planes), R x rows */
static dot_fn dot_avx2_for(int fmt, int XF, int R) {
    if (low_q8_has(fmt)) return low_q8_dot_avx2(fmt, XF, R);
    static const dot_fn (*all[])[4] = {[Q4_0] = dots_Q4_0, [Q4_1] = dots_Q4_1, [Q5_0] = dots_Q5_0,
                                       [Q5_1] = dots_Q5_1, [Q8_0] = dots_Q8_0, [Q4_K] = dots_Q4_K,
                                       [Q5_K] = dots_Q5_K, [Q6_K] = dots_Q6_K};
    if (XF >= 3) return (fmt == Q4_K ? dotsbs_Q4_K : fmt == Q5_K ? dotsbs_Q5_K : dotsbs_Q6_K)[sb_planes(XF) - 1][R - 1];
    return all[fmt][XF - 1][R - 1];
}
#endif

/* ---- entry points (arguments checked by the Python wrapper) ---- */

static void quant_rows_scalar(const float *x, int64_t K, int64_t T, uint8_t *xq, int XF) {
    for (int64_t t = 0; t < T; t++) {
        uint8_t *o = xq + t * sluice_q8_row_bytes(K, XF);
        if (XF >= 3) quant_row_sb(x + t * K, K, o, sb_planes(XF));
        else quant_row(x + t * K, K, o, XF);
    }
}

#if SLUICE_X86
AVX2 static void quant_rows_avx2(const float *x, int64_t K, int64_t T, uint8_t *xq, int XF) {
    for (int64_t t = 0; t < T; t++) {
        uint8_t *o = xq + t * sluice_q8_row_bytes(K, XF);
        if (XF >= 3) quant_row_sb(x + t * K, K, o, sb_planes(XF));
        else quant_row(x + t * K, K, o, XF);
    }
}
#endif

/* T rows of x [T, K] -> xq [T, sluice_q8_row_bytes(K, XF)]: XF 1 or 2 planes of 32-value blocks, 3 / 4
 * super-blocks */
void sluice_quantize_q8(int64_t K, const float *x, int64_t T, uint8_t *xq, int XF, int scalar) {
    (void)scalar;
#if SLUICE_X86
    if (sluice_avx2_ok(scalar) && sluice_simd()) { quant_rows_avx2(x, K, T, xq, XF); return; }
#endif
    quant_rows_scalar(x, K, T, xq, XF);
}

/* Software prefetch: while a task computes row n, the bytes pf_bytes past row n's start come into the cache (the rows
 * of a task are contiguous, and a task is ~36 KB: the hardware prefetcher alone ramps up too late). 0 turns it off
 * (native.set_prefetch, a benchmark hook). */
static int64_t pf_bytes = 2048;
void sluice_set_prefetch(int64_t bytes) { pf_bytes = bytes < 0 ? 0 : bytes; }

/* y[t, n] for n in [n0, n1) from xq in fmt's layout XF (xf_for) */
static void rows_q8(int fmt, int64_t N, int64_t K, const uint8_t *q, int64_t row_bytes, const uint8_t *xq, int64_t T,
                    int XF, float *y, int64_t n0, int64_t n1, int scalar) {
    const int64_t rb = sluice_q8_row_bytes(K, XF);
    (void)scalar;
#if SLUICE_X86
    if (sluice_avx2_ok(scalar) && sluice_simd() && T == 1) {  /* a decode token: the rows in one call (q8.h rows_fn) */
        rows_avx2_for(fmt, XF)(q, row_bytes, xq, K, y, n0, n1, pf_bytes);
        return;
    }
    if (sluice_avx2_ok(scalar) && sluice_simd()) {  /* x rows 4 at a time against each weight row */
        /* the kernels for 4 x rows and the rest, chosen once per call (per row: two calls through the PLT) */
        const dot_fn four = dot_avx2_for(fmt, XF, 4), rest = T % 4 ? dot_avx2_for(fmt, XF, (int)(T % 4)) : four;
        const int64_t pf = pf_bytes;
        ROWS_BODY(for (int64_t t = 0; t < T; t += 4)
                      (T - t < 4 ? rest : four)(row, xq + t * rb, rb, K, y + t * N + n, N))
        return;
    }
#endif
    for (int64_t n = n0; n < n1; n++)
        for (int64_t t = 0; t < T; t++)
            y[t * N + n] = low_q8_has(fmt) ? low_q8_dot_scalar(fmt, q + n * row_bytes, xq + t * rb, K, XF)
                           : XF >= 3 ? dot_scalar_sb(fmt, q + n * row_bytes, xq + t * rb, K, sb_planes(XF))
                                     : dot_scalar_q8(fmt, q + n * row_bytes, xq + t * rb, K, XF);
}

/* y[t, n] for n in [n0, n1) (y [T, N]) from the quantized x rows xq (in the layout of fmt with P planes:
 * sluice_q8_layout), or from x [T, K] float32 quantized here when xq is NULL (one call instead of two: ~10 us of
 * Python less per projection); scalar caps the path (common.h: 1 the portable one). Returns 0, -1 when the
 * quantized rows cannot be allocated, -2 for a format without an integer path or P not 1 or 2. */
int sluice_linear_q8(int fmt, int64_t N, int64_t K, const uint8_t *q, int64_t row_bytes, const uint8_t *xq,
                     const float *x, int64_t T, int P, float *y, int64_t n0, int64_t n1, int scalar) {
    if (!has_q8(fmt) || (P != 1 && P != 2)) return -2;
    const int XF = xf_for(fmt, P);
    uint8_t *own = NULL;
    if (!xq) {
        own = (uint8_t *)malloc((size_t)(T * sluice_q8_row_bytes(K, XF)));
        if (!own) return -1;
        sluice_quantize_q8(K, x, T, own, XF, scalar);
        xq = own;
    }
    rows_q8(fmt, N, K, q, row_bytes, xq, T, XF, y, n0, n1, scalar);
    free(own);
    return 0;
}

/* ---- one whole expert: y[T, H] = down(silu(gate x) * up x) ---- */

/* silu(g) * u in float32 (g / (1 + e^-g), libm's expf: the same on both paths), written over g */
static void swiglu(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* x [T, K] quantized in the layouts the projections read: xq[0] for P (32-value blocks), xq[1] for super-blocks,
 * each only when `need` has it (bit 0 / bit 1); one allocation, freed by the caller (NULL: no memory) */
static uint8_t *quantize_for(int need, int64_t K, const float *x, int64_t T, int P, int scalar, uint8_t **xq) {
    size_t b0 = need & 1 ? (size_t)(T * sluice_q8_row_bytes(K, P)) : 0;
    size_t b1 = need & 2 ? (size_t)(T * sluice_q8_row_bytes(K, sb_xf(P))) : 0;
    uint8_t *buf = (uint8_t *)malloc(b0 + b1 + 1);
    if (!buf) return NULL;
    xq[0] = buf;
    xq[1] = buf + b0;
    if (need & 1) sluice_quantize_q8(K, x, T, xq[0], P, scalar);
    if (need & 2) sluice_quantize_q8(K, x, T, xq[1], sb_xf(P), scalar);
    return buf;
}

static int need_bit(int fmt, int P) { return xf_for(fmt, P) >= 3 ? 2 : 1; }

int sluice_experts_q8(int64_t n, const int64_t *experts, int64_t H, int64_t I, const float *x, int64_t T, int P,
                      int scalar);

/* gate, up [I, H] and down [H, I] from their stored rows (format, codes, bytes per row), x [T, H] float32 -> y [T, H]
 * float32: x quantized once per layout for gate and up, the SwiGLU product in float32, re-quantized once for down;
 * one call instead of three plus the conversions between them. It is sluice_experts_q8 for one expert (its rows
 * over the pool too). Returns 0, -1 when the scratch cannot be allocated, -2 for a format without an integer path
 * or P not 1 or 2. */

int sluice_expert_q8(int gf, const uint8_t *gq, int64_t grb, int uf, const uint8_t *uq, int64_t urb, int df,
                     const uint8_t *dq, int64_t drb, int64_t H, int64_t I, const float *x, int64_t T, int P, float *y,
                     int scalar) {
    const int64_t e[10] = {gf, (intptr_t)gq, grb, uf, (intptr_t)uq, urb, df, (intptr_t)dq, drb, (intptr_t)y};
    return sluice_experts_q8(1, e, H, I, x, T, P, scalar);
}

/* ---- jobs over the pool (pool.c): several projections of one x, the experts of one layer ---- */

/* output rows per task: one contiguous stretch of at least TASK_MIN weights (a 1024-wide Q4_K row takes ~0.15 us on
 * one core here, a task handoff a few us), longer where the job's `total` weights still give each thread
 * task_spread tasks. Long stretches because a decode step's weights stream from memory, which a core reads fastest
 * in long runs: a layer's 8 experts of the peers Q4_K_M shape, cold, 2 threads, took 439-456 us in one task per
 * projection, 626-634 in 64K-weight tasks (17.9-18.6 vs 12.9-13.0 GB/s; one thread 9.6-10.2 either way;
 * benchmarks/quantized/expert_layer.py, results/quantized/breakdown/expert-layer.txt). */
#define TASK_MIN 65536
static int64_t task_spread = 4;
/* benchmark hook (native.set_task_spread): a huge spread gives every job TASK_MIN tasks, as before the long ones */
void sluice_set_task_spread(int64_t spread) { task_spread = spread < 1 ? 1 : spread; }
int sluice_threads(void);  /* pool.c */
static int64_t task_rows(int64_t K, int64_t total) {
    int64_t w = total / ((int64_t)sluice_threads() * task_spread);
    w = w < TASK_MIN ? TASK_MIN : w;
    return w <= K ? 1 : w / K;
}

#define MAX_PROJ 16
typedef struct {
    int64_t m, K, T, step, first[MAX_PROJ + 1];  /* first[a]: the first task of projection a; first[m]: all */
    const int64_t *d;                          /* m x (format, N, codes, bytes per row, y, y is bf16) */
    float *y[MAX_PROJ];                         /* where each projection's float32 rows go */
    uint8_t *xq[2];
    int P, scalar;
} lin_job;

void sluice_to_bf16(int64_t n, const float *x, uint16_t *out, int scalar);  /* kernels.c */

static void lin_task(void *c, int64_t i) {
    const lin_job *j = (const lin_job *)c;
    int64_t a = 0;
    while (j->first[a + 1] <= i) a++;
    const int64_t *d = j->d + 6 * a;
    int fmt = (int)d[0];
    int64_t n0 = (i - j->first[a]) * j->step, n1 = n0 + j->step < d[1] ? n0 + j->step : d[1];
    rows_q8(fmt, d[1], j->K, (const uint8_t *)(intptr_t)d[2], d[3], j->xq[need_bit(fmt, j->P) - 1], j->T,
            xf_for(fmt, j->P), j->y[a], n0, n1, j->scalar);
}

/* y_a [T, N_a] = x [T, K] @ W_a^T for m <= 16 projections of one x (a layer's q, k and v; one head): x quantized
 * once per layout, the output rows of all of them split over the pool. descs: m x (format, N, codes address,
 * bytes per row, y address, 1 when y is bf16 (the float32 result rounded to nearest even, as torch's .to) else
 * 0). Each y element is what sluice_linear_q8 computes, whichever thread ran it. Returns 0, -1 when the scratch
 * cannot be allocated, -2 for a format without an integer path, P not 1 or 2, or m > 16. */
int sluice_linears_q8(int64_t m, const int64_t *descs, int64_t K, const float *x, int64_t T, int P, int scalar) {
    if (m < 1 || m > MAX_PROJ || (P != 1 && P != 2)) return -2;
    int64_t total = 0;  /* the job's weights */
    for (int64_t a = 0; a < m; a++) total += descs[6 * a + 1] * K;
    lin_job j = {.m = m, .K = K, .T = T, .step = task_rows(K, total), .d = descs, .P = P, .scalar = scalar};
    int need = 0;
    int64_t tmp = 0;  /* float32 values of the bf16 outputs */
    for (int64_t a = 0; a < m; a++) {
        const int64_t *d = descs + 6 * a;
        if (!has_q8((int)d[0])) return -2;
        need |= need_bit((int)d[0], P);
        j.first[a + 1] = j.first[a] + (d[1] + j.step - 1) / j.step;
        if (d[5]) tmp += T * d[1];
    }
    float *ftmp = tmp ? (float *)malloc((size_t)tmp * sizeof(float)) : NULL;
    uint8_t *buf = quantize_for(need, K, x, T, P, scalar, j.xq);
    if (!buf || (tmp && !ftmp)) {
        free(buf);
        free(ftmp);
        return -1;
    }
    for (int64_t a = 0, at = 0; a < m; a++) {
        const int64_t *d = descs + 6 * a;
        j.y[a] = d[5] ? ftmp + at : (float *)(intptr_t)d[4];
        if (d[5]) at += T * d[1];
    }
    pool_run(lin_task, &j, j.first[m]);
    for (int64_t a = 0; a < m; a++)
        if (descs[6 * a + 5]) sluice_to_bf16(T * descs[6 * a + 1], j.y[a], (uint16_t *)(intptr_t)descs[6 * a + 4],
                                           scalar);
    free(buf);
    free(ftmp);
    return 0;
}


static void gate_up_task(void *c, int64_t i) {  /* rows of expert i / tasks1's gate (first half) or up */
    const exp_job *j = (const exp_job *)c;
    int64_t e = i / j->tasks1, r = i % j->tasks1, half = j->tasks1 / 2, up = r >= half;
    const int64_t *d = j->e + 10 * e + 3 * up;
    int fmt = (int)d[0];
    int64_t n0 = (r - up * half) * j->step1, n1 = n0 + j->step1 < j->I ? n0 + j->step1 : j->I;
    rows_q8(fmt, j->I, j->H, (const uint8_t *)(intptr_t)d[1], d[2], j->xq[need_bit(fmt, j->P) - 1], j->T,
            xf_for(fmt, j->P), (up ? j->u : j->g) + e * j->T * j->I, n0, n1, j->scalar);
}

static void glu_task(void *c, int64_t e) {  /* silu(g) * u of expert e, quantized for its down projection */
    const exp_job *j = (const exp_job *)c;
    float *g = j->g + e * j->T * j->I;
    swiglu(g, j->u + e * j->T * j->I, j->T * j->I);
    sluice_quantize_q8(j->I, g, j->T, j->hq + e * j->T * j->hrb, xf_for((int)j->e[10 * e + 6], j->P), j->scalar);
}

static void down_task(void *c, int64_t i) {
    const exp_job *j = (const exp_job *)c;
    int64_t e = i / j->tasks3, n0 = i % j->tasks3 * j->step3, n1 = n0 + j->step3 < j->H ? n0 + j->step3 : j->H;
    const int64_t *d = j->e + 10 * e + 6;
    rows_q8((int)d[0], j->H, j->I, (const uint8_t *)(intptr_t)d[1], d[2], j->hq + e * j->T * j->hrb, j->T,
            xf_for((int)d[0], j->P), (float *)(intptr_t)d[3], n0, n1, j->scalar);
}

/* sluice_experts_q8's checks, scratch and x's codes (r->n 0: nothing to run; the codes as below) */
static int experts_begin(experts_run *r, int64_t n, const int64_t *experts, int64_t H, int64_t I, const float *x,
                         int64_t T, int P, int scalar) {
    r->n = 0;
    r->started = 0;
    if (P != 1 && P != 2) return -2;
    int need = 0;
    for (int64_t e = 0; e < n; e++) {
        for (int k = 0; k < 3; k++)
            if (!has_q8((int)experts[10 * e + 3 * k])) return -2;
        need |= need_bit((int)experts[10 * e], P) | need_bit((int)experts[10 * e + 3], P);
    }
    if (n < 1) return 0;
    int64_t hrb = sluice_q8_row_bytes(I, P), hrb3 = I % 256 ? 0 : sluice_q8_row_bytes(I, sb_xf(P));
    exp_job j = {.e = experts, .H = H, .I = I, .T = T, .step1 = task_rows(H, 3 * n * H * I),
                 .step3 = task_rows(I, 3 * n * H * I),
                 .hrb = hrb > hrb3 ? hrb : hrb3, .P = P, .scalar = scalar};
    j.tasks1 = 2 * ((I + j.step1 - 1) / j.step1);
    j.tasks3 = (H + j.step3 - 1) / j.step3;
    uint8_t *xbuf = quantize_for(need, H, x, T, P, scalar, j.xq);
    float *gu = (float *)malloc(2 * (size_t)(n * T * I) * sizeof(float) + (size_t)(n * T * j.hrb));
    if (!xbuf || !gu) {
        free(xbuf);
        free(gu);
        return -1;
    }
    j.g = gu;
    j.u = gu + n * T * I;
    j.hq = (uint8_t *)(j.u + n * T * I);
    r->j = j;
    r->xbuf = xbuf;
    r->gu = gu;
    r->n = n;
    return 0;
}

static void experts_end(experts_run *r) {  /* the steps after gate and up, and the scratch freed */
    if (!r->n) return;
    pool_run(glu_task, &r->j, r->n);
    pool_run(down_task, &r->j, r->n * r->j.tasks3);
    free(r->xbuf);
    free(r->gu);
    r->n = 0;
}

/* n SwiGLU experts on one x [T, H] float32, y_e [T, H] float32 = down_e(silu(gate_e x) * up_e x), the rows of all
 * their projections split over the pool in three steps (gate and up rows; each expert's product, quantized; down
 * rows). experts: n x (gate format, codes address, bytes per row, up ..., down ..., y_e address). y_e is
 * bitwise sluice_expert_q8's for expert e: x is quantized once per layout (the same bytes each call made), every
 * row is the same kernel call. Returns 0, -1 when the scratch cannot be allocated, -2 for a format without an
 * integer path or P not 1 or 2. */
int sluice_experts_q8(int64_t n, const int64_t *experts, int64_t H, int64_t I, const float *x, int64_t T, int P,
                      int scalar) {
    experts_run r;
    int rc = experts_begin(&r, n, experts, H, I, x, T, P, scalar);
    if (rc || !r.n) return rc;
    pool_run(gate_up_task, &r.j, n * r.j.tasks1);
    experts_end(&r);
    return 0;
}

/* sluice_experts_q8 in two calls on one thread: experts_q8_start returns with the gate and up rows started on the
 * pool's workers (r->started 1; where the pool cannot start a job, run here: 0), experts_q8_finish runs what is left
 * of them, then the rest. `experts` and x stay valid until then. Every row the same call: the same bits. */
int experts_q8_start(experts_run *r, int64_t n, const int64_t *experts, int64_t H, int64_t I, const float *x,
                     int64_t T, int P, int scalar) {
    int rc = experts_begin(r, n, experts, H, I, x, T, P, scalar);
    if (rc || !r->n) return rc;
    r->started = pool_start(gate_up_task, &r->j, n * r->j.tasks1);
    if (!r->started) pool_run(gate_up_task, &r->j, n * r->j.tasks1);
    return 0;
}

void experts_q8_finish(experts_run *r) {
    if (r->started) pool_finish();
    r->started = 0;
    experts_end(r);
}
