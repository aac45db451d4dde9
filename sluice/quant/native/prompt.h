/* What prompt.c (the Q4_K prompt tiles, their activation coding, the pool jobs) shares with prompt_avx2.c (the AVX2
 * tile kernel): the packed tile's layout and the coded activations. */
#ifndef SLUICE_NATIVE_PROMPT_H
#define SLUICE_NATIVE_PROMPT_H

#include "common.h"

#define TILE_ROWS 16
#define SB_CODES 2048                          /* 8 sub-blocks x 4 vectors x 64 bytes */
#define SB_TILE (SB_CODES + 512 + 256 + 128)   /* + sc int32 [8][16], m int16 pairs [4][16][2], d, dmin [16] */
/* a super-block's codes one a byte (the AVX2 tiles' "wide" codes, Q5_K's own): per sub-block j and half h (8 rows),
 * 8 vectors of 32 bytes: value group v's codes 4v .. +3, then 16 + 4v .. +3, of each of the 8 rows */
#define SB_WIDE (8 * 2 * 256)

/* x [T, K] coded: per 256 values D (d), codes hi = rint(x / D) (c) and their sums per 32 values (s); with two
 * planes (lo not NULL) also lo = rint((x / D - hi) * 256) (|lo| <= 127) and its sums (sl): x ~ D * (hi + lo / 256) */
typedef struct {
    const int8_t *c;   /* codes [T, K] */
    const float *d;    /* scales [T, K / 256] */
    const int16_t *s;  /* code sums [T, K / 32] */
    const int8_t *lo;  /* the second plane [T, K], or NULL */
    const int16_t *sl; /* its sums [T, K / 32] */
    int64_t K, T;
} xq_t;

/* Tokens a tile kernel runs both halves of its rows over before the next block of tokens: a block's codes (bytes
 * a token: K, or 2K at two planes) stay in L2 (256 KiB of them) between the halves; a multiple of 60, so of every
 * pass length (4 and 5 tokens; 6 was tried), and only the last block has a remainder. 2,048 tokens at one plane, 2 threads, Intel Xeon
 * capped at AVX2, GMAC/s over the whole x / in blocks: attn_q [1024 x 1024] 175.6 / 188.8, an expert gate [512 x
 * 1024] 183.9 / 195.2 (3/3 paired runs faster; 256 tokens: 204-222) (`benchmarks/quantized/prompt_tile.py 2048
 * --tensor ...`, benchmarks/results/quantized/breakdown/prompt-tile-q6k.txt). */
static inline int64_t token_block(int64_t bytes_a_token) {
    int64_t tb = (256 << 10) / bytes_a_token / 60 * 60;
    return tb < 60 ? 60 : tb;
}

/* prompt.c: the portable tile for tokens t0 .. t1 (wide not NULL: the codes one a byte there, Q5_K's) */
void sluice_prompt_tile_scalar(const uint8_t *tile, const uint8_t *wide, int64_t nsb, const xq_t *x, int64_t t0,
                               int64_t t1, int rows, float *y, int64_t ldy);
/* prompt_q5k.c: rows n0 .. n0 + rows of a Q5_K matrix packed into tile (nsb * (SB_TILE + SB_WIDE) bytes: the
 * scales as a Q4_K tile has them, the 5-bit codes wide), then y [T, rows]: AVX2 (avx2 1) or portable, the same bits */
void sluice_prompt_q5k_tile(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile,
                            const xq_t *x, int rows, float *y, int64_t ldy, int avx2);
/* prompt_q6k.c: rows n0 .. n0 + rows of a Q6_K matrix (K / 256 = nsb super-blocks a row) packed into tile
 * (sluice_prompt_q6k_tile_bytes(nsb) bytes), then y [T, rows] for every token of x: AVX2 tiles (avx2 1) or their
 * portable twin, the same bits */
void sluice_prompt_q6k_tile(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile,
                            const xq_t *x, int rows, float *y, int64_t ldy, int avx2);
int64_t sluice_prompt_q6k_tile_bytes(int64_t nsb);

/* row r's scales of Q4_K super-block blk into the tile's super-block t: sc_j (int32), the mins as int16 pairs, d
 * and dmin */
static inline void tile_scales(uint8_t *t, int r, const uint8_t *blk) {
    int32_t *sc32 = (int32_t *)(t + SB_CODES);
    int16_t *m16 = (int16_t *)(t + SB_CODES + 512);
    float *df = (float *)(t + SB_CODES + 768);
    uint8_t sc[8], mn[8];
    k_scale_min(blk + 4, sc, mn);
    for (int j = 0; j < 8; j++) {
        sc32[16 * j + r] = sc[j];
        m16[32 * (j / 2) + 2 * r + (j & 1)] = mn[j];
    }
    df[r] = rdf16(blk);
    df[16 + r] = rdf16(blk + 2);
}

#if SLUICE_X86
/* prompt_avx2.c: y [T, rows] (rows <= 16 of a packed tile, ldy apart) for every token of x, on AVX2; the portable
 * tile's bits. wide: nsb * SB_WIDE bytes, the codes one a byte: written here from the tile's nibbles (five 0), or
 * Q5_K's 5-bit codes already there (five 1) */
void sluice_prompt_tile_avx2(const uint8_t *tile, uint8_t *wide, int five, int64_t nsb, const xq_t *x, int rows,
                             float *y, int64_t ldy);
/* prompt_avx2.c: a whole 16-row tile from rows w .. w + 15 * row_bytes (all 16 present, 15 * row_bytes < 2^31), in
 * the layout pack_tile_scalar writes, the same bytes */
void sluice_prompt_pack_avx2(const uint8_t *w, int64_t row_bytes, int64_t nsb, uint8_t *tile);
/* g[i] = silu(g[i]) * u[i] on AVX2, exp_poly8: the scalar silu_mul's bits */
void sluice_prompt_silu_mul_avx2(float *g, const float *u, int64_t n);
#endif

#endif
