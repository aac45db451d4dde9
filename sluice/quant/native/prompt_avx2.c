/* prompt.c's Q4_K tiles on AVX2 (no AVX512-VNNI: the AVX2-only CPUs, and --isa avx2): the packed 16-row tile as
 * two halves of 8 rows, each 32-byte half-vector holding 8 rows x 4 codes. Per token and sub-block j of 32 values,
 * _mm256_maddubs_epi16 multiplies the unsigned 4-bit codes by the token's signed 8-bit codes (broadcast, 4 at a
 * time) and adds pairs into int16 lanes: a pair is at most 2 * 15 * 127 = 3810 and the 8 products a lane sums over a
 * sub-block at most 16 * 15 * 127 = 30480 < 32767, so the int16 sums are exact. _mm256_madd_epi16 against the
 * sub-block scale (in both int16 halves of each row's lane) gives sc_j * S1_j in int32. With two planes (activations
 * int16: x ~ D * (hi + lo / 256)) the lo plane runs the same way into its own sums. The float operations per
 * super-block are tile_scalar's in its order, so this path and the portable one give the same bits.
 * Tokens run NT at a time so each weight vector is loaded and unpacked once for NT tokens. */
#include "prompt.h"

#if SLUICE_X86

/* tokens per pass: each weight vector loaded once per pass. 4 against 2, 6 and 8, ms of a [256 x 1024] @ [1024 x
 * 512] / [256 x 512] @ [512 x 1024] Q4_K projection at int16 (`knobs.py tiles`, below): 4 1.57 / 1.39, 2 1.71 /
 * 1.56, 6 1.69 / 1.49, 8 1.66 / 1.51 (int8: 0.91 / 0.78 at 4, 1.02 / 0.89 at 8) */
#define NT_MAX 4
/* ... at one plane (int8: fewer registers a token): `prompt_tile.py 256`, one / two threads, 4 tokens 109.5 / 206.0
 * GMAC/s, 5 117.0 / 215.1, 6 116.2 / 210.9, 8 98.7 / 173.2 (the AVX2 prompt of the peers Q4_K_M 4.02-4.06 -> 3.95-4.07
 * s, `breakdown.py prompt --isa avx2`: benchmarks/results/quantized/breakdown/prompt-avx2-4.txt). At most 8 (the
 * arrays below, the remainder's cases) */
#define NT_ONE 5

/* the tile's packed codes (two 4-bit codes a byte) -> one code a byte at wide: per super-block, sub-block j and half
 * h, 8 vectors (value group v: codes 4v .. +3, then 16 + 4v .. +3 of each of the 8 rows), so the kernel's inner loop
 * multiplies straight from memory */
AVX2_INLINE void widen(const uint8_t *tile, int64_t nsb, uint8_t *wide) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nsb; b++)
        for (int j = 0; j < 8; j++)
            for (int h = 0; h < 2; h++)
                for (int v = 0; v < 4; v++) {
                    __m256i u = _mm256_loadu_si256((const __m256i *)(tile + b * SB_TILE + 256 * j + 64 * v + 32 * h));
                    uint8_t *o = wide + b * SB_WIDE + 512 * j + 256 * h + 64 * v;
                    _mm256_storeu_si256((__m256i *)o, _mm256_and_si256(u, m4));
                    _mm256_storeu_si256((__m256i *)(o + 32), _mm256_and_si256(_mm256_srli_epi16(u, 4), m4));
                }
}

/* value group v of one sub-block: the 8 rows' int16 sums of codes 4v .. +3 and 16 + 4v .. +3 times the token's */
AVX2_INLINE __m256i group2(const uint8_t *w, const int8_t *p, int v) {
    return _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(w + 64 * v)), _mm256_set1_epi32((int)rd32(p + 4 * v))),
        _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(w + 64 * v + 32)),
                             _mm256_set1_epi32((int)rd32(p + 16 + 4 * v))));
}

/* sc_j * S1_j of one sub-block for the 8 rows (int32) and one token's 32 codes p (weights w: 8 vectors). 4-bit
 * codes: the 16 products a lane sums are at most 30480, one int16 sum; 5-bit (Q5_K): a pair is at most 2 * 31 * 127
 * = 7874, so two int16 sums of 8 products (31496 at most), each multiplied by the scale */
AVX2_INLINE __m256i sub32(const uint8_t *w, const int8_t *p, __m256i sc, const int five) {
    __m256i a = _mm256_add_epi16(group2(w, p, 0), group2(w, p, 1)), c = _mm256_add_epi16(group2(w, p, 2),
                                                                                          group2(w, p, 3));
    if (!five) return _mm256_madd_epi16(_mm256_add_epi16(a, c), sc);
    return _mm256_add_epi32(_mm256_madd_epi16(a, sc), _mm256_madd_epi16(c, sc));
}

/* y for tokens t0 .. t0 + NT of rows 8h .. 8h + 7 of the tile (nrows of them valid); P planes; NT, P constants at
 * each call */
AVX2_INLINE void half_n(const uint8_t *tile, const uint8_t *wide, int64_t nsb, const xq_t *x, int64_t t0,
                        const int NT, const int P, const int five, int h, int nrows, float *y, int64_t ldy) {
    const int64_t K = x->K;
    __m256 acc[8];  /* NT <= 8 */
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *tb = tile + b * SB_TILE + 32 * h;
        const int8_t *xc = x->c + t0 * K + 256 * b, *xl = P == 2 ? x->lo + t0 * K + 256 * b : NULL;
        __m256i is[8], il[8];
        for (int t = 0; t < NT; t++) is[t] = il[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const uint8_t *w = wide + b * SB_WIDE + 512 * j + 256 * h;
            __m256i sc = _mm256_loadu_si256((const __m256i *)(tb + SB_CODES + 64 * j));  /* int32, < 64 */
            sc = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));                         /* in both int16 halves */
            for (int t = 0; t < NT; t++) {
                is[t] = _mm256_add_epi32(is[t], sub32(w, xc + t * K + 32 * j, sc, five));
                if (P == 2) il[t] = _mm256_add_epi32(il[t], sub32(w, xl + t * K + 32 * j, sc, five));
            }
        }
        const float *df = (const float *)(tile + b * SB_TILE + SB_CODES + 768);
        __m256 d = _mm256_loadu_ps(df + 8 * h), dmin = _mm256_loadu_ps(df + 16 + 8 * h);
        for (int t = 0; t < NT; t++) {
            const int16_t *s2 = x->s + (t0 + t) * (K / 32) + 8 * b;
            __m256i ms = _mm256_setzero_si256(), ml = _mm256_setzero_si256();
            for (int p = 0; p < 4; p++) {  /* m_2p * S2_2p + m_2p+1 * S2_2p+1 per row, exact in int32 */
                __m256i m16 = _mm256_loadu_si256((const __m256i *)(tb + SB_CODES + 512 + 64 * p));
                ms = _mm256_add_epi32(ms, _mm256_madd_epi16(m16, _mm256_set1_epi32((int)rd32(s2 + 2 * p))));
                if (P == 2) {
                    const int16_t *l2 = x->sl + (t0 + t) * (K / 32) + 8 * b;
                    ml = _mm256_add_epi32(ml, _mm256_madd_epi16(m16, _mm256_set1_epi32((int)rd32(l2 + 2 * p))));
                }
            }
            float dxs = x->d[(t0 + t) * (K / 256) + b];
            __m256 dx = _mm256_set1_ps(dxs);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[t]), _mm256_mul_ps(d, dx), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dmin, dx), acc[t]);
            if (P == 2) {
                __m256 dxl = _mm256_set1_ps(dxs * (1.0f / 256.0f));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il[t]), _mm256_mul_ps(d, dxl), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ml), _mm256_mul_ps(dmin, dxl), acc[t]);
            }
        }
    }
    if (nrows >= 8) {
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + t * ldy + 8 * h, acc[t]);
    } else {
        __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nrows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int t = 0; t < NT; t++) _mm256_maskstore_ps(y + t * ldy + 8 * h, keep, acc[t]);
    }
}

/* tokens t0 .. T of x, NT_MAX (NT_ONE) at a time, for one half of the tile at P planes */
AVX2_INLINE void half_all(const uint8_t *tile, const uint8_t *wide, int64_t nsb, const xq_t *x, int64_t t0, int64_t T,
                          const int P, const int five, int h, int nrows, float *y, int64_t ldy) {
    int64_t t = t0;
    const int NT = P == 1 ? NT_ONE : NT_MAX;
    for (; t + NT <= T; t += NT) half_n(tile, wide, nsb, x, t, NT, P, five, h, nrows, y + t * ldy, ldy);
    float *yt = y + t * ldy;
    switch (T - t) {
        case 7: half_n(tile, wide, nsb, x, t, 7, P, five, h, nrows, yt, ldy); break;
        case 6: half_n(tile, wide, nsb, x, t, 6, P, five, h, nrows, yt, ldy); break;
        case 5: half_n(tile, wide, nsb, x, t, 5, P, five, h, nrows, yt, ldy); break;
        case 4: half_n(tile, wide, nsb, x, t, 4, P, five, h, nrows, yt, ldy); break;
        case 3: half_n(tile, wide, nsb, x, t, 3, P, five, h, nrows, yt, ldy); break;
        case 2: half_n(tile, wide, nsb, x, t, 2, P, five, h, nrows, yt, ldy); break;
        case 1: half_n(tile, wide, nsb, x, t, 1, P, five, h, nrows, yt, ldy); break;
        default: break;
    }
}

AVX2 void sluice_prompt_tile_avx2(const uint8_t *tile, uint8_t *wide, int five, int64_t nsb, const xq_t *x, int rows,
                                  float *y, int64_t ldy) {
    if (!five) widen(tile, nsb, wide);
    /* both halves over a block of tokens before the next block: each block's codes are read from L2 twice, not the
     * whole x from L3 (a 2,048-token x of K = 1024 is 2 MiB) */
    const int64_t TB = token_block(x->K * (x->lo ? 2 : 1));
    for (int64_t t0 = 0; t0 < x->T; t0 += TB) {
        int64_t t1 = t0 + TB < x->T ? t0 + TB : x->T;
        for (int h = 0; h < 2 && 8 * h < rows; h++) {
            int nrows = rows - 8 * h, P = x->lo ? 2 : 1;
            if (P == 2 && five) half_all(tile, wide, nsb, x, t0, t1, 2, 1, h, nrows, y, ldy);
            else if (P == 2) half_all(tile, wide, nsb, x, t0, t1, 2, 0, h, nrows, y, ldy);
            else if (five) half_all(tile, wide, nsb, x, t0, t1, 1, 1, h, nrows, y, ldy);
            else half_all(tile, wide, nsb, x, t0, t1, 1, 0, h, nrows, y, ldy);
        }
    }
}

AVX2 void sluice_prompt_pack_avx2(const uint8_t *w, int64_t row_bytes, int64_t nsb, uint8_t *tile) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i offs = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)row_bytes));
    for (int64_t b = 0; b < nsb; b++) {
        uint8_t *t = tile + b * SB_TILE;
        for (int h = 0; h < 2; h++) {
            const uint8_t *base = w + 8 * h * row_bytes + 144 * b;
            for (int p = 0; p < 4; p++)      /* 64 values: sub-blocks 2p (low nibbles) and 2p + 1 (high) */
                for (int v = 0; v < 4; v++) {  /* 8 rows' values 4v .. +3 and 16 + 4v .. +3 of both sub-blocks */
                    __m256i a = _mm256_i32gather_epi32((const int *)(base + 16 + 32 * p + 4 * v), offs, 1);
                    __m256i c = _mm256_i32gather_epi32((const int *)(base + 16 + 32 * p + 16 + 4 * v), offs, 1);
                    __m256i e = _mm256_or_si256(_mm256_and_si256(a, m4),
                                                _mm256_slli_epi16(_mm256_and_si256(c, m4), 4));
                    __m256i o = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                                _mm256_andnot_si256(m4, c));
                    _mm256_storeu_si256((__m256i *)(t + 256 * (2 * p) + 64 * v + 32 * h), e);
                    _mm256_storeu_si256((__m256i *)(t + 256 * (2 * p + 1) + 64 * v + 32 * h), o);
                }
        }
        for (int r = 0; r < TILE_ROWS; r++) tile_scales(t, r, w + r * row_bytes + 144 * b);
    }
}

AVX2 void sluice_prompt_silu_mul_avx2(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i);
        __m256 e = exp_poly8(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
}
#endif
