/* The low-bit GGUF types (Q2_K, Q3_K, TQ1_0, TQ2_0, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
 * IQ1_M): their grids decoded once when the library loads, their blocks unpacked (codes, integer scales), and the
 * exact dequantization of one weight row, bitwise
 * sluice/quant/ggml_k.py and ggml_iq.py (and so the `gguf` package): per group a float32 scale computed in the
 * reference's order, then value = scale * code (+ bias), each product and sum rounded once (-ffp-contract=off).
 * The block layouts and each format's formula are written next to its case; the tables of ggml_k.py / ggml_iq.py
 * say the same. kernels.c calls lowbit_deq_row (portable) or q8_low.c's lowbit_deq_row_avx2 (the codes from the
 * integer kernels' AVX2 unpacking, the same lowbit_apply) for the float row kernel, the float32 dequantization and
 * the bf16 GEMM route of a prompt; the integer path's portable kernels unpack with lowbit_unpack.
 */
#include "common.h"
#include "iq_grids.h"
#include "lowbit.h"

uint64_t LB_IQ2XXS[256], LB_IQ2XS[512], LB_IQ2S[1024], LB_IQ1S[2048], LB_SIGNS[128];
uint32_t LB_IQ3XXS[256], LB_IQ3S[512];
const int8_t LB_FP4X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
const int8_t LB_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static int hexval(char c) { return c <= '9' ? c - '0' : c - 'a' + 10; }

/* grid g's rows as bytes (times `mul`) into out: 8 bytes a row (uint64) or 4 (uint32) */
static void decode_grid(int g, int mul, void *out) {
    const iq_grid_src *s = &IQ_GRID_SRC[g];
    const int per = 8 / s->bits, n = s->rows * s->width;
    uint8_t *o = (uint8_t *)out;
    for (int i = 0; i < n; i++) {
        const char *h = s->hex + 2 * (i / per);
        int byte = 16 * hexval(h[0]) + hexval(h[1]);
        int idx = (byte >> (s->bits * (i % per))) & ((1 << s->bits) - 1);
        o[i] = (uint8_t)(int8_t)(mul * s->levels[idx]);  /* row r, value j at byte width * r + j */
    }
}

__attribute__((constructor)) static void lowbit_init(void) {
    decode_grid(GRID_IQ2_XXS, 1, LB_IQ2XXS);
    decode_grid(GRID_IQ2_XS, 1, LB_IQ2XS);
    decode_grid(GRID_IQ2_S, 1, LB_IQ2S);
    decode_grid(GRID_IQ1_S, 8, LB_IQ1S);
    decode_grid(GRID_IQ3_XXS, 1, LB_IQ3XXS);
    decode_grid(GRID_IQ3_S, 1, LB_IQ3S);
    for (int k = 0; k < 128; k++) {
        int odd = __builtin_popcount(k) & 1, pattern = k | (odd << 7);
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)((pattern >> j) & 1 ? 0xFF : 0x01) << (8 * j);
        LB_SIGNS[k] = v;
    }
}

/* row `row` of grid g (GRID_* of iq_grids.h) as the C tables hold it, 8 or 4 bytes (tests compare it with
 * ggml_iq.grid; IQ1_S is stored times 8) */
uint64_t sluice_lowbit_grid_row(int g, int row) {
    switch (g) {
    case GRID_IQ1_S: return LB_IQ1S[row];
    case GRID_IQ2_XXS: return LB_IQ2XXS[row];
    case GRID_IQ2_XS: return LB_IQ2XS[row];
    case GRID_IQ2_S: return LB_IQ2S[row];
    case GRID_IQ3_XXS: return LB_IQ3XXS[row];
    case GRID_IQ3_S: return LB_IQ3S[row];
    }
    return 0;
}

/* digit j (0..4) of a TQ1_0 byte: the integer part of 3 * (x * 3^j mod 256) / 256 */
static inline int tq1_digit(int x, int j) {
    static const int POW3[5] = {1, 3, 9, 27, 81};
    return (((x * POW3[j]) & 255) * 3) >> 8;
}

float lowbit_iq1m_d(const uint8_t *blk) {
    uint16_t w[4];
    memcpy(w, blk + 48, 8);
    return f16_to_f32((uint16_t)((w[0] >> 12) | ((w[1] >> 8) & 0xF0) | ((w[2] >> 4) & 0xF00) | (w[3] & 0xF000)));
}

/* n (4 or 8) values of a grid row (its bytes at g) into c, times the +-1 bytes at sg (of a LB_SIGNS row) */
static inline void signed_row(int8_t *c, const void *g, const void *sg, int n) {
    int8_t v[8], s[8];
    memcpy(v, g, n);
    memcpy(s, sg, n);
    for (int j = 0; j < n; j++) c[j] = (int8_t)(v[j] * s[j]);
}

/* n values of a grid row into c, value j negated where bit j of neg is set */
static inline void negated_row(int8_t *c, const void *g, int neg, int n) {
    int8_t v[8];
    memcpy(v, g, n);
    for (int j = 0; j < n; j++) c[j] = (int8_t)((neg >> j) & 1 ? -v[j] : v[j]);
}

/* the 2-bit fields of Q2_K, Q3_K's low bits and TQ2_0: value 128h + 32j + l is bits 2j, 2j+1 of q[32h + l] */
static inline void crumbs256(int8_t *c, const uint8_t *q) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) c[128 * h + 32 * j + l] = (int8_t)((q[32 * h + l] >> (2 * j)) & 3);
}

void lowbit_codes(int fmt, const uint8_t *b, int8_t *c) {
    switch (fmt) {
    case Q2_K: crumbs256(c, b + 16); return;  /* q (0..3) */
    case TQ2_0: crumbs256(c, b); return;      /* t (0..3): code t - 1 */
    case Q3_K:  /* low 2 bits as Q2_K's, bit j of hmask[l] the high bit of value 32j + l: c = q + 4 (0..7) */
        crumbs256(c, b + 32);
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) c[32 * j + l] = (int8_t)(c[32 * j + l] | (((b[l] >> j) & 1) << 2));
        return;
    case TQ1_0:  /* t (0..2): value 32j + l is digit j of qs[l] (l < 32), 160 + 16j + l digit j of qs[32 + l]
                  * (l < 16), 240 + 4j + l digit j of qh[l] (j < 4); code t - 1 */
        for (int j = 0; j < 5; j++)
            for (int l = 0; l < 32; l++) c[32 * j + l] = (int8_t)tq1_digit(b[l], j);
        for (int j = 0; j < 5; j++)
            for (int l = 0; l < 16; l++) c[160 + 16 * j + l] = (int8_t)tq1_digit(b[32 + l], j);
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 4; l++) c[240 + 4 * j + l] = (int8_t)tq1_digit(b[48 + l], j);
        return;
    case IQ4_NL: case MXFP4: case IQ4_XS: {  /* table[q]: value j < 16 the low nibble of qs[j], j >= 16 the high one,
                                              * per 32 values (IQ4_XS: qs[16ib:16ib + 16]) */
        const int8_t *tab = fmt == MXFP4 ? LB_FP4X2 : LB_IQ4NL;
        const int nb = fmt == IQ4_XS ? 8 : 1;
        const uint8_t *q = b + (fmt == IQ4_XS ? 8 : fmt == IQ4_NL ? 2 : 1);
        for (int ib = 0; ib < nb; ib++, q += 16, c += 32)
            for (int l = 0; l < 16; l++) c[l] = tab[q[l] & 15], c[16 + l] = tab[q[l] >> 4];
        return;
    }
    case IQ2_XXS:  /* per 32 values: 4 grid indices (rows of 8), a u32 of their 4 7-bit sign indices */
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 2 + 8 * ib;
            uint32_t aux = rd32(q + 4);
            for (int l = 0; l < 4; l++) signed_row(c + 32 * ib + 8 * l, &LB_IQ2XXS[q[l]], &LB_SIGNS[(aux >> (7 * l)) & 127], 8);
        }
        return;
    case IQ2_XS:  /* per 8 values a u16: grid index low 9 bits, sign index high 7 */
        for (int i = 0; i < 32; i++) {
            uint16_t w = rd16(b + 2 + 2 * i);
            signed_row(c + 8 * i, &LB_IQ2XS[w & 511], &LB_SIGNS[w >> 9], 8);
        }
        return;
    case IQ2_S:  /* row i's index qs[i] | bits 2(i % 4), +1 of qh[i / 4] << 8, bit j of signs[i] negating value j */
        for (int i = 0; i < 32; i++)
            negated_row(c + 8 * i, &LB_IQ2S[b[2 + i] | (((b[66 + i / 4] >> (2 * (i & 3))) & 3) << 8)], b[34 + i], 8);
        return;
    case IQ3_XXS:  /* qs[64] grid rows of 4, then a u32 per 32 values: the 4 sign indices of its rows of 8 */
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux = rd32(b + 66 + 4 * ib);
            for (int k = 0; k < 8; k++) {
                const uint8_t *sg = (const uint8_t *)&LB_SIGNS[(aux >> (7 * (k / 2))) & 127] + 4 * (k & 1);
                signed_row(c + 32 * ib + 4 * k, &LB_IQ3XXS[b[2 + 8 * ib + k]], sg, 4);
            }
        }
        return;
    case IQ3_S:  /* grid row i (4 values) qs[i] | (bit i % 8 of qh[i / 8]) << 8, bit v % 8 of signs[v / 8] negating
                  * value v */
        for (int i = 0; i < 64; i++)
            negated_row(c + 4 * i, &LB_IQ3S[b[2 + i] | (((b[66 + i / 8] >> (i & 7)) & 1) << 8)],
                        b[74 + i / 2] >> (4 * (i & 1)), 4);
        return;
    case IQ1_S:  /* per 32 values ib, qh[ib] holds the high 3 bits of its 4 grid indices (bits 3l..) and the sign of
                  * delta (bit 15): 8 * grid +- 1 */
        for (int ib = 0; ib < 8; ib++) {
            uint16_t qh = rd16(b + 34 + 2 * ib);
            for (int l = 0; l < 4; l++) {
                int8_t v[8];
                memcpy(v, &LB_IQ1S[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8)], 8);
                for (int j = 0; j < 8; j++) c[32 * ib + 8 * l + j] = (int8_t)(v[j] + (qh & 0x8000 ? -1 : 1));
            }
        }
        return;
    case IQ1_M:  /* nibble h of qh[j]: row 2j + h's high 3 index bits and, bit 3, the sign of its delta */
        for (int i = 0; i < 32; i++) {
            int nib = (b[32 + i / 2] >> (4 * (i & 1))) & 15;
            int8_t v[8];
            memcpy(v, &LB_IQ1S[b[i] | ((nib & 7) << 8)], 8);
            for (int j = 0; j < 8; j++) c[8 * i + j] = (int8_t)(v[j] + (nib & 8 ? -1 : 1));
        }
        return;
    }
}

static void scales16(lowblk *u, int g, int sc) { u->sc[2 * g] = u->sc[2 * g + 1] = sc; }  /* one per 32 values */

void lowbit_scales(int fmt, const uint8_t *b, lowblk *u) {
    memset(u->mf, 0, sizeof u->mf);
    u->dm = 0.0f;
    switch (fmt) {
    case Q2_K:  /* scales[16] qs[64] d dmin: per 16 values (d * (sc & 15)) * q - dmin * (sc >> 4) */
        for (int g = 0; g < 16; g++) u->sc[g] = b[g] & 15, u->mf[g] = b[g] >> 4;
        u->d = u->dw = rdf16(b + 80);
        u->dm = rdf16(b + 82);
        return;
    case Q3_K:  /* hmask[32] qs[64] scales[12] d: (d * (sc - 32)) * (c - 4) per 16 values. The 6-bit scales: low 4
                 * bits the low (g < 8) or high (g >= 8) nibble of byte g % 8, top 2 bits bits 2 (g / 4), +1 of byte
                 * 8 + g % 4 */
        for (int g = 0; g < 16; g++) {
            int low = g < 8 ? b[96 + g] & 15 : b[96 + g - 8] >> 4, top = (b[104 + g % 4] >> (2 * (g / 4))) & 3;
            u->sc[g] = (low | (top << 4)) - 32;
            u->mf[g] = 4 * u->sc[g];
        }
        u->d = u->dw = u->dm = rdf16(b + 108);
        return;
    case TQ1_0: case TQ2_0:  /* TQ1_0: qs[48] qh[4] d; TQ2_0: qs[64] d: d * (t - 1) */
        for (int g = 0; g < 16; g++) u->sc[g] = u->mf[g] = 1;
        u->d = u->dw = u->dm = rdf16(b + (fmt == TQ1_0 ? 52 : 64));
        return;
    case IQ4_NL: case MXFP4:  /* IQ4_NL: d qs[16], d * kvalues[q]; MXFP4: e qs[16], 2^(e - 128) * (2 * e2m1(q)) */
        u->sc[0] = u->sc[1] = 1;
        u->d = u->dw = fmt == IQ4_NL ? rdf16(b) : e8m0_half(b[0]);
        return;
    case IQ4_XS: {  /* d scales_h(u16) scales_l[4] qs[128]: (d * (s - 32)) * kvalues[q], s = nibble ib of scales_l
                     * | bits 2ib, 2ib+1 of scales_h << 4 */
        uint16_t sh = rd16(b + 2);
        for (int ib = 0; ib < 8; ib++)
            scales16(u, ib, (((b[4 + ib / 2] >> (4 * (ib & 1))) & 15) | (((sh >> (2 * ib)) & 3) << 4)) - 32);
        u->d = u->dw = rdf16(b);
        return;
    }
    case IQ2_XXS: case IQ3_XXS:  /* s the top 4 bits of each 32 values' u32: ((d * (0.5 + s)) * 0.25) * grid * sign
                                  * (IQ3_XXS: * 0.5), i.e. (d / 8) * (2s + 1) * grid * sign (IQ3_XXS: d / 4) */
        for (int ib = 0; ib < 8; ib++) scales16(u, ib, 2 * (int)(rd32(b + (fmt == IQ2_XXS ? 6 + 8 * ib : 66 + 4 * ib)) >> 28) + 1);
        u->d = rdf16(b);
        u->dw = u->d * (fmt == IQ2_XXS ? 0.125f : 0.25f);
        return;
    case IQ2_XS: case IQ2_S:  /* scales[8] (at 66 / 74): s a nibble per 16 values (low nibble first);
                               * ((d * (0.5 + s)) * 0.25) * grid * sign */
        for (int g = 0; g < 16; g++) u->sc[g] = 2 * ((b[(fmt == IQ2_XS ? 66 : 74) + g / 2] >> (4 * (g & 1))) & 15) + 1;
        u->d = rdf16(b);
        u->dw = u->d * 0.125f;
        return;
    case IQ3_S:  /* d qs[64] qh[8] signs[32] scales[4]: d * (1 + 2s), s a nibble per 32 values */
        for (int ib = 0; ib < 8; ib++) scales16(u, ib, 1 + 2 * ((b[106 + ib / 2] >> (4 * (ib & 1))) & 15));
        u->d = u->dw = rdf16(b);
        return;
    case IQ1_S:  /* d qs[32] qh[8](u16): s bits 12-14 of qh[ib]; ((d * (2s + 1)) * 0.125) * (8 * grid +- 1) */
        for (int ib = 0; ib < 8; ib++) scales16(u, ib, 2 * ((rd16(b + 34 + 2 * ib) >> 12) & 7) + 1);
        u->d = rdf16(b);
        u->dw = u->d * 0.125f;
        return;
    case IQ1_M:  /* qs[32] qh[16] scales[4](u16): s[4w + k] bits 3k.. of word w, one per 16 values; d the words' top
                  * nibbles; ((d * (2s + 1)) * 0.125) * (8 * grid +- 1) */
        for (int g = 0; g < 16; g++) u->sc[g] = 2 * ((rd16(b + 48 + 2 * (g / 4)) >> (3 * (g & 3))) & 7) + 1;
        u->d = lowbit_iq1m_d(b);
        u->dw = u->d * 0.125f;
        return;
    }
}

void lowbit_unpack(int fmt, const uint8_t *b, lowblk *u) {
    lowbit_scales(fmt, b, u);
    lowbit_codes(fmt, b, u->c);
}

void lowbit_deq_row(int fmt, const uint8_t *row, int64_t K, float *o) {
    const int bb = lowbit_block_bytes(fmt), n = lowbit_block_values(fmt);
    lowblk u;
    for (int64_t b = 0; b < K / n; b++, o += n) {
        lowbit_unpack(fmt, row + b * bb, &u);
        lowbit_apply(fmt, &u, o);
    }
}
