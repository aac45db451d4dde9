/* The AVX2 block functions of the IQ grid types for q8_low.c's integer path (included there once, after its
 * acc_chunk / CHUNK / BLK_ARGS; its header comment holds the arithmetic). Each 32-value chunk's grid rows go into a
 * register with one load each (lowbit.h's tables: one uint64 per 8-value row, one uint32 per 4-value row), the
 * grid values (all positive but IQ1's) are the maddubs magnitudes and the sign patterns go onto x with sign_epi8:
 * a 7-bit sign index through LB_SIGNS, or 32 sign bits through bit_signs. IQ1's codes 8 * grid +- 1 are signed:
 * their absolute values and themselves. Layouts and formulas: lowbit.c lowbit_unpack.
 *
 * The 8 chunks of a block are unrolled (GCC unroll 8): left as a loop, gcc kept it rolled with its table indices
 * through the stack, and each chunk's lookups waited on the last one's; unrolled, a [2048 x 512] projection at T=1,
 * one plane, one thread, the kernel alone in C (benchmarks/lowbit_block.py, best of 5 x 2000 calls) on an AVX2-only
 * EPYC (Zen 3), went IQ2_XXS 103 -> 91 us, IQ2_XS 130 -> 113, IQ2_S 138 -> 124, IQ3_XXS 136 -> 121, IQ3_S 187 -> 163,
 * IQ1_S 122 -> 111, IQ1_M 180 -> 140 (IQ4_XS 64 either way), the same bits (benchmarks/results/lowbit/
 * unroll-amd-avx2.txt). */

/* 32 sign bits (bit v negates value v) -> 32 bytes: 0xFF (-1) where set, else 0x01 */
AVX2_INLINE __m256i bit_signs(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(1));
}

/* the four 7-bit sign indices of a u32 (bits 7l ..) as the sign bytes of 4 rows of 8 values */
AVX2_INLINE __m256i signs4(uint32_t a) {
    return _mm256_set_epi64x((long long)LB_SIGNS[(a >> 21) & 127], (long long)LB_SIGNS[(a >> 14) & 127],
                             (long long)LB_SIGNS[(a >> 7) & 127], (long long)LB_SIGNS[a & 127]);
}

/* 4 rows of an 8-wide grid */
AVX2_INLINE __m256i rows8(const uint64_t *g, int i0, int i1, int i2, int i3) {
    return _mm256_set_epi64x((long long)g[i3], (long long)g[i2], (long long)g[i1], (long long)g[i0]);
}

/* scales per 16 values from one byte of two 4-bit s (low nibble first): 2s + 1 each */
AVX2_INLINE __m256i odd_nibbles(uint8_t s) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(2 * (s >> 4) + 1)), _mm_set1_epi16((short)(2 * (s & 15) + 1)));
}

AVX2_INLINE void blk_iq2_xxs(BLK_ARGS) {  /* per 32: 4 grid indices, a u32 of 4 sign indices and s */
    f->dw = f16c(b) * 0.125f;
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t a = rd32(q + 4);
        CHUNK(rows8(LB_IQ2XXS, q[0], q[1], q[2], q[3]), signs4(a), 1, _mm256_set1_epi16((short)(2 * (a >> 28) + 1)),
              ib);
    }
}

AVX2_INLINE void blk_iq2_xs(BLK_ARGS) {  /* per 8 values a u16: grid index (9 bits), sign index (7) */
    f->dw = f16c(b) * 0.125f;
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        uint16_t w[4];
        memcpy(w, b + 2 + 8 * ib, 8);
        __m256i sg = _mm256_set_epi64x((long long)LB_SIGNS[w[3] >> 9], (long long)LB_SIGNS[w[2] >> 9],
                                       (long long)LB_SIGNS[w[1] >> 9], (long long)LB_SIGNS[w[0] >> 9]);
        CHUNK(rows8(LB_IQ2XS, w[0] & 511, w[1] & 511, w[2] & 511, w[3] & 511), sg, 1, odd_nibbles(b[66 + ib]), ib);
    }
}

AVX2_INLINE void blk_iq2_s(BLK_ARGS) {  /* 10-bit grid indices (qs | 2 bits of qh), one sign bit per value */
    f->dw = f16c(b) * 0.125f;
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 4 * ib;
        const int qh = b[66 + ib];
        __m256i g = rows8(LB_IQ2S, q[0] | (qh & 3) << 8, q[1] | (qh & 12) << 6, q[2] | (qh & 48) << 4,
                          q[3] | (qh & 192) << 2);
        CHUNK(g, bit_signs(rd32(b + 34 + 4 * ib)), 1, odd_nibbles(b[74 + ib]), ib);
    }
}

AVX2_INLINE void blk_iq3_xxs(BLK_ARGS) {  /* 8 rows of 4 per 32 values, a u32 of 4 sign indices and s */
    f->dw = f16c(b) * 0.25f;
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        const uint32_t a = rd32(b + 66 + 4 * ib);
        const uint32_t *g = LB_IQ3XXS;
        __m256i v = _mm256_set_epi32((int)g[q[7]], (int)g[q[6]], (int)g[q[5]], (int)g[q[4]], (int)g[q[3]],
                                     (int)g[q[2]], (int)g[q[1]], (int)g[q[0]]);
        CHUNK(v, signs4(a), 1, _mm256_set1_epi16((short)(2 * (a >> 28) + 1)), ib);
    }
}

AVX2_INLINE void blk_iq3_s(BLK_ARGS) {  /* 9-bit indices (qs | a bit of qh), one sign bit per value, 1 + 2s */
    f->dw = f16c(b);
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 8 * ib;
        const int qh = b[66 + ib];
        const uint32_t *g = LB_IQ3S;
        __m256i v = _mm256_set_epi32((int)g[q[7] | (qh & 128) << 1], (int)g[q[6] | (qh & 64) << 2],
                                     (int)g[q[5] | (qh & 32) << 3], (int)g[q[4] | (qh & 16) << 4],
                                     (int)g[q[3] | (qh & 8) << 5], (int)g[q[2] | (qh & 4) << 6],
                                     (int)g[q[1] | (qh & 2) << 7], (int)g[q[0] | (qh & 1) << 8]);
        const int s = (b[106 + ib / 2] >> (4 * (ib & 1))) & 15;
        CHUNK(v, bit_signs(rd32(b + 74 + 4 * ib)), 1, _mm256_set1_epi16((short)(1 + 2 * s)), ib);
    }
}

AVX2_INLINE void blk_iq1_s(BLK_ARGS) {  /* codes 8 * grid +- 1 (a delta sign per 32 values), 2s + 1 */
    f->dw = f16c(b) * 0.125f;
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 2 + 4 * ib;
        const int qh = rd16(b + 34 + 2 * ib);
        __m256i g = rows8(LB_IQ1S, q[0] | (qh & 7) << 8, q[1] | (qh & 56) << 5, q[2] | (qh & 448) << 2,
                          q[3] | (qh & 3584) >> 1);
        __m256i c = _mm256_add_epi8(g, _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
        CHUNK(_mm256_abs_epi8(c), c, 1, _mm256_set1_epi16((short)(2 * ((qh >> 12) & 7) + 1)), ib);
    }
}

AVX2_INLINE void blk_iq1_m(BLK_ARGS) {  /* codes 8 * grid +- 1 (a delta sign per 8 values), 2s + 1 per 16 */
    f->dw = lowbit_iq1m_d(b) * 0.125f;
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i bit3 = _mm256_setr_epi8(8, 8, 8, 8, 8, 8, 8, 8, -128, -128, -128, -128, -128, -128, -128, -128,
                                          8, 8, 8, 8, 8, 8, 8, 8, -128, -128, -128, -128, -128, -128, -128, -128);
    uint16_t sc[4];
    memcpy(sc, b + 48, 8);
#pragma GCC unroll 8
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *q = b + 4 * ib;
        const int h0 = b[32 + 2 * ib], h1 = b[33 + 2 * ib];  /* nibbles: rows 4ib, 4ib + 1 / 4ib + 2, 4ib + 3 */
        __m256i g = rows8(LB_IQ1S, q[0] | (h0 & 7) << 8, q[1] | (h0 & 0x70) << 4, q[2] | (h1 & 7) << 8,
                          q[3] | (h1 & 0x70) << 4);
        /* the delta of row k: -1 where bit 3 (k even) or 7 (k odd) of byte k / 2 is set, else +1, for its 8 bytes */
        __m256i pick = _mm256_shuffle_epi8(_mm256_set1_epi16((short)(h0 | h1 << 8)), spread);
        __m256i minus = _mm256_cmpeq_epi8(_mm256_and_si256(pick, bit3), bit3);
        __m256i c = _mm256_add_epi8(g, _mm256_or_si256(minus, _mm256_set1_epi8(1)));
        const int s0 = (sc[ib / 2] >> (6 * (ib & 1))) & 7, s1 = (sc[ib / 2] >> (6 * (ib & 1) + 3)) & 7;
        __m256i scale = _mm256_set_m128i(_mm_set1_epi16((short)(2 * s1 + 1)), _mm_set1_epi16((short)(2 * s0 + 1)));
        CHUNK(_mm256_abs_epi8(c), c, 1, scale, ib);
    }
}
