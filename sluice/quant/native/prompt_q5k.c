/* prompt.c's tiles for Q5_K (a Q5_K_M file's main type): the scales, mins, d and dmin as a Q4_K tile holds them (the
 * super-block header is Q4_K's), the 5-bit codes one a byte in the AVX2 tiles' wide layout (prompt.h SB_WIDE), so
 * the AVX2 kernel (prompt_avx2.c, five = 1: int16 sums of 8 products, not 16) and the portable one read them as
 * they are; same formula as Q4_K (value = d * sc_j * q - dmin * m_j), the same bits on both paths. */
#include "prompt.h"

/* rows n0 .. n0 + 15 (rows past N zeros) of a Q5_K matrix: qs at +48 (low 4 bits: sub-block s's value l is the low
 * nibble of qs[32 (s / 2) + l] for even s, the high one for odd), qh at +16 (bit s of qh[l]: the fifth) */
static void pack_q5k(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile,
                     uint8_t *wide) {
    memset(tile, 0, (size_t)(nsb * SB_TILE));
    memset(wide, 0, (size_t)(nsb * SB_WIDE));
    for (int r = 0; r < TILE_ROWS && n0 + r < N; r++)
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *blk = w + (n0 + r) * row_bytes + 176 * b, *qh = blk + 16, *qs = blk + 48;
            for (int s = 0; s < 8; s++)
                for (int l = 0; l < 32; l++) {
                    int q = (s & 1) ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15;
                    q |= ((qh[l] >> s) & 1) << 4;
                    int v = (l % 16) / 4, i = l % 4;  /* value l of sub-block s: group v, the low or high 16 */
                    wide[b * SB_WIDE + 512 * s + 256 * (r / 8) + 64 * v + 32 * (l / 16) + 4 * (r % 8) + i] =
                        (uint8_t)q;
                }
            tile_scales(tile + b * SB_TILE, r, blk);
        }
}

#if SLUICE_X86
/* pack_q5k for 16 whole rows (15 * row_bytes < 2^31), 8 rows a gather: the same bytes */
AVX2 static void pack_q5k_avx2(const uint8_t *w, int64_t row_bytes, int64_t nsb, uint8_t *tile, uint8_t *wide) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i offs = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                            _mm256_set1_epi32((int)row_bytes));
    for (int64_t b = 0; b < nsb; b++) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *base = w + 8 * h * row_bytes + 176 * b, *qh = base + 16, *qs = base + 48;
            for (int v = 0; v < 4; v++) {
                /* values 4v .. +3 (lo) and 16 + 4v .. +3 (hi) of each sub-block: their fifth bits, 8 rows */
                __m256i hlo = _mm256_i32gather_epi32((const int *)(qh + 4 * v), offs, 1);
                __m256i hhi = _mm256_i32gather_epi32((const int *)(qh + 16 + 4 * v), offs, 1);
                for (int p = 0; p < 4; p++) {
                    __m256i a = _mm256_i32gather_epi32((const int *)(qs + 32 * p + 4 * v), offs, 1);
                    __m256i c = _mm256_i32gather_epi32((const int *)(qs + 32 * p + 16 + 4 * v), offs, 1);
                    for (int odd = 0; odd < 2; odd++) {
                        int sb = 2 * p + odd;  /* bit sb of each byte of qh, to bit 4 */
                        __m256i bl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hlo, sb), one), 4);
                        __m256i bh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hhi, sb), one), 4);
                        __m256i ql = odd ? _mm256_and_si256(_mm256_srli_epi16(a, 4), m4) : _mm256_and_si256(a, m4);
                        __m256i qc = odd ? _mm256_and_si256(_mm256_srli_epi16(c, 4), m4) : _mm256_and_si256(c, m4);
                        uint8_t *o = wide + b * SB_WIDE + 512 * sb + 256 * h + 64 * v;
                        _mm256_storeu_si256((__m256i *)o, _mm256_or_si256(ql, bl));
                        _mm256_storeu_si256((__m256i *)(o + 32), _mm256_or_si256(qc, bh));
                    }
                }
            }
        }
        for (int r = 0; r < TILE_ROWS; r++) tile_scales(tile + b * SB_TILE, r, w + r * row_bytes + 176 * b);
    }
}
#endif

void sluice_prompt_q5k_tile(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile,
                            const xq_t *x, int rows, float *y, int64_t ldy, int avx2) {
    uint8_t *wide = tile + nsb * SB_TILE;
#if SLUICE_X86
    if (avx2 && rows == TILE_ROWS && row_bytes * (TILE_ROWS - 1) <= INT32_MAX)
        pack_q5k_avx2(w + n0 * row_bytes, row_bytes, nsb, tile, wide);
    else
#endif
        pack_q5k(w, row_bytes, N, nsb, n0, tile, wide);
#if SLUICE_X86
    if (avx2) {
        sluice_prompt_tile_avx2(tile, wide, 1, nsb, x, rows, y, ldy);
        return;
    }
#endif
    (void)avx2;
    sluice_prompt_tile_scalar(tile, wide, nsb, x, 0, x->T, rows, y, ldy);
}
