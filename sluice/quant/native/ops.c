/* Small elementwise steps of a bf16 decode step, each bitwise what its torch expression computes (torch rounds a
 * bf16 op's float32 result to nearest even, as bf16_round does), in one native call instead of tens of torch ops
 * (~4-10 us each at one row here: a decode token of a 16-layer MoE ran ~2,300 of them). */
#include <math.h>

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

/* RMSNorm of rows of bf16 x ([rows, n]) with bf16 weight [n], as the reference computes it: statistics in float32,
 * the normalized row rounded to bf16, then times the weight (rounded to bf16). The sum of squares runs in 8 float
 * lanes (value i into lane i % 8, lanes added ((0+4)+(2+6))+((1+5)+(3+7))), a fixed order whatever the compiler
 * vectorizes; torch's mean sums in another order, so a row can differ from the torch expression in the last bit of
 * its scale (relative ~1e-7), never by more. */
void sluice_rms_norm_bf16(int64_t rows, int64_t n, const uint16_t *x, const uint16_t *w, float eps, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++, x += n, out += n) {
        float lane[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int l = 0; l < 8; l++) {
                float v = bf16_float(x[i + l]);
                lane[l] = lane[l] + v * v;
            }
        for (; i < n; i++) {
            float v = bf16_float(x[i]);
            lane[i % 8] = lane[i % 8] + v * v;
        }
        float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        float scale = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t j = 0; j < n; j++)
            out[j] = bf16_round(bf16_float(w[j]) * bf16_float(bf16_round(bf16_float(x[j]) * scale)));
    }
}
