/* Small elementwise steps of a bf16 decode step, each bitwise what its torch expression computes (torch rounds a
 * bf16 op's float32 result to nearest even, as bf16_round does), in one native call instead of tens of torch ops
 * (~4-10 us each at one row here: a decode token of a 16-layer MoE ran ~2,300 of them). */
#include "common.h"

/* float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's round_to_nearest_even) */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float bf16_float(uint16_t h) { return f32_bits((uint32_t)h << 16); }

/* The weighted sum of a token's expert outputs into out (bf16 [H], added to what it holds), in the order given:
 * for j = 0..n-1, out = bf16(out + bf16(p_j)) with p_j = bf16(ys[j]) * w[at[j]] (w bf16: the product rounded to
 * bf16; w float32: kept in float32), i.e. torch's `out += ((ys.to(bf16) * w).to(bf16))[j]`, row by row.
 * ys float32 [n, H]; w_f32: 1 when w is float32, 0 for bf16. */
void sluice_combine_bf16(int64_t n, const float *ys, int64_t H, const void *w, int w_f32, const int64_t *at,
                         uint16_t *out) {
    for (int64_t j = 0; j < n; j++) {
        float wj = w_f32 ? ((const float *)w)[at[j]] : bf16_float(((const uint16_t *)w)[at[j]]);
        const float *y = ys + j * H;
        for (int64_t h = 0; h < H; h++) {
            float p = bf16_float(bf16_round(y[h])) * wj;
            p = bf16_float(bf16_round(p));
            out[h] = bf16_round(bf16_float(out[h]) + p);
        }
    }
}
