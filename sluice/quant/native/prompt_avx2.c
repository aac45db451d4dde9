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

#define NT_MAX 4  /* tokens per pass: 4 x (int16 sums of 1-2 planes) + the weights fit the 16 ymm registers */

/* y for tokens t0 .. t0 + NT of rows 8h .. 8h + 7 of the tile (nrows of them valid); P planes; NT, P constants at
 * each call */
AVX2_INLINE void half_n(const uint8_t *tile, int64_t nsb, const xq_t *x, int64_t t0, const int NT, const int P,
                        int h, int nrows, float *y, int64_t ldy) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int64_t K = x->K;
    __m256 acc[NT_MAX];
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *tb = tile + b * SB_TILE + 32 * h;
        const int8_t *xc = x->c + t0 * K + 256 * b, *xl = P == 2 ? x->lo + t0 * K + 256 * b : NULL;
        __m256i is[NT_MAX], il[NT_MAX];
        for (int t = 0; t < NT; t++) is[t] = il[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i s16[NT_MAX], l16[NT_MAX];
            for (int t = 0; t < NT; t++) s16[t] = l16[t] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                __m256i u = _mm256_loadu_si256((const __m256i *)(tb + 256 * j + 64 * v));
                __m256i lo = _mm256_and_si256(u, m4), hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), m4);
                for (int t = 0; t < NT; t++) {
                    const int8_t *p = xc + t * K + 32 * j + 4 * v;
                    s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32((int)rd32(p))));
                    s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32((int)rd32(p + 16))));
                    if (P == 2) {
                        const int8_t *q = xl + t * K + 32 * j + 4 * v;
                        l16[t] = _mm256_add_epi16(l16[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32((int)rd32(q))));
                        l16[t] = _mm256_add_epi16(l16[t],
                                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32((int)rd32(q + 16))));
                    }
                }
            }
            __m256i sc = _mm256_loadu_si256((const __m256i *)(tb + SB_CODES + 64 * j));  /* int32, < 64 */
            sc = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));                         /* in both int16 halves */
            for (int t = 0; t < NT; t++) {
                is[t] = _mm256_add_epi32(is[t], _mm256_madd_epi16(s16[t], sc));
                if (P == 2) il[t] = _mm256_add_epi32(il[t], _mm256_madd_epi16(l16[t], sc));
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
                if (P == 2)
                    ml = _mm256_add_epi32(ml, _mm256_madd_epi16(m16, _mm256_set1_epi32(
                                                                     (int)rd32(x->sl + (t0 + t) * (K / 32) + 8 * b + 2 * p))));
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

/* every token of x, NT_MAX at a time, for one half of the tile at P planes */
AVX2_INLINE void half_all(const uint8_t *tile, int64_t nsb, const xq_t *x, const int P, int h, int nrows, float *y,
                          int64_t ldy) {
    int64_t t = 0, T = x->T;
    for (; t + NT_MAX <= T; t += NT_MAX) half_n(tile, nsb, x, t, NT_MAX, P, h, nrows, y + t * ldy, ldy);
    switch (T - t) {
        case 3: half_n(tile, nsb, x, t, 3, P, h, nrows, y + t * ldy, ldy); break;
        case 2: half_n(tile, nsb, x, t, 2, P, h, nrows, y + t * ldy, ldy); break;
        case 1: half_n(tile, nsb, x, t, 1, P, h, nrows, y + t * ldy, ldy); break;
        default: break;
    }
}

AVX2 void sluice_prompt_tile_avx2(const uint8_t *tile, int64_t nsb, const xq_t *x, int rows, float *y, int64_t ldy) {
    for (int h = 0; h < 2 && 8 * h < rows; h++) {
        int nrows = rows - 8 * h;
        if (x->lo) half_all(tile, nsb, x, 2, h, nrows, y, ldy);
        else half_all(tile, nsb, x, 1, h, nrows, y, ldy);
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
