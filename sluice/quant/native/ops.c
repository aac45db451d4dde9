/* Small elementwise steps of a bf16 decode step, each bitwise what its torch expression computes (torch rounds a
 * bf16 op's float32 result to nearest even, as bf16_round does), in one native call instead of tens of torch ops
 * (~4-10 us each at one row here: a decode token of a 16-layer MoE ran ~2,300 of them). */
#include <math.h>

#include "common.h"

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

/* A prompt's weighted sum of expert outputs (models/blocks.py Transformer.experts): for each token t, from +0,
 * out[t] = bf16(out[t] + bf16(ys[a] * w[a])) for a = at[t*K + r], r = 0..K-1 in order; ys bf16 [T*K, H] (the
 * expert-sorted outputs), w bf16 or float32 (w_f32) [T*K] (each row's routing weight), at [T, K]. Bitwise torch's
 * `ys.mul_(w[:, None])` then `out = zeros; for r: out += ys[at[:, r]]`, which it replaces (8 gathers and adds of a
 * [T, H] block each); tokens in blocks over the pool. */
typedef struct {
    int64_t T, K, H;
    const uint16_t *ys;
    const void *w;
    int w_f32;
    const int64_t *at;
    uint16_t *out;
} combine_rows_job;

#define COMBINE_ROWS 32 /* tokens per pool task */

static void combine_rows_task(void *c, int64_t i) {
    const combine_rows_job *j = (const combine_rows_job *)c;
    int64_t t1 = (i + 1) * COMBINE_ROWS < j->T ? (i + 1) * COMBINE_ROWS : j->T;
    for (int64_t t = i * COMBINE_ROWS; t < t1; t++) {
        uint16_t *o = j->out + t * j->H;
        for (int64_t h = 0; h < j->H; h++) o[h] = 0;  /* +0 */
        for (int64_t r = 0; r < j->K; r++) {
            int64_t a = j->at[t * j->K + r];
            float wa = j->w_f32 ? ((const float *)j->w)[a] : bf16_float(((const uint16_t *)j->w)[a]);
            const uint16_t *y = j->ys + a * j->H;
            for (int64_t h = 0; h < j->H; h++) {
                float p = bf16_float(bf16_round(bf16_float(y[h]) * wa));
                o[h] = bf16_round(bf16_float(o[h]) + p);
            }
        }
    }
}

void sluice_combine_rows_bf16(int64_t T, int64_t K, int64_t H, const uint16_t *ys, const void *w, int w_f32,
                              const int64_t *at, uint16_t *out) {
    combine_rows_job j = {T, K, H, ys, w, w_f32, at, out};
    pool_run(combine_rows_task, &j, (T + COMBINE_ROWS - 1) / COMBINE_ROWS);
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
        float sum = reduce8(lane);
        float scale = 1.0f / sqrtf(sum / (float)n + eps);
        for (int64_t j = 0; j < n; j++)
            out[j] = bf16_round(bf16_float(w[j]) * bf16_float(bf16_round(bf16_float(x[j]) * scale)));
    }
}

/* Rotary embedding of bf16 x [heads, T, D] (element (h, t, d) at x + h * sh + t * st + d) by bf16 cos / sin
 * [T, rot] on its first rot dims, into out (contiguous [heads, T, D]): torch's
 *   out = x * cos + cat(-x[rot/2:], x[:rot/2]) * sin      (bf16 ops: each product and the sum rounded to bf16)
 * on the first rot dims, the rest copied. */
void sluice_rope_bf16(int64_t heads, int64_t T, int64_t D, int64_t rot, const uint16_t *x, int64_t sh, int64_t st,
                      const uint16_t *cos, const uint16_t *sin, uint16_t *out) {
    const int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *xr = x + h * sh + t * st, *c = cos + t * rot, *s = sin + t * rot;
            uint16_t *o = out + (h * T + t) * D;
            for (int64_t d = 0; d < rot; d++) {
                float r = d < half ? -bf16_float(xr[d + half]) : bf16_float(xr[d - half]);
                float a = bf16_float(bf16_round(bf16_float(xr[d]) * bf16_float(c[d])));
                float b = bf16_float(bf16_round(r * bf16_float(s[d])));
                o[d] = bf16_round(a + b);
            }
            for (int64_t d = rot; d < D; d++) o[d] = xr[d];
        }
}
