/* One decode token of a Gated DeltaNet layer (models/layers/gated_deltanet.py) in one call: the causal conv's step
 * over q | k | v with silu, the l2-normalised queries and keys, beta and the decay, the gated delta rule on the
 * layer's float32 state and the gated RMSNorm of its output, in place of ~40 torch ops per layer (the projections
 * before and out_proj after stay where they are). The state [Hv, Dk, Dv] is read and written once: each value head
 * goes through it in blocks of DN_COLS columns, and both of the rule's passes over a block run while it is in L1.
 *
 * Numerics (x: the model's dtype, float32 or bf16; everything computed in float32, rounded to x where the torch
 * steps round; delta_rule.recurrent and norm.gated_rms_norm are the reference):
 *   conv    y_c = x(sum_j w_cj s_cj), taps j in order (the last K - 1 inputs, then this one), then x(silu(y_c))
 *   q, k    each key head times 1 / sqrt(sum of squares + 1e-6) (8 lanes, reduce8's order), q then / sqrt(Dk)
 *   beta    x(sigmoid(b)); g = -exp(A_log) * softplus(a + dt_bias) (threshold 20, as F.softplus), decay = exp(g)
 *   rule    per value head h (key head h / (Hv / nK): grouped; h % nK: tiled, llama.cpp's qwen35 GGUFs):
 *           S = S * decay; u = (v - sum_i k_i S_i) beta;
 *           S_i = S_i + k_i u; o = sum_i q_i S_i, the sums over i in order, elementwise along Dv
 *   norm    o rounded to x, times 1 / sqrt(mean of squares + eps) (8 lanes), rounded to x, times the weight (rounded
 *           to x), times silu(z) in float32, one rounding to x
 * silu is x / (1 + exp_poly(-x)) (common.h, within 2 ulp of e^x; torch's within 1), sigmoid, softplus and the decay
 * libm's expf / log1pf. torch sums in other orders (its bmm, conv1d and mean), so a float32 output is the torch
 * steps' to float32 rounding, not bitwise (tests/quant/test_deltanet.py states the bound).
 *
 * Three kernels, one chosen per model when it is built (sluice_deltanet_kernel, by the CPU and the model's path cap):
 * portable C, AVX2 (8 columns a vector) and AVX-512 (16; AVX512F). They give the same bits: the vector copies do the
 * portable code's operations column by column (no fused multiply-add; the sums along i run per column in all three,
 * silu's exp_poly has an 8-lane twin), and the heads' work is the same whichever thread runs it. */
#include <math.h>
#include <string.h>

#include "deltanet.h"

#define DN_COLS 32      /* state columns per block: 128 rows of 32 floats (16 KiB) stay in L1 between the passes */

/* The kernel a model's decode steps (and prompts: delta_prompt.c) run, chosen once when the model is built
 * (native/deltanet.py DeltaNetDecode): the best this CPU has under the path cap scalar (common.h: 0 any, 2 at most
 * AVX2, 1 the portable C). */
int sluice_deltanet_kernel(int scalar) {
    if (!SLUICE_X86 || !sluice_avx2_ok(scalar) || !sluice_simd()) return DN_PORTABLE;
    return sluice_avx512_ok(scalar) && sluice_cpu_avx512f() ? DN_AVX512 : DN_AVX2;
}

static inline float silu(float x) { return x / (1.0f + exp_poly(-x)); }

/* x[i] = x(silu(x[i])) for i in [i, n) (rounded to bf16 when bf16, else kept) */
static void silu_tail(float *x, int64_t i, int64_t n, int bf16) {
    for (; i < n; i++) x[i] = round_x(silu(x[i]), bf16);
}

/* One value head's state columns [j0, j1): S [Dk, Dv] decayed, u = (v - k^T S) beta, S + k u^T, o = q^T S
 * (u, o: [Dv], their columns [j0, j1) written) */
static void rule_cols(float *restrict S, int64_t Dk, int64_t Dv, int64_t j0, int64_t j1, const float *restrict k,
                      const float *restrict q, const float *restrict v, float beta, float decay, float *restrict u,
                      float *restrict o) {
    for (int64_t j = j0; j < j1; j++) u[j] = 0.0f;
    for (int64_t i = 0; i < Dk; i++) {
        float *s = S + i * Dv;
        for (int64_t j = j0; j < j1; j++) {
            s[j] = s[j] * decay;
            u[j] = u[j] + k[i] * s[j];
        }
    }
    for (int64_t j = j0; j < j1; j++) {
        u[j] = (v[j] - u[j]) * beta;
        o[j] = 0.0f;
    }
    for (int64_t i = 0; i < Dk; i++) {
        float *s = S + i * Dv;
        for (int64_t j = j0; j < j1; j++) {
            s[j] = s[j] + k[i] * u[j];
            o[j] = o[j] + q[i] * s[j];
        }
    }
}

static void rule(float *S, int64_t Dk, int64_t Dv, const float *k, const float *q, const float *v, float beta,
                 float decay, float *u, float *o) {
    for (int64_t j = 0; j < Dv; j += DN_COLS)
        rule_cols(S, Dk, Dv, j, j + DN_COLS < Dv ? j + DN_COLS : Dv, k, q, v, beta, decay, u, o);
}

#if SLUICE_X86
AVX2 static void silu_avx2(float *x, int64_t n, int bf16) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        v = _mm256_div_ps(v, _mm256_add_ps(one, exp_poly8(_mm256_xor_ps(v, sign))));
        _mm256_storeu_ps(x + i, bf16 ? bf16_rounded8(v) : v);
    }
    silu_tail(x, i, n, bf16);
}

/* rule_cols on the NV vectors of W columns from j0, in registers: VEC the vector type, P its intrinsics' prefix
 * (_mm256 / _mm512), the portable code's operations column by column (no fused multiply-add), so the same bits */
#define DN_BLOCK(NAME, TARGET, VEC, P, W, NV)                                                                        \
    TARGET static void NAME(float *S, int64_t Dk, int64_t Dv, int64_t j0, const float *k, const float *q,           \
                            const float *v, float beta, float decay, float *u, float *o) {                          \
        const VEC dv = P##_set1_ps(decay), bv = P##_set1_ps(beta);                                                   \
        VEC acc[NV], uu[NV];                                                                                         \
        for (int t = 0; t < NV; t++) acc[t] = P##_setzero_ps();                                                      \
        for (int64_t i = 0; i < Dk; i++) {                                                                           \
            float *s = S + i * Dv + j0;                                                                              \
            const VEC ki = P##_set1_ps(k[i]);                                                                        \
            for (int t = 0; t < NV; t++) {                                                                           \
                VEC x = P##_mul_ps(P##_loadu_ps(s + W * t), dv);                                                     \
                P##_storeu_ps(s + W * t, x);                                                                         \
                acc[t] = P##_add_ps(acc[t], P##_mul_ps(ki, x));                                                      \
            }                                                                                                        \
        }                                                                                                            \
        for (int t = 0; t < NV; t++) {                                                                               \
            uu[t] = P##_mul_ps(P##_sub_ps(P##_loadu_ps(v + j0 + W * t), acc[t]), bv);                                \
            P##_storeu_ps(u + j0 + W * t, uu[t]);                                                                    \
            acc[t] = P##_setzero_ps();                                                                               \
        }                                                                                                            \
        for (int64_t i = 0; i < Dk; i++) {                                                                           \
            float *s = S + i * Dv + j0;                                                                              \
            const VEC ki = P##_set1_ps(k[i]), qi = P##_set1_ps(q[i]);                                                \
            for (int t = 0; t < NV; t++) {                                                                           \
                VEC x = P##_add_ps(P##_loadu_ps(s + W * t), P##_mul_ps(ki, uu[t]));                                  \
                P##_storeu_ps(s + W * t, x);                                                                         \
                acc[t] = P##_add_ps(acc[t], P##_mul_ps(qi, x));                                                      \
            }                                                                                                        \
        }                                                                                                            \
        for (int t = 0; t < NV; t++) P##_storeu_ps(o + j0 + W * t, acc[t]);                                          \
    }
DN_BLOCK(rule_block8x4, AVX2, __m256, _mm256, 8, 4)
DN_BLOCK(rule_block8, AVX2, __m256, _mm256, 8, 1)

AVX2 static void rule_avx2(float *S, int64_t Dk, int64_t Dv, const float *k, const float *q, const float *v,
                           float beta, float decay, float *u, float *o) {
    int64_t j = 0;
    for (; j + 32 <= Dv; j += 32) rule_block8x4(S, Dk, Dv, j, k, q, v, beta, decay, u, o);
    for (; j + 8 <= Dv; j += 8) rule_block8(S, Dk, Dv, j, k, q, v, beta, decay, u, o);
    if (j < Dv) rule_cols(S, Dk, Dv, j, Dv, k, q, v, beta, decay, u, o);
}

/* AVX-512: the same 32-column blocks as two 16-wide vectors (half the instructions of AVX2's four), a 16-column
 * block, then AVX2's 8 and the portable tail */
DN_BLOCK(rule_block16x2, AVX512F, __m512, _mm512, 16, 2)
DN_BLOCK(rule_block16, AVX512F, __m512, _mm512, 16, 1)

AVX512F static void rule_avx512(float *S, int64_t Dk, int64_t Dv, const float *k, const float *q, const float *v,
                                float beta, float decay, float *u, float *o) {
    int64_t j = 0;
    for (; j + 32 <= Dv; j += 32) rule_block16x2(S, Dk, Dv, j, k, q, v, beta, decay, u, o);
    for (; j + 16 <= Dv; j += 16) rule_block16(S, Dk, Dv, j, k, q, v, beta, decay, u, o);
    for (; j + 8 <= Dv; j += 8) rule_block8(S, Dk, Dv, j, k, q, v, beta, decay, u, o);
    if (j < Dv) rule_cols(S, Dk, Dv, j, Dv, k, q, v, beta, decay, u, o);
}
#endif

/* silu over x [n] in place, rounded to bf16 when bf16 */
static void silu_all(float *x, int64_t n, int bf16, int simd) {
#if SLUICE_X86
    if (simd) {
        silu_avx2(x, n, bf16);
        return;
    }
#else
    (void)simd;
#endif
    silu_tail(x, 0, n, bf16);
}

typedef struct {
    int64_t nK, Hv, Dk, Dv, group;
    int tiled, bf16, kernel;
    const float *q, *k, *v;     /* [nK, Dk] normalised, [nK, Dk] normalised, [Hv, Dv] */
    const float *beta, *decay;  /* [Hv] */
    const float *gate;          /* [Hv, Dv] silu(z) */
    const void *norm;           /* [Dv] x dtype */
    float eps;
    float *state, *work;        /* [Hv, Dk, Dv]; [Hv, 2 Dv] */
    void *out;                  /* [Hv, Dv] x dtype */
} head_ctx;

/* value head h: the rule on its state (with key head h / group, or h % nK when the heads are tiled), then the gated
 * RMSNorm of its output into out */
static void head_task(void *c, int64_t h) {
    const head_ctx *a = c;
    const int64_t Dk = a->Dk, Dv = a->Dv, kh = a->tiled ? h % a->nK : h / a->group;
    const int bf16 = a->bf16;
    float *S = a->state + h * Dk * Dv, *u = a->work + 2 * h * Dv, *o = u + Dv;
    const float *k = a->k + kh * Dk, *q = a->q + kh * Dk, *v = a->v + h * Dv, *gate = a->gate + h * Dv;
#if SLUICE_X86
    if (a->kernel == DN_AVX512)
        rule_avx512(S, Dk, Dv, k, q, v, a->beta[h], a->decay[h], u, o);
    else if (a->kernel == DN_AVX2)
        rule_avx2(S, Dk, Dv, k, q, v, a->beta[h], a->decay[h], u, o);
    else
#endif
        rule(S, Dk, Dv, k, q, v, a->beta[h], a->decay[h], u, o);
    for (int64_t j = 0; j < Dv; j++) o[j] = round_x(o[j], bf16);
    const float scale = 1.0f / sqrtf(sum_squares(o, Dv) / (float)Dv + a->eps);
    for (int64_t j = 0; j < Dv; j++) {
        float y = round_x(load_x(a->norm, j, bf16) * round_x(o[j] * scale, bf16), bf16) * gate[j];
        if (bf16)
            ((uint16_t *)a->out)[h * Dv + j] = bf16_round(y);
        else
            ((float *)a->out)[h * Dv + j] = y;
    }
}

/* The conv's step over C channels of K taps: y[c] = x(sum_j w[c, j] seq[c, j]) with seq = the channel's last K - 1
 * inputs (st [C, K - 1]), then this token's x[c]; st then holds the last K - 1 inputs (moved as bits). x, w, st in
 * the x dtype; bf16 a constant where it is inlined, so each dtype gets its own loop. */
static inline __attribute__((always_inline)) void conv_rows(int64_t C, int64_t K, const void *x, const void *w,
                                                            void *st, const int bf16, float *y) {
    for (int64_t c = 0; c < C; c++) {
        const int64_t at = c * (K - 1);
        float acc = 0.0f;
        for (int64_t j = 0; j < K - 1; j++) acc = acc + load_x(w, c * K + j, bf16) * load_x(st, at + j, bf16);
        acc = acc + load_x(w, c * K + K - 1, bf16) * load_x(x, c, bf16);
        y[c] = round_x(acc, bf16);
        if (K < 2) continue;
        if (bf16) {
            uint16_t *s = (uint16_t *)st + at;
            for (int64_t j = 0; j < K - 2; j++) s[j] = s[j + 1];
            s[K - 2] = ((const uint16_t *)x)[c];
        } else {
            uint32_t *s = (uint32_t *)st + at;
            for (int64_t j = 0; j < K - 2; j++) s[j] = s[j + 1];
            s[K - 2] = ((const uint32_t *)x)[c];
        }
    }
}

#if SLUICE_X86
/* conv_rows's bf16 loop for channels [c0, c1) (c0 >= 1: each tap read as the high half of the 32 bits ending at it,
 * 2 bytes before it, so never past the arrays' end) 8 a vector: the same products and sums per channel in the same
 * order (no fused multiply-add), so the same bits; the state is left as it was (conv_shift_bf16 moves it). Scalar,
 * one channel at a time with its state moved, the conv was the hottest part of the step's serial code (perf annotate
 * of sluice_deltanet_step); this way a Gated DeltaNet layer's decode call of the issue-32 UD file (C = 8192, K = 4),
 * alone in a hot loop, went 343-372 -> 322-329 us (best of 15 x 200, 3 of 3 alternations; in the model the change is
 * under the VM's noise. Intel Xeon VM: benchmarks/results/hybrid/conv-avx2.txt). */
AVX2 static void conv_rows_bf16_avx2(int64_t c0, int64_t c1, int64_t K, const uint16_t *x, const uint16_t *w,
                                     const uint16_t *st, float *y) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_set1_epi32((int)0xffff0000u);
    const __m256i wstep = _mm256_mullo_epi32(lanes, _mm256_set1_epi32((int)(2 * K)));
    const __m256i sstep = _mm256_mullo_epi32(lanes, _mm256_set1_epi32((int)(2 * (K - 1))));
    for (int64_t c = c0; c + 8 <= c1; c += 8) {
        const char *wb = (const char *)(w + c * K) - 2, *sb = (const char *)(st + c * (K - 1)) - 2;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < K - 1; j++) {
            __m256 wj = _mm256_castsi256_ps(_mm256_and_si256(_mm256_i32gather_epi32((const int *)(wb + 2 * j), wstep, 1), hi));
            __m256 sj = _mm256_castsi256_ps(_mm256_and_si256(_mm256_i32gather_epi32((const int *)(sb + 2 * j), sstep, 1), hi));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(wj, sj));
        }
        __m256 wl = _mm256_castsi256_ps(
            _mm256_and_si256(_mm256_i32gather_epi32((const int *)(wb + 2 * (K - 1)), wstep, 1), hi));
        acc = _mm256_add_ps(acc, _mm256_mul_ps(wl, bf16x8(x + c)));
        _mm256_storeu_ps(y + c, bf16_rounded8(acc));
    }
}
#endif

/* conv_rows's bf16 sum of channel c, the state left as it is */
static float conv_one_bf16(int64_t c, int64_t K, const uint16_t *x, const uint16_t *w, const uint16_t *st) {
    float acc = 0.0f;
    for (int64_t j = 0; j < K - 1; j++) acc = acc + bf16_float(w[c * K + j]) * bf16_float(st[c * (K - 1) + j]);
    acc = acc + bf16_float(w[c * K + K - 1]) * bf16_float(x[c]);
    return bf16_float(bf16_round(acc));
}

/* the state [C, K - 1] of bf16 values moved on by this token's x: each channel's last K - 1 inputs (as bits) */
static void conv_shift_bf16(int64_t C, int64_t K, const uint16_t *x, uint16_t *st) {
    memmove(st, st + 1, (size_t)((K - 1) * C - 1) * sizeof(uint16_t));
    for (int64_t c = 0; c < C; c++) st[c * (K - 1) + K - 2] = x[c];
}

static void conv_step(int64_t C, int64_t K, const void *x, const void *w, void *st, int bf16, int simd, float *y) {
#if SLUICE_X86
    if (bf16 && simd && K >= 2 && C >= 16) { /* channels [8, v1) in vectors, the others one by one */
        const uint16_t *xs = (const uint16_t *)x, *ws = (const uint16_t *)w;
        uint16_t *ss = (uint16_t *)st;
        const int64_t v1 = 8 + (C - 8) / 8 * 8;
        conv_rows_bf16_avx2(8, v1, K, xs, ws, ss, y);
        for (int64_t c = 0; c < 8; c++) y[c] = conv_one_bf16(c, K, xs, ws, ss);
        for (int64_t c = v1; c < C; c++) y[c] = conv_one_bf16(c, K, xs, ws, ss);
        conv_shift_bf16(C, K, xs, ss);
        return;
    }
#else
    (void)simd;
#endif
    if (bf16)
        conv_rows(C, K, x, w, st, 1, y);
    else
        conv_rows(C, K, x, w, st, 0, y);
}

/* One decode token of a Gated DeltaNet layer: nK key heads and Hv value heads (a multiple) of Dk / Dv, a conv of K
 * taps over the C = 2 nK Dk + Hv Dv channels of q | k | v. tiled: 1 when value head h reads key head h % nK (the
 * value heads stored tiled over the key heads: llama.cpp's qwen35 GGUFs), 0 when h / (Hv / nK) (grouped:
 * transformers' order). bf16: 1 when qkv, z, b, a, conv_w, conv_state, norm and out are bf16, 0 when float32. qkv
 * [C], z [Hv Dv], b / a [Hv]: this token's projections; conv_w [C, K]; conv_state [C, K - 1] and state [Hv, Dk, Dv]
 * (float32) updated in place; neg_A (-exp(A_log)) and dt_bias float32 [Hv]; norm [Dv]; scratch float32 [C + 2 Hv +
 * 3 Hv Dv]; out [Hv Dv] the gated norm's output (before out_proj). Value heads go over the pool when the state is
 * worth it. kernel: sluice_deltanet_kernel's choice, made once per model (one above what this CPU runs is taken down
 * to it). */
void sluice_deltanet_step(int64_t nK, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K, int tiled, int bf16,
                          const void *qkv, const void *z, const void *b, const void *a, const void *conv_w,
                          void *conv_state, const float *neg_A, const float *dt_bias, const void *norm, float eps,
                          float *state, float *scratch, void *out, int kernel) {
    const int best = sluice_deltanet_kernel(0);
    kernel = kernel < best ? kernel : best;
    const int simd = kernel >= DN_AVX2;
    const int64_t C = 2 * nK * Dk + Hv * Dv;
    float *y = scratch, *beta = y + C, *decay = beta + Hv, *gate = decay + Hv, *work = gate + Hv * Dv;
    conv_step(C, K, qkv, conv_w, conv_state, bf16, simd, y);
    silu_all(y, C, bf16, simd);
    const float root = sqrtf((float)Dk);
    for (int64_t i = 0; i < 2 * nK; i++) {  /* q heads, then k heads */
        float *x = y + i * Dk;
        const float s = 1.0f / sqrtf(sum_squares(x, Dk) + DN_L2_EPS);
        for (int64_t d = 0; d < Dk; d++) x[d] = i < nK ? x[d] * s / root : x[d] * s;
    }
    for (int64_t h = 0; h < Hv; h++) {
        beta[h] = round_x(1.0f / (1.0f + expf(-load_x(b, h, bf16))), bf16);
        const float t = load_x(a, h, bf16) + dt_bias[h];
        decay[h] = expf(neg_A[h] * (t > 20.0f ? t : log1pf(expf(t))));
    }
    for (int64_t i = 0; i < Hv * Dv; i++) gate[i] = load_x(z, i, bf16);
    silu_all(gate, Hv * Dv, 0, simd);
    head_ctx c = {nK, Hv, Dk, Dv, Hv / nK, tiled != 0, bf16, kernel, y, y + nK * Dk, y + 2 * nK * Dk, beta, decay,
                  gate, norm, eps, state, work, out};
    if (Hv * Dk * Dv >= 65536) pool_run(head_task, &c, Hv);
    else
        for (int64_t h = 0; h < Hv; h++) head_task(&c, h);
}
