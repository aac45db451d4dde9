/* The integer path (q8.c's scheme: x coded once to 8-bit planes, integer dots against the stored codes) for the
 * low-bit GGUF types: the 2-3 bit K-quants Q2_K, Q3_K, the ternary TQ1_0, TQ2_0, IQ4_XS, and the grid types of
 * q8_iq.h (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) read x in q8.h's super-blocks of 256 values
 * (d, the 16 sums of 16 codes, hi[256], lo[256]); IQ4_NL and GGUF's MXFP4, 32-value blocks, read its 32-value
 * blocks. Every block is, in exact arithmetic (lowbit.h lowblk),
 *     w[v] = dw * sc[v / 16] * c[v] - dm * mf[v / 16]
 * with int8 codes c, integer scales sc and min / offset factors mf, so one 256-block against x's super-block is
 *     A[l] = sum over its 8 chunks of 32 values s, l = 0..7, of sc * (sum of c * code over values 32s + 4l .. + 3)
 *     M[l] = mf[g] * S[g] + mf[g + 1] * S[g + 1],  g = 2 * MPAIR[l],  S[g] = x's sum of codes over values 16g .. +15
 *     a = fma(dw * d_x, (float)A_hi[l] * 256 + (float)A_lo[l], lane[b & 1][l])   (one plane: (float)A_hi[l])
 *     lane[b & 1][l] = fma(-(dm * d_x), (float)M[l], a)                  (a alone for the types without mf)
 *     y = reduce16(lane) + 0
 * and a 32-value block  lane[b & 1][l] += (dw * d_x) * (float)(sum of c * code over values 4l .. 4l + 3),
 * y = reduce16(lane) + 0. (The M term rides in the lanes: a min term summed to one float per block, as q8.c's
 * K-quants do, is a serial scalar chain per row, which perf showed hot in a 512-wide Q2_K row.) MPAIR pairs the 16
 * groups the way AVX2 sums pairs of them: one madd of the int16 factors against x's sums packed to int16 (packs_epi32
 * orders them 0-3, 8-11 | 4-7, 12-15) with one plane, hadd of the two int32 products with two; the fused
 * multiply-adds (fmaf here, fmadd / fnmadd there) round once each on both paths. The integer sums are
 * exact (bounds below), the float operations the same on both paths:
 * the portable path unpacks a block with lowbit_unpack (the dequantization's own unpacking) and sums plainly, the
 * AVX2 path builds each chunk's codes in a register (magnitudes for maddubs, their signs put on x with sign_epi8,
 * scales through madd), so both give the same bits, for any T and any row split (q8.c's pool jobs).
 *
 * Exactness: maddubs pairs are |c| * 127 * 2 <= 32,258 (IQ4's |c| <= 127), so no int16 saturates; A per lane and
 * block < 2^25; M[l] < 2^28 (Q3_K, the largest: 2 groups x |4 * sc| <= 128 x 16 codes x 32,639 = 1.3e8).
 * The scales that are half steps in the reference ((d * (0.5 + s)) * 0.25 for IQ2) become the odd integer 2s + 1
 * with dw = d / 8 (d / 4 for IQ3_XXS): the same real weight, not the same rounding, like every integer kernel.
 *
 * Time, a [2048 x 512] projection at T=1 on one thread, us of thread CPU time, int16 / int8 activations, against
 * llama.cpp's own vec_dot on the same bytes (AVX-512 build) and the torch dequantization + F.linear these types ran
 * before (`benchmarks/lowbit_kernels.py`, benchmarks/results/lowbit/kernels.txt, Sapphire Rapids VM):
 *   Q2_K 51 / 40, llama.cpp 27, torch 1832     IQ2_XXS 89 / 77, 64, 3808     MXFP4 76 / 61, 47, 4033
 *   Q3_K 76 / 61, 43, 2969                     IQ3_XXS 107 / 99, 86, 4141    TQ1_0 61 / 46, 36, 3355
 *   IQ4_NL 75 / 60, 47, 5906                   IQ3_S 150 / 138, 112, 5262    (q8.c's Q4_K 57 / 43, 31, 1262)
 *   IQ4_XS 69 / 50, 41, 4063
 * so llama.cpp's kernels are 1.2-1.8x faster than the same coding here (1.4x for Q4_K; IQ1_M, untuned, 1.8x), and
 * the default two planes cost 1.1-1.6x one plane. On an AVX2-only AMD EPYC (Zen 3), where llama.cpp's build is AVX2
 * code too, one plane, after this file's tuning there (benchmarks/results/lowbit/README.md, its AVX2 section):
 * IQ2_XXS 107 against llama.cpp's 104, IQ3_XXS 144 against 142, Q3_K 81 against 72, IQ4_XS 80 against 71, Q2_K ~50
 * against 46-49.
 */
#include "lowbit.h"
#include "q8.h"

int low_q8_has(int fmt) { return fmt == MXFP4 || is_lowbit(fmt); }
int low_q8_sb(int fmt) { return lowbit_block_values(fmt) == 256; }

/* the types whose unsigned codes carry a min (Q2_K) or an offset (Q3_K: -4, TQ: -1) into the M term */
static inline int has_m(int fmt) { return fmt == Q2_K || fmt == Q3_K || fmt == TQ1_0 || fmt == TQ2_0; }

/* lane l's M term sums groups 2 * MPAIR[l] and 2 * MPAIR[l] + 1 (the header's order) */
static const int MPAIR[8] = {0, 1, 4, 5, 2, 3, 6, 7};

/* ---- portable scalar path ---- */

static float dotsb_scalar(int fmt, const uint8_t *row, const uint8_t *xs, int64_t K, int P) {
    float lane[2][8] = {{0}};
    const int bb = lowbit_block_bytes(fmt);
    lowblk u;
    for (int64_t b = 0; b < K / 256; b++, xs += SB_BYTES(P)) {
        lowbit_unpack(fmt, row + b * bb, &u);
        const int8_t *hi = (const int8_t *)(xs + SB_HI), *lo = (const int8_t *)(xs + SB_LO);
        int32_t ahi[8] = {0}, alo[8] = {0};
        for (int s = 0; s < 8; s++)
            for (int l = 0; l < 8; l++) {
                int h = 0, o = 0;
                for (int v = 32 * s + 4 * l; v < 32 * s + 4 * l + 4; v++) {
                    h += u.c[v] * hi[v];
                    if (P == 2) o += u.c[v] * lo[v];
                }
                ahi[l] += u.sc[2 * s + l / 4] * h;
                alo[l] += u.sc[2 * s + l / 4] * o;
            }
        float dx = rdf32(xs), f = u.dw * dx, fm = u.dm * dx;
        for (int l = 0; l < 8; l++) {
            float v = fmaf(f, P == 2 ? (float)ahi[l] * 256.0f + (float)alo[l] : (float)ahi[l], lane[b & 1][l]);
            if (has_m(fmt)) {
                const int g = 2 * MPAIR[l];
                v = fmaf(-fm, (float)(u.mf[g] * rdi32(xs + 4 + 4 * g) + u.mf[g + 1] * rdi32(xs + 8 + 4 * g)), v);
            }
            lane[b & 1][l] = v;
        }
    }
    return reduce16(lane[0], lane[1]) + 0.0f;
}

static float dot32_scalar(int fmt, const uint8_t *row, const uint8_t *xq, int64_t K, int P) {
    float lane[2][8] = {{0}};
    const int bb = lowbit_block_bytes(fmt);
    lowblk u;
    for (int64_t b = 0; b < K / 32; b++, xq += XB(P)) {
        lowbit_unpack(fmt, row + b * bb, &u);
        const int8_t *q = (const int8_t *)(xq + 8);
        float f = u.dw * rdf32(xq);
        for (int l = 0; l < 8; l++) {
            int s = 0;
            for (int j = 4 * l; j < 4 * l + 4; j++) s += u.c[j] * (P == 2 ? 256 * q[j] + q[32 + j] : q[j]);
            lane[b & 1][l] = lane[b & 1][l] + f * (float)s;
        }
    }
    return reduce16(lane[0], lane[1]) + 0.0f;
}

float low_q8_dot_scalar(int fmt, const uint8_t *row, const uint8_t *xq, int64_t K, int XF) {
    return XF >= 3 ? dotsb_scalar(fmt, row, xq, K, sb_planes(XF)) : dot32_scalar(fmt, row, xq, K, XF);
}

/* ---- AVX2 path ---- */
#if SLUICE_X86

/* chunk s (values 32s .. 32s + 31) of a block into the integer lanes of R x rows: magnitudes mag (uint8), the
 * signs put on x (sgned: x's sign flipped where sgn < 0, zeroed where sgn == 0), int16 scales sc (one per 16-value
 * half: pick16) */
AVX2_INLINE void acc_chunk(__m256i mag, __m256i sgn, const int sgned, __m256i sc, const uint8_t *xs, int s, int64_t rb,
                           const int R, const int P, __m256i *ahi, __m256i *alo, int8_t *codes) {
    if (codes) {  /* the dequantization's unpacking (lowbit_deq_row_avx2): the chunk's codes, lowbit_codes' bytes */
        _mm256_storeu_si256((__m256i *)(codes + 32 * s), sgned ? _mm256_sign_epi8(mag, sgn) : mag);
        return;
    }
    for (int r = 0; r < R; r++) {
        const uint8_t *x = xs + r * rb;
        __m256i h = _mm256_loadu_si256((const __m256i *)(x + SB_HI + 32 * s));
        if (sgned) h = _mm256_sign_epi8(h, sgn);
        ahi[r] = _mm256_add_epi32(ahi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, h), sc));
        if (P == 2) {
            __m256i l = _mm256_loadu_si256((const __m256i *)(x + SB_LO + 32 * s));
            if (sgned) l = _mm256_sign_epi8(l, sgn);
            alo[r] = _mm256_add_epi32(alo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, l), sc));
        }
    }
}

/* the float factors of a block, and (has_m) the 16 int8 factors of its M term (group g in byte g) */
typedef struct {
    float dw, dm;
    __m128i mf;
} lowf;

/* the arguments every block function takes: the block b, R x rows' super-blocks at xs + r * rb and their integer
 * lanes; or, codes non-NULL (R = 0), where its codes go instead */
#define BLK_ARGS const uint8_t *b, const uint8_t *xs, int64_t rb, const int R, const int P, __m256i *ahi, __m256i *alo, \
                 lowf *f, int8_t *codes
#define CHUNK(mag, sgn, sgned, sc, s) acc_chunk(mag, sgn, sgned, sc, xs, s, rb, R, P, ahi, alo, codes)

/* 16 int8 per-16-value scales -> the two int16 vectors pick16 takes (groups 0-7 and 8-15, each in both lanes) */
AVX2_INLINE void scales_16(__m128i s8, int sgned, __m256i *sa, __m256i *sb) {
    __m128i h = _mm_srli_si128(s8, 8);
    *sa = _mm256_broadcastsi128_si256(sgned ? _mm_cvtepi8_epi16(s8) : _mm_cvtepu8_epi16(s8));
    *sb = _mm256_broadcastsi128_si256(sgned ? _mm_cvtepi8_epi16(h) : _mm_cvtepu8_epi16(h));
}

/* chunks 4h .. 4h + 3 of a 2-bit field layout (Q2_K, Q3_K, TQ2_0): value 128h + 32j + l is bits 2j, 2j+1 of q[l] */
AVX2_INLINE __m256i crumb(__m256i q, int j) { return _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3)); }

AVX2_INLINE void blk_q2_k(BLK_ARGS) {  /* codes 0..3, scale sc & 15, min sc >> 4 per 16 values */
    const __m128i s8 = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(15);
    const __m128i mn = _mm_and_si128(_mm_srli_epi16(s8, 4), m4);
    __m256i sa, sb;
    scales_16(_mm_and_si128(s8, m4), 0, &sa, &sb);
    f->mf = mn;
    f->dw = f16c(b + 80);
    f->dm = f16c(b + 82);
    for (int h = 0; h < 2; h++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * h));
        for (int j = 0; j < 4; j++) {
            __m256i c = crumb(q, j);
            CHUNK(c, c, 0, pick16(h ? sb : sa, 2 * j, 2 * j + 1), 4 * h + j);
        }
    }
}

AVX2_INLINE void blk_q3_k(BLK_ARGS) {  /* codes low | 4 * high (0..7), scales sc6 - 32, M factors 4 * scale */
    const __m128i m4 = _mm_set1_epi8(15), v = _mm_loadl_epi64((const __m128i *)(b + 96));
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    const int t = (int)rd32(b + 104);  /* byte 4k + j of `top`: bits 2k, 2k+1 of byte 8 + j, scale 4k + j's top */
    const __m128i top = _mm_and_si128(_mm_setr_epi32(t, t >> 2, t >> 4, t >> 6), _mm_set1_epi8(3));
    const __m128i s6 = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
    __m256i sa, sb;
    scales_16(s6, 1, &sa, &sb);
    const __m128i s12 = _mm_add_epi8(s6, s6);
    f->mf = _mm_add_epi8(s12, s12);  /* 4 * s6 (s6 the signed scale, -32 .. 31): -128 .. 124, an int8 */
    f->dw = f->dm = f16c(b + 108);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b), four = _mm256_set1_epi8(4);
    for (int h = 0; h < 2; h++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * h));
        for (int j = 0; j < 4; j++) {
            /* bit k = 4h + j of each byte of hm moved to its bit 2 by one 16-bit shift (a byte's bit k lands on its own
             * bit 2, the neighbour byte's bits elsewhere), then masked: 4 or 0. A set1 mask per bit and a compare
             * instead kept 8 constants live, which gcc spilled and rebuilt each block: [2048 x 512] at T=1, one
             * plane, 101.8 -> 82.8 us on an AVX2-only EPYC (benchmarks/results/lowbit/kernels-amd-avx2-q3k.txt) */
            const int k = 4 * h + j;
            __m256i hk = k >= 2 ? _mm256_srli_epi16(hm, k - 2) : _mm256_slli_epi16(hm, 2 - k);
            __m256i c = _mm256_or_si256(crumb(q, j), _mm256_and_si256(hk, four));
            CHUNK(c, c, 0, pick16(h ? sb : sa, 2 * j, 2 * j + 1), 4 * h + j);
        }
    }
}

AVX2_INLINE void blk_tq2_0(BLK_ARGS) {  /* codes t (0..3), scale 1, M factor 1 (the -1 offset) */
    const __m256i one = _mm256_set1_epi16(1);
    f->mf = _mm_set1_epi8(1);
    f->dw = f->dm = f16c(b + 64);
    for (int h = 0; h < 2; h++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 * h));
        for (int j = 0; j < 4; j++) {
            __m256i c = crumb(q, j);
            CHUNK(c, c, 0, one, 4 * h + j);
        }
    }
}

/* TQ1_0's digits: digit j of byte x is floor(3 m / 256) with m = x * 3^j mod 256 (m tripled by byte adds, which
 * wrap mod 256), i.e. [m >= 86] + [m >= 171] */
AVX2_INLINE __m256i triple(__m256i v) { return _mm256_add_epi8(_mm256_add_epi8(v, v), v); }
AVX2_INLINE __m256i tq1_digit(__m256i m) {
    const __m256i one = _mm256_set1_epi8(1);
    return _mm256_add_epi8(_mm256_min_epu8(_mm256_subs_epu8(m, _mm256_set1_epi8(85)), one),
                           _mm256_min_epu8(_mm256_subs_epu8(m, _mm256_set1_epi8((char)170)), one));
}

AVX2_INLINE void blk_tq1_0(BLK_ARGS) {  /* codes t (0..2), scale 1, M factor 1; lowbit_unpack's value order */
    const __m256i one = _mm256_set1_epi16(1);
    f->mf = _mm_set1_epi8(1);
    f->dw = f->dm = f16c(b + 52);
    __m256i m = _mm256_loadu_si256((const __m256i *)b);  /* values 32j + l: digit j of qs[l] */
    for (int j = 0; j < 5; j++, m = triple(m)) {
        __m256i c = tq1_digit(m);
        CHUNK(c, c, 0, one, j);
    }
    /* values 160 + 16j + l: digit j of q2[l] (q2 = qs[32..47] in both halves: digits 0 | 1, 2 | 3, 4 | ...); values
     * 240 + 4j + l: digit j of qh[l], the high half of chunk 7 (its dword j holds qh at power 3^j) */
    const __m256i q1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(b + 32)));
    const __m256i q3 = triple(q1), q9 = triple(q3), q27 = triple(q9), q81 = triple(q27);
    const __m256i h1 = _mm256_set1_epi32((int)rd32(b + 48)), h3 = triple(h1), h9 = triple(h3), h27 = triple(h9);
    __m256i c = tq1_digit(_mm256_blend_epi32(q1, q3, 0xF0));
    CHUNK(c, c, 0, one, 5);
    c = tq1_digit(_mm256_blend_epi32(q9, q27, 0xF0));
    CHUNK(c, c, 0, one, 6);
    __m256i m7 = _mm256_blend_epi32(_mm256_blend_epi32(q81, h1, 0x10), _mm256_blend_epi32(h3, h9, 0x40), 0x60);
    c = tq1_digit(_mm256_blend_epi32(m7, h27, 0x80));
    CHUNK(c, c, 0, one, 7);
}

AVX2_INLINE void blk_iq4_xs(BLK_ARGS) {  /* codes kvalues[q] (signed), scale s - 32 per 32 values */
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)LB_IQ4NL));
    const uint16_t sh = rd16(b + 2);
    f->dw = f16c(b);
#pragma GCC unroll 8  /* as q8_iq.h's block functions */
    for (int ib = 0; ib < 8; ib++) {
        __m256i w = _mm256_shuffle_epi8(tab, nibbles32(b + 8 + 16 * ib));
        int s = (((b[4 + ib / 2] >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4)) - 32;
        CHUNK(_mm256_abs_epi8(w), w, 1, _mm256_set1_epi16((short)s), ib);
    }
}

#include "q8_iq.h"

/* block b of a super-block type against R x rows (x's super-block at xs + r * rb), its terms into lane[r] */
AVX2_INLINE void sb_block(const int fmt, const uint8_t *blk, const uint8_t *xs, int64_t rb, const int P, const int R,
                          __m256 *lane) {
    __m256i ahi[4], alo[4];
    for (int r = 0; r < R; r++) ahi[r] = alo[r] = _mm256_setzero_si256();
    lowf f;
    switch (fmt) {
    case Q2_K: blk_q2_k(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case Q3_K: blk_q3_k(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case TQ1_0: blk_tq1_0(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case TQ2_0: blk_tq2_0(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ4_XS: blk_iq4_xs(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ2_XXS: blk_iq2_xxs(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ2_XS: blk_iq2_xs(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ2_S: blk_iq2_s(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ3_XXS: blk_iq3_xxs(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ3_S: blk_iq3_s(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ1_S: blk_iq1_s(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    case IQ1_M: blk_iq1_m(blk, xs, rb, R, P, ahi, alo, &f, NULL); break;
    }
    /* the M factors as the header pairs them: int16 in packs_epi32's order (one plane), int32 by group (two) */
    __m256i m16 = _mm256_setzero_si256(), m0 = m16, m1 = m16;
    if (has_m(fmt) && P == 1) m16 = _mm256_permute4x64_epi64(_mm256_cvtepi8_epi16(f.mf), 0xD8);
    if (has_m(fmt) && P == 2) {
        m0 = _mm256_cvtepi8_epi32(f.mf);
        m1 = _mm256_cvtepi8_epi32(_mm_srli_si128(f.mf, 8));
    }
    for (int r = 0; r < R; r++) {
        const uint8_t *x = xs + r * rb;
        float dx = rdf32(x);
        __m256 hi = _mm256_cvtepi32_ps(ahi[r]);
        __m256 v = P == 2 ? _mm256_add_ps(_mm256_mul_ps(hi, _mm256_set1_ps(256.0f)), _mm256_cvtepi32_ps(alo[r])) : hi;
        v = _mm256_fmadd_ps(_mm256_set1_ps(f.dw * dx), v, lane[r]);
        if (has_m(fmt)) {
            __m256i bs0 = _mm256_loadu_si256((const __m256i *)(x + 4)), bs1 = _mm256_loadu_si256((const __m256i *)(x + 36));
            /* one plane: x's sums are int16 (|16 codes| <= 2,032), so one madd; two: int32 products, pairs added */
            __m256i M = P == 1 ? _mm256_madd_epi16(m16, _mm256_packs_epi32(bs0, bs1))
                               : _mm256_hadd_epi32(_mm256_mullo_epi32(m0, bs0), _mm256_mullo_epi32(m1, bs1));
            v = _mm256_fnmadd_ps(_mm256_set1_ps(f.dm * dx), _mm256_cvtepi32_ps(M), v);
        }
        lane[r] = v;
    }
}

/* one weight row of a super-block type against R x rows: the header's arithmetic, even blocks into l0 and odd ones
 * into l1 as two named sets (an indexed pair went through memory: q8.c's dot32_avx2) */
AVX2_INLINE void dotsb_low(const int fmt, const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, const int P,
                           const int R, float *y, int64_t ldy) {
    __m256 l0[4], l1[4];
    for (int r = 0; r < R; r++) l0[r] = l1[r] = _mm256_setzero_ps();
    const int bb = lowbit_block_bytes(fmt), xb = SB_BYTES(P);
    int64_t b = 0, nb = K / 256;
    for (; b + 2 <= nb; b += 2) {
        sb_block(fmt, row + b * bb, xq + b * xb, rb, P, R, l0);
        sb_block(fmt, row + (b + 1) * bb, xq + (b + 1) * xb, rb, P, R, l1);
    }
    if (b < nb) sb_block(fmt, row + b * bb, xq + b * xb, rb, P, R, l0);
    for (int r = 0; r < R; r++) y[r * ldy] = finish(l0[r], l1[r], 0.0f);
}

/* block b of IQ4_NL / MXFP4 against R x rows (x's 32-value block at xb + r * rb): codes looked up from the nibbles,
 * signed */
AVX2_INLINE void b32_block(const int fmt, const uint8_t *blk, const uint8_t *xb, int64_t rb, const int P, const int R,
                           __m256 *lane) {
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(fmt == IQ4_NL ? LB_IQ4NL
                                                                                                     : LB_FP4X2)));
    const __m256i w = _mm256_shuffle_epi8(tab, nibbles32(blk + (fmt == IQ4_NL ? 2 : 1)));
    const float dw = fmt == IQ4_NL ? f16c(blk) : e8m0_half(blk[0]);
    for (int r = 0; r < R; r++) {
        const uint8_t *x = xb + r * rb;
        lane[r] = _mm256_add_ps(lane[r], lanes_avx2(w, x, _mm256_set1_epi16(1), dw * rdf32(x), 1, P));
    }
}

AVX2_INLINE void dot32_low(const int fmt, const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, const int P,
                           const int R, float *y, int64_t ldy) {
    __m256 l0[4], l1[4];
    for (int r = 0; r < R; r++) l0[r] = l1[r] = _mm256_setzero_ps();
    const int bb = lowbit_block_bytes(fmt), xb = XB(P);
    int64_t b = 0, nb = K / 32;
    for (; b + 2 <= nb; b += 2) {
        b32_block(fmt, row + b * bb, xq + b * xb, rb, P, R, l0);
        b32_block(fmt, row + (b + 1) * bb, xq + (b + 1) * xb, rb, P, R, l1);
    }
    if (b < nb) b32_block(fmt, row + b * bb, xq + b * xb, rb, P, R, l0);
    for (int r = 0; r < R; r++) y[r * ldy] = finish(l0[r], l1[r], 0.0f);
}

/* lowbit_apply's operations, 8 values a vector */
AVX2_INLINE void apply_avx2(const int fmt, const lowblk *u, float *o) {
    for (int g = 0; g < lowbit_block_values(fmt) / 16; g++) {
        float bias;
        int off;
        const __m256 s = _mm256_set1_ps(lowbit_group_scale(fmt, u, g, &bias, &off));
        for (int h = 0; h < 2; h++) {
            __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(u->c + 16 * g + 8 * h)));
            __m256 v = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(off))));
            _mm256_storeu_ps(o + 16 * g + 8 * h, fmt == Q2_K ? _mm256_add_ps(v, _mm256_set1_ps(bias)) : v);
        }
    }
}

/* a row of a low-bit type's exact weights: lowbit_scales' fields, the codes the block functions above unpack
 * (lowbit_codes' bytes), lowbit_apply's operations: bitwise lowbit_deq_row (kernels.c's AVX2 path: the float row
 * kernel and a prompt's bf16 GEMM operand; timed in benchmarks/results/lowbit/kernels.txt) */
AVX2_INLINE void deq_avx2(const int fmt, const uint8_t *row, int64_t K, float *o) {
    const int bb = lowbit_block_bytes(fmt), n = lowbit_block_values(fmt);
    lowblk u;
    lowf f;
    for (int64_t b = 0; b < K / n; b++, o += n) {
        const uint8_t *blk = row + b * bb;
        lowbit_scales(fmt, blk, &u);
        switch (fmt) {
#define DEQ(F, fn) case F: fn(blk, NULL, 0, 0, 1, NULL, NULL, &f, u.c); break;
        DEQ(Q2_K, blk_q2_k) DEQ(Q3_K, blk_q3_k) DEQ(TQ1_0, blk_tq1_0) DEQ(TQ2_0, blk_tq2_0) DEQ(IQ4_XS, blk_iq4_xs)
        DEQ(IQ2_XXS, blk_iq2_xxs) DEQ(IQ2_XS, blk_iq2_xs) DEQ(IQ2_S, blk_iq2_s) DEQ(IQ3_XXS, blk_iq3_xxs)
        DEQ(IQ3_S, blk_iq3_s) DEQ(IQ1_S, blk_iq1_s) DEQ(IQ1_M, blk_iq1_m)
#undef DEQ
        case IQ4_NL: {
            const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)LB_IQ4NL));
            _mm256_storeu_si256((__m256i *)u.c, _mm256_shuffle_epi8(tab, nibbles32(blk + 2)));
            break;
        }
        }
        apply_avx2(fmt, &u, o);
    }
}

AVX2 void lowbit_deq_row_avx2(int fmt, const uint8_t *row, int64_t K, float *o) {
    switch (fmt) {  /* one body per format */
#define DEQ_ROW(F) case F: deq_avx2(F, row, K, o); return;
    DEQ_ROW(Q2_K) DEQ_ROW(Q3_K) DEQ_ROW(TQ1_0) DEQ_ROW(TQ2_0) DEQ_ROW(IQ4_NL) DEQ_ROW(IQ4_XS) DEQ_ROW(IQ2_XXS)
    DEQ_ROW(IQ2_XS) DEQ_ROW(IQ2_S) DEQ_ROW(IQ3_XXS) DEQ_ROW(IQ3_S) DEQ_ROW(IQ1_S) DEQ_ROW(IQ1_M)
#undef DEQ_ROW
    }
}

/* one function per format, planes and x-row count, every test above folded away */
#define LOW_PR(F, KIND, P, R)                                                                                          \
    AVX2 static void low_##F##_##P##_##R(const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, float *y,      \
                                         int64_t ldy) {                                                              \
        KIND(F, row, xq, rb, K, P, R, y, ldy);                                                                         \
    }
/* its rows_fn (q8.h: the R = 1 kernel in the row loop) */
#define LOW_ROWS(F, KIND, P)                                                                                           \
    AVX2 static void lowrows_##F##_##P(const uint8_t *q, int64_t row_bytes, const uint8_t *xq, int64_t K, float *y,    \
                                       int64_t n0, int64_t n1, int64_t pf) {                                           \
        ROWS_BODY(KIND(F, row, xq, 0, K, P, 1, y + n, 1))                                                              \
    }
#define LOW_FMT(F, KIND)                                                                                               \
    LOW_PR(F, KIND, 1, 1) LOW_PR(F, KIND, 1, 2) LOW_PR(F, KIND, 1, 3) LOW_PR(F, KIND, 1, 4)                            \
    LOW_PR(F, KIND, 2, 1) LOW_PR(F, KIND, 2, 2) LOW_PR(F, KIND, 2, 3) LOW_PR(F, KIND, 2, 4)                            \
    LOW_ROWS(F, KIND, 1) LOW_ROWS(F, KIND, 2)
LOW_FMT(MXFP4, dot32_low)
LOW_FMT(IQ4_NL, dot32_low)
LOW_FMT(Q2_K, dotsb_low)
LOW_FMT(Q3_K, dotsb_low)
LOW_FMT(TQ1_0, dotsb_low)
LOW_FMT(TQ2_0, dotsb_low)
LOW_FMT(IQ4_XS, dotsb_low)
LOW_FMT(IQ2_XXS, dotsb_low)
LOW_FMT(IQ2_XS, dotsb_low)
LOW_FMT(IQ2_S, dotsb_low)
LOW_FMT(IQ3_XXS, dotsb_low)
LOW_FMT(IQ3_S, dotsb_low)
LOW_FMT(IQ1_S, dotsb_low)
LOW_FMT(IQ1_M, dotsb_low)

#define LOW_ROW(F) [F] = {{low_##F##_1_1, low_##F##_1_2, low_##F##_1_3, low_##F##_1_4},                             \
                          {low_##F##_2_1, low_##F##_2_2, low_##F##_2_3, low_##F##_2_4}}

#define LOW_ROWS_ROW(F) [F] = {lowrows_##F##_1, lowrows_##F##_2}

rows_fn low_q8_rows_avx2(int fmt, int XF) {
    static const rows_fn all[N_FORMATS][2] = {
        LOW_ROWS_ROW(MXFP4), LOW_ROWS_ROW(IQ4_NL), LOW_ROWS_ROW(Q2_K), LOW_ROWS_ROW(Q3_K), LOW_ROWS_ROW(TQ1_0),
        LOW_ROWS_ROW(TQ2_0), LOW_ROWS_ROW(IQ4_XS), LOW_ROWS_ROW(IQ2_XXS), LOW_ROWS_ROW(IQ2_XS), LOW_ROWS_ROW(IQ2_S),
        LOW_ROWS_ROW(IQ3_XXS), LOW_ROWS_ROW(IQ3_S), LOW_ROWS_ROW(IQ1_S), LOW_ROWS_ROW(IQ1_M)};
    return all[fmt][(XF >= 3 ? sb_planes(XF) : XF) - 1];
}

/* the kernel of fmt for the layout XF its rows read (xf_for in q8.c: its planes in either layout) and R x rows */
dot_fn low_q8_dot_avx2(int fmt, int XF, int R) {
    static const dot_fn all[N_FORMATS][2][4] = {
        LOW_ROW(MXFP4), LOW_ROW(IQ4_NL), LOW_ROW(Q2_K), LOW_ROW(Q3_K), LOW_ROW(TQ1_0), LOW_ROW(TQ2_0),
        LOW_ROW(IQ4_XS), LOW_ROW(IQ2_XXS), LOW_ROW(IQ2_XS), LOW_ROW(IQ2_S), LOW_ROW(IQ3_XXS), LOW_ROW(IQ3_S),
        LOW_ROW(IQ1_S), LOW_ROW(IQ1_M)};
    return all[fmt][(XF >= 3 ? sb_planes(XF) : XF) - 1][R - 1];
}
#endif
