/* The decoded tables of the low-bit GGUF types (lowbit.c fills them when the library loads, from iq_grids.h), shared
 * by their dequantization (lowbit.c) and their integer kernels (q8_low.c, q8_iq.h). Each 8-value grid row is one
 * uint64 holding its 8 values as bytes (value j in byte j, little-endian), each 4-value row one uint32: a row goes
 * into a vector with one load. */
#ifndef SLUICE_NATIVE_LOWBIT_H
#define SLUICE_NATIVE_LOWBIT_H

#include "common.h"

extern uint64_t LB_IQ2XXS[256];  /* IQ2_XXS grid: values 8, 25, 43 */
extern uint64_t LB_IQ2XS[512];   /* IQ2_XS grid */
extern uint64_t LB_IQ2S[1024];   /* IQ2_S grid */
extern uint64_t LB_IQ1S[2048];   /* IQ1_S / IQ1_M grid times 8 (int8 -8, 0, 8): their codes are 8 * grid +- 1 */
extern uint32_t LB_IQ3XXS[256];  /* IQ3_XXS grid: values 4 .. 62 */
extern uint32_t LB_IQ3S[512];    /* IQ3_S grid: values 1 .. 15 */
/* the sign pattern of a 7-bit index (ggml's ksigns_iq2xs): byte j 0xFF (-1) where value j is negated, else 0x01;
 * bit j of the index negates value j < 7, value 7 is negated when the index has an odd number of set bits */
extern uint64_t LB_SIGNS[128];
extern const int8_t LB_IQ4NL[16];     /* IQ4_NL / IQ4_XS: the value of each 4-bit code */
extern const int8_t LB_FP4X2[16];     /* GGUF MXFP4: twice the e2m1 value of each code (code 8 is +0, as gguf) */

/* One block of a low-bit type unpacked (lowbit_unpack; the portable path of every kernel and the dequantization):
 * the weights are  w[v] = dw * sc[v / 16] * c[v] - dm * mf[v / 16]  (in exact arithmetic), the 256 values of a
 * super-block or the 32 of an IQ4_NL / MXFP4 block. c holds the signed codes, or for the types with a min or an
 * offset (Q2_K: the min; Q3_K: code + 4; TQ1_0 / TQ2_0: code + 1) the unsigned ones with that term in mf. d is the
 * block's own f16 scale (dmin in dm for Q2_K): the dequantization applies each format's float scale formula to it,
 * the integer path dw (d, or d / 8, d / 4 where the integer scale is 2s + 1 for a half-step scale). */
typedef struct {
    int8_t c[256];
    int sc[16], mf[16];
    float d, dw, dm;
} lowblk;

void lowbit_unpack(int fmt, const uint8_t *blk, lowblk *u);  /* both of: */
void lowbit_scales(int fmt, const uint8_t *blk, lowblk *u);  /* sc, mf, d, dw, dm */
void lowbit_codes(int fmt, const uint8_t *blk, int8_t *c);   /* c (n values) */
/* bytes of one block (inline: a constant where the kernels are specialized per format) */
static inline int lowbit_block_bytes(int fmt) {
    switch (fmt) {
    case MXFP4: return 17;
    case Q2_K: return 84;
    case Q3_K: case IQ3_S: return 110;
    case TQ1_0: return 54;
    case TQ2_0: case IQ2_XXS: return 66;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case IQ2_XS: return 74;
    case IQ2_S: return 82;
    case IQ3_XXS: return 98;
    case IQ1_S: return 50;
    case IQ1_M: return 56;
    }
    return 0;
}

/* values of one block: 32 (IQ4_NL, MXFP4) or 256 */
static inline int lowbit_block_values(int fmt) { return fmt == IQ4_NL || fmt == MXFP4 ? 32 : 256; }
float lowbit_iq1m_d(const uint8_t *blk);  /* IQ1_M's f16 scale, spread over the top nibbles of its scale words */

/* The dequantization's float scale of 16-value group g of an unpacked block, from the block's own fields in the
 * reference's order (ggml_k.py / ggml_iq.py); *bias (Q2_K's negated min product, else 0) and *off (code = c - off) */
static inline __attribute__((always_inline)) float lowbit_group_scale(int fmt, const lowblk *u, int g, float *bias,
                                                                      int *off) {
    *bias = 0.0f;
    *off = 0;
    switch (fmt) {
    case Q2_K: *bias = -(u->dm * (float)u->mf[g]); return u->d * (float)u->sc[g];
    case Q3_K: *off = 4; return u->d * (float)u->sc[g];
    case TQ1_0: case TQ2_0: *off = 1; return u->d;
    case IQ4_XS: case IQ3_S: return u->d * (float)u->sc[g];
    case IQ2_XXS: case IQ2_XS: case IQ2_S: return (u->d * ((float)(u->sc[g] >> 1) + 0.5f)) * 0.25f;
    case IQ3_XXS: return (u->d * ((float)(u->sc[g] >> 1) + 0.5f)) * 0.5f;
    case IQ1_S: case IQ1_M: return (u->d * (float)u->sc[g]) * 0.125f;
    }
    return u->d;  /* IQ4_NL, MXFP4 */
}

/* An unpacked block's exact weights into o (the dequantization, bitwise gguf's): per 16 values scale * (c - off),
 * one rounding, plus Q2_K's bias, a second (lowbit.c's portable rows; q8_low.c's AVX2 rows do the same operations
 * in vectors, so the same bits: -ffp-contract=off keeps every product and sum apart) */
static inline void lowbit_apply(int fmt, const lowblk *u, float *o) {
    const int n = lowbit_block_values(fmt);
    for (int g = 0; g < n / 16; g++) {
        float bias;
        int off;
        const float scale = lowbit_group_scale(fmt, u, g, &bias, &off);
        for (int j = 16 * g; j < 16 * g + 16; j++) {
            float v = scale * (float)(u->c[j] - off);
            o[j] = fmt == Q2_K ? v + bias : v;
        }
    }
}

#endif
