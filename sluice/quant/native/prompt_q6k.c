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
 * as int16 pairs (sc_g, sc_g) [16][16 rows], B int32 [16 rows], d float [16 rows]. Packed once per call and task
 * (on AVX2 by pack_q6k_avx2), used for every token, 4 tokens a pass, both halves of the tile on one biasing of each
 * token's codes, tokens in blocks (prompt.h token_block). A [1024 x 512] expert down at one plane, 2 threads, Intel
 * Xeon capped at AVX2, GMAC/s at 256 / 64 tokens: 175 / 125 with the scalar packing and a biasing per half, 192 / 163
 * with pack_q6k_avx2, 203 / 170 biased once (Q4_K's [512 x 1024]: 204-211); 5 or 6 tokens a pass: 190-194, 185
 * (`benchmarks/quantized/prompt_tile.py`, benchmarks/results/quantized/breakdown/prompt-tile-q6k.txt). */
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
/* pack_q6k for a whole tile (rows n0 .. n0 + 15 all in the matrix, w at row n0) on AVX2: the same bytes. Per half of
 * 8 rows, each row's 256 codes are unpacked 32 at a time into qs, then 8 x 8 transposes of their 4-byte quads put
 * quad v of the 8 rows side by side where the tile keeps them (64 * quad + 32 * half). */
AVX2 static void pack_q6k_avx2(const uint8_t *w, int64_t row_bytes, int64_t nsb, uint8_t *tile) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    uint8_t qs[8][256];
    for (int64_t b = 0; b < nsb; b++) {
        uint8_t *t = tile + b * Q6_TILE;
        int16_t *sc = (int16_t *)(t + Q6_CODES);
        for (int hh = 0; hh < 2; hh++) {
            for (int rr = 0; rr < 8; rr++) {
                int r = 8 * hh + rr;
                const uint8_t *blk = w + r * row_bytes + 210 * b, *ql = blk, *qh = blk + 128;
                for (int h = 0; h < 2; h++) {
                    __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                    for (int k = 0; k < 4; k++) {
                        __m256i lo = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (k & 1)));
                        __m256i nib = k < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
                        __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * k)), m3);
                        __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(hi, 4)), off);
                        _mm256_storeu_si256((__m256i *)(qs[rr] + 128 * h + 32 * k), q);
                    }
                }
                __m256i acc = _mm256_setzero_si256();
                for (int g = 0; g < 16; g++) {
                    int16_t s = (int16_t)(int8_t)blk[192 + g];
                    sc[32 * g + 2 * r] = sc[32 * g + 2 * r + 1] = s;
                    __m256i q16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs[rr] + 16 * g)));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(q16, _mm256_set1_epi16(s)));
                }
                int32_t lanes[8], bias = 0;
                _mm256_storeu_si256((__m256i *)lanes, acc);
                for (int l = 0; l < 8; l++) bias += lanes[l];
                ((int32_t *)(t + Q6_CODES + 1024))[r] = 128 * bias;
                ((float *)(t + Q6_CODES + 1024 + 64))[r] = rdf16(blk + 208);
            }
            for (int m = 0; m < 8; m++) {  /* quads 8m .. 8m + 7 of the 8 rows */
                __m256i v[8], u[8];
                for (int rr = 0; rr < 8; rr++) v[rr] = _mm256_loadu_si256((const __m256i *)(qs[rr] + 32 * m));
                for (int p = 0; p < 8; p += 2) {
                    u[p] = _mm256_unpacklo_epi32(v[p], v[p + 1]);
                    u[p + 1] = _mm256_unpackhi_epi32(v[p], v[p + 1]);
                }
                for (int p = 0; p < 8; p += 4) {
                    v[p] = _mm256_unpacklo_epi64(u[p], u[p + 2]);
                    v[p + 1] = _mm256_unpackhi_epi64(u[p], u[p + 2]);
                    v[p + 2] = _mm256_unpacklo_epi64(u[p + 1], u[p + 3]);
                    v[p + 3] = _mm256_unpackhi_epi64(u[p + 1], u[p + 3]);
                }
                for (int e = 0; e < 4; e++) {  /* v[e]: quads e, 4 + e of rows 0-3; v[4 + e]: of rows 4-7 */
                    _mm256_storeu_si256((__m256i *)(t + 64 * (8 * m + e) + 32 * hh),
                                        _mm256_permute2x128_si256(v[e], v[4 + e], 0x20));
                    _mm256_storeu_si256((__m256i *)(t + 64 * (8 * m + 4 + e) + 32 * hh),
                                        _mm256_permute2x128_si256(v[e], v[4 + e], 0x31));
                }
            }
        }
    }
}

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

/* tokens t0 .. t0 + NT of the tile's rows (rows valid, both halves of 8): each super-block's codes biased once for
 * both halves; NT, P constants at each call */
AVX2_INLINE void q6_n(const uint8_t *tile, int64_t nsb, const xq_t *x, int64_t t0, const int NT, const int P,
                      int rows, float *y, int64_t ldy) {
    const int64_t K = x->K;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int halves = rows > 8 ? 2 : 1;
    __m256 acc[2][NT_MAX];
    uint8_t xu[NT_MAX][256], xlu[NT_MAX][256];  /* this super-block's codes + 128 */
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < NT; t++) acc[h][t] = _mm256_setzero_ps();
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
        for (int h = 0; h < halves; h++) {
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
                acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(is[t], bias)),
                                            _mm256_mul_ps(d, _mm256_set1_ps(dxs)), acc[h][t]);
                if (P == 2)
                    acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(il[t], bias)),
                                                _mm256_mul_ps(d, _mm256_set1_ps(dxs * (1.0f / 256.0f))), acc[h][t]);
            }
        }
    }
    for (int h = 0; h < halves; h++) {
        int nrows = rows - 8 * h;
        if (nrows >= 8) {
            for (int t = 0; t < NT; t++) _mm256_storeu_ps(y + t * ldy + 8 * h, acc[h][t]);
        } else {
            __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nrows), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            for (int t = 0; t < NT; t++) _mm256_maskstore_ps(y + t * ldy + 8 * h, keep, acc[h][t]);
        }
    }
}

/* tokens t0 .. T, NT_MAX at a time */
AVX2_INLINE void q6_all(const uint8_t *tile, int64_t nsb, const xq_t *x, int64_t t0, int64_t T, const int P, int rows,
                        float *y, int64_t ldy) {
    int64_t t = t0;
    for (; t + NT_MAX <= T; t += NT_MAX) q6_n(tile, nsb, x, t, NT_MAX, P, rows, y + t * ldy, ldy);
    float *yt = y + t * ldy;
    switch (T - t) {
        case 3: q6_n(tile, nsb, x, t, 3, P, rows, yt, ldy); break;
        case 2: q6_n(tile, nsb, x, t, 2, P, rows, yt, ldy); break;
        case 1: q6_n(tile, nsb, x, t, 1, P, rows, yt, ldy); break;
        default: break;
    }
}

AVX2 static void tile_q6k_avx2(const uint8_t *tile, int64_t nsb, const xq_t *x, int rows, float *y, int64_t ldy) {
    const int64_t TB = token_block(x->K * (x->lo ? 2 : 1));  /* a block of tokens at a time (prompt.h) */
    for (int64_t t0 = 0; t0 < x->T; t0 += TB) {
        int64_t t1 = t0 + TB < x->T ? t0 + TB : x->T;
        if (x->lo) q6_all(tile, nsb, x, t0, t1, 2, rows, y, ldy);
        else q6_all(tile, nsb, x, t0, t1, 1, rows, y, ldy);
    }
}
#endif

void sluice_prompt_q6k_tile(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile,
                            const xq_t *x, int rows, float *y, int64_t ldy, int avx2) {
#if SLUICE_X86
    if (avx2 && rows == TILE_ROWS)
        pack_q6k_avx2(w + n0 * row_bytes, row_bytes, nsb, tile);
    else
#endif
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
