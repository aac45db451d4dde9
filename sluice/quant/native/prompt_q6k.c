/* prompt.c's tiles for Q6_K (a Q4_K_M file's other type: half its layers' expert downs, some attention v, the head),
 * on AVX2 and in portable C, the same bits. Weights: value = d * sc_g * (q - 32) per 16-value group g (q 6-bit, sc_g
 * int8). Per super-block b of row n and token t, with w = q - 32 and the token's codes hi (and lo: two planes):
 *   I = sum_g sc_g * sum_{i in g} w_i * hi_i          (integers, exact: |I| < 2^27)
 *   acc = fma((float)I, d * D_t, acc);   two planes: acc = fma((float)I_lo, d * (D_t / 256), acc)
 * The AVX2 tiles multiply with _mm256_maddubs_epi16, whose first operand is unsigned: the codes biased to
 * u = code + 128 (0..255) against the signed w (-32..31): a pair is at most 2 * 32 * 255 = 16320, two pairs 32640 <
 * 32767, so each 4-value pair sum is exact in int16, and sum w * u = sum w * code + 128 * sum w; the tile keeps the
 * second term per row (B = 128 * sum_g sc_g * sum_g w), subtracted in int32: the same I, so the same bits.
 *
 * Tile of 16 rows, per super-block: codes w as int8 [16 groups][4 value quads v][2 halves][8 rows][4], the scales
 * as int16 pairs (sc_g, sc_g) [16][16 rows], B int32 [16 rows], d float [16 rows]. Packed once per call and task,
 * used for every token, 4 tokens a pass (as prompt_avx2.c). */
#include "prompt.h"

#define Q6_CODES 4096
#define Q6_TILE (Q6_CODES + 1024 + 64 + 64)
#define NT_MAX 4

int64_t sluice_prompt_q6k_tile_bytes(int64_t nsb) { return nsb * Q6_TILE; }

/* row r (< rows) of the tile from its stored bytes; rows past N are zeros */
static void pack_q6k(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile) {
    memset(tile, 0, (size_t)(nsb * Q6_TILE));
    for (int r = 0; r < TILE_ROWS && n0 + r < N; r++)
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *blk = w + (n0 + r) * row_bytes + 210 * b, *ql = blk, *qh = blk + 128;
            uint8_t *t = tile + b * Q6_TILE;
            int8_t q[256];
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 4; k++)
                    for (int l = 0; l < 32; l++) {
                        int lo = ql[64 * h + 32 * (k & 1) + l];
                        q[128 * h + 32 * k + l] = (int8_t)(((k < 2 ? lo & 15 : lo >> 4)
                                                            | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)) - 32);
                    }
            int16_t *sc = (int16_t *)(t + Q6_CODES);
            int32_t bias = 0;
            for (int g = 0; g < 16; g++) {
                int sum = 0;
                for (int v = 0; v < 4; v++)
                    for (int i = 0; i < 4; i++) {
                        int8_t c = q[16 * g + 4 * v + i];
                        t[256 * g + 64 * v + 32 * (r / 8) + 4 * (r % 8) + i] = (uint8_t)c;
                        sum += c;
                    }
                int s = (int8_t)blk[192 + g];
                sc[32 * g + 2 * r] = sc[32 * g + 2 * r + 1] = (int16_t)s;
                bias += s * sum;
            }
            ((int32_t *)(t + Q6_CODES + 1024))[r] = 128 * bias;
            ((float *)(t + Q6_CODES + 1024 + 64))[r] = rdf16(blk + 208);
        }
}

/* the code of row r's value 16g + 4v + i in the tile */
static inline int8_t q6_at(const uint8_t *t, int g, int v, int r, int i) {
    return (int8_t)t[256 * g + 64 * v + 32 * (r / 8) + 4 * (r % 8) + i];
}

static void tile_q6k_scalar(const uint8_t *tile, int64_t nsb, const xq_t *x, int rows, float *y, int64_t ldy) {
    for (int64_t t = 0; t < x->T; t++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nsb; b++) {
                const uint8_t *tb = tile + b * Q6_TILE;
                const int8_t *xc = x->c + t * x->K + 256 * b, *xl = x->lo ? x->lo + t * x->K + 256 * b : NULL;
                const int16_t *sc = (const int16_t *)(tb + Q6_CODES);
                int32_t isum = 0, isl = 0;
                for (int g = 0; g < 16; g++) {
                    int32_t s = 0, l = 0;
                    for (int v = 0; v < 4; v++)
                        for (int i = 0; i < 4; i++) {
                            int c = q6_at(tb, g, v, r, i), a = 16 * g + 4 * v + i;
                            s += c * xc[a];
                            if (xl) l += c * xl[a];
                        }
                    isum += sc[32 * g + 2 * r] * s;
                    isl += sc[32 * g + 2 * r] * l;
                }
                float d = ((const float *)(tb + Q6_CODES + 1024 + 64))[r], dx = x->d[t * (x->K / 256) + b];
                acc = fmaf((float)isum, d * dx, acc);
                if (xl) acc = fmaf((float)isl, d * (dx * (1.0f / 256.0f)), acc);
            }
            y[t * ldy + r] = acc;
        }
}

#if SLUICE_X86
/* 8 rows' int32 sums sc_g * sum w * u over group g for one token's biased codes u (16 of them at u) */
AVX2_INLINE __m256i group_q6(const uint8_t *w, __m256i sc, const uint8_t *u) {
    __m256i a = _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi32((int)rd32(u)), _mm256_loadu_si256((const __m256i *)w)),
        _mm256_maddubs_epi16(_mm256_set1_epi32((int)rd32(u + 4)), _mm256_loadu_si256((const __m256i *)(w + 64))));
    __m256i c = _mm256_add_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi32((int)rd32(u + 8)), _mm256_loadu_si256((const __m256i *)(w + 128))),
        _mm256_maddubs_epi16(_mm256_set1_epi32((int)rd32(u + 12)), _mm256_loadu_si256((const __m256i *)(w + 192))));
    return _mm256_add_epi32(_mm256_madd_epi16(a, sc), _mm256_madd_epi16(c, sc));
}

/* tokens t0 .. t0 + NT of rows 8h .. 8h + 7 (nrows valid); NT, P constants at each call */
AVX2_INLINE void q6_half_n(const uint8_t *tile, int64_t nsb, const xq_t *x, int64_t t0, const int NT, const int P,
                           int h, int nrows, float *y, int64_t ldy) {
    const int64_t K = x->K;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[NT_MAX];
    uint8_t xu[NT_MAX][256], xlu[NT_MAX][256];  /* this super-block's codes + 128 */
    for (int t = 0; t < NT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *tb = tile + b * Q6_TILE;
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 256; k += 32) {
                const int8_t *c = x->c + (t0 + t) * K + 256 * b + k;
                _mm256_storeu_si256((__m256i *)(xu[t] + k),
                                    _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)c), flip));
                if (P == 2)
                    _mm256_storeu_si256((__m256i *)(xlu[t] + k), _mm256_xor_si256(
                                            _mm256_loadu_si256((const __m256i *)(c - x->c + x->lo)), flip));
            }
        __m256i is[NT_MAX], il[NT_MAX];
        for (int t = 0; t < NT; t++) is[t] = il[t] = _mm256_setzero_si256();
        for (int g = 0; g < 16; g++) {
            const uint8_t *w = tb + 256 * g + 32 * h;
            __m256i sc = _mm256_loadu_si256((const __m256i *)(tb + Q6_CODES + 64 * g + 32 * h));
            for (int t = 0; t < NT; t++) {
                is[t] = _mm256_add_epi32(is[t], group_q6(w, sc, xu[t] + 16 * g));
                if (P == 2) il[t] = _mm256_add_epi32(il[t], group_q6(w, sc, xlu[t] + 16 * g));
            }
        }
        __m256i bias = _mm256_loadu_si256((const __m256i *)(tb + Q6_CODES + 1024 + 32 * h));
        __m256 d = _mm256_loadu_ps((const float *)(tb + Q6_CODES + 1024 + 64) + 8 * h);
        for (int t = 0; t < NT; t++) {
            float dxs = x->d[(t0 + t) * (K / 256) + b];
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(is[t], bias)),
                                     _mm256_mul_ps(d, _mm256_set1_ps(dxs)), acc[t]);
            if (P == 2)
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(il[t], bias)),
                                         _mm256_mul_ps(d, _mm256_set1_ps(dxs * (1.0f / 256.0f))), acc[t]);
        }
    }
    if (nrows >= 8) {
        for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + t * ldy + 8 * h, acc[t]);
    } else {
        __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nrows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int t = 0; t < NT; t++) _mm256_maskstore_ps(y + t * ldy + 8 * h, keep, acc[t]);
    }
}

AVX2_INLINE void q6_half_all(const uint8_t *tile, int64_t nsb, const xq_t *x, const int P, int h, int nrows,
                             float *y, int64_t ldy) {
    int64_t t = 0, T = x->T;
    for (; t + NT_MAX <= T; t += NT_MAX) q6_half_n(tile, nsb, x, t, NT_MAX, P, h, nrows, y + t * ldy, ldy);
    float *yt = y + t * ldy;
    switch (T - t) {
        case 3: q6_half_n(tile, nsb, x, t, 3, P, h, nrows, yt, ldy); break;
        case 2: q6_half_n(tile, nsb, x, t, 2, P, h, nrows, yt, ldy); break;
        case 1: q6_half_n(tile, nsb, x, t, 1, P, h, nrows, yt, ldy); break;
        default: break;
    }
}

AVX2 static void tile_q6k_avx2(const uint8_t *tile, int64_t nsb, const xq_t *x, int rows, float *y, int64_t ldy) {
    for (int h = 0; h < 2 && 8 * h < rows; h++) {
        if (x->lo) q6_half_all(tile, nsb, x, 2, h, rows - 8 * h, y, ldy);
        else q6_half_all(tile, nsb, x, 1, h, rows - 8 * h, y, ldy);
    }
}
#endif

void sluice_prompt_q6k_tile(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile,
                            const xq_t *x, int rows, float *y, int64_t ldy, int avx2) {
    pack_q6k(w, row_bytes, N, nsb, n0, tile);
#if SLUICE_X86
    if (avx2) {
        tile_q6k_avx2(tile, nsb, x, rows, y, ldy);
        return;
    }
#endif
    (void)avx2;
    tile_q6k_scalar(tile, nsb, x, rows, y, ldy);
}
