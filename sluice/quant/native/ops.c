/* Small elementwise steps of a bf16 decode step, each bitwise what its torch expression computes (torch rounds a
 * bf16 op's float32 result to nearest even, as bf16_round does), in one native call instead of tens of torch ops
 * (~4-10 us each at one row here: a decode token of a 16-layer MoE ran ~2,300 of them). */
#include <math.h>

#include "common.h"

/* whether the AVX2 copies below run: the CPU has them and the caller's path cap (common.h; the model's
 * LoadOptions.isa) does not ask for the portable loops */
static inline int ops_simd(int scalar) { return SLUICE_X86 && sluice_avx2_ok(scalar) && sluice_simd(); }

/* The weighted sum of a token's expert outputs into out (bf16 [H], added to what it holds), in the order given:
 * for j = 0..n-1, out = bf16(out + bf16(p_j)) with p_j = bf16(ys[j]) * w[at[j]] (w bf16: the product rounded to
 * bf16; w float32: kept in float32), i.e. torch's `out += ((ys.to(bf16) * w).to(bf16))[j]`, row by row.
 * ys float32 [n, H]; w_f32: 1 when w is float32, 0 for bf16. The AVX2 loop takes 8 values a step with the same
 * roundings: the same bits. */
static float combine_weight(const void *w, int w_f32, int64_t a) {
    return w_f32 ? ((const float *)w)[a] : bf16_float(((const uint16_t *)w)[a]);
}

/* one value: bf16(o + bf16(bf16(y) * w)) */
static inline uint16_t combine_step(uint16_t o, float y, float w) {
    float p = bf16_float(bf16_round(bf16_float(bf16_round(y)) * w));
    return bf16_round(bf16_float(o) + p);
}

#if SLUICE_X86
AVX2 static void combine_avx2(int64_t n, const float *ys, int64_t H, const void *w, int w_f32, const int64_t *at,
                              uint16_t *out) {
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
        __m256 o = bf16x8(out + h);
        for (int64_t j = 0; j < n; j++) {
            __m256 p = _mm256_mul_ps(bf16_rounded8(_mm256_loadu_ps(ys + j * H + h)),
                                     _mm256_set1_ps(combine_weight(w, w_f32, at[j])));
            o = bf16_rounded8(_mm256_add_ps(o, bf16_rounded8(p)));
        }
        store_bf16x8(out + h, o);
    }
    for (; h < H; h++)
        for (int64_t j = 0; j < n; j++) out[h] = combine_step(out[h], ys[j * H + h], combine_weight(w, w_f32, at[j]));
}
#endif

void sluice_combine_bf16(int64_t n, const float *ys, int64_t H, const void *w, int w_f32, const int64_t *at,
                         uint16_t *out, int scalar) {
#if SLUICE_X86
    if (ops_simd(scalar)) {
        combine_avx2(n, ys, H, w, w_f32, at, out);
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++) {
        float wj = combine_weight(w, w_f32, at[j]);
        for (int64_t h = 0; h < H; h++) out[h] = combine_step(out[h], ys[j * H + h], wj);
    }
}

/* A prompt's weighted sum of expert outputs (models/layers/moe.py Experts): for each token t, from +0,
 * out[t] = bf16(out[t] + bf16(ys[a] * w[a])) for a = at[t*K + r], r = 0..K-1 in order; ys bf16 [T*K, H] (the
 * expert-sorted outputs), w bf16 or float32 (w_f32) [T*K] (each row's routing weight), at [T, K]. Bitwise torch's
 * `ys.mul_(w[:, None])` then `out = zeros; for r: out += ys[at[:, r]]`, which it replaces (8 gathers and adds of a
 * [T, H] block each); tokens in blocks over the pool, each row's successor prefetched while it is added (a 2,048-token
 * top-8 layer of H = 1024, caches flushed, 2 threads, Intel Xeon: 6.5-7.6 -> 4.7-5.0 ms,
 * `benchmarks/quantized/combine_rows.py`, benchmarks/results/quantized/breakdown/combine-rows.txt). */
typedef struct {
    int64_t T, K, H;
    const uint16_t *ys;
    const void *w;
    int w_f32;
    const int64_t *at;
    uint16_t *out;
    int scalar;
} combine_rows_job;

#define COMBINE_ROWS 32 /* tokens per pool task */

/* o[h] = bf16(o[h] + bf16(y[h] * wa)) for h in [h0, H) */
static void add_scaled_row(uint16_t *o, const uint16_t *y, float wa, int64_t h0, int64_t H) {
    for (int64_t h = h0; h < H; h++) {
        float p = bf16_float(bf16_round(bf16_float(y[h]) * wa));
        o[h] = bf16_round(bf16_float(o[h]) + p);
    }
}

#if SLUICE_X86
AVX2 static void add_scaled_row_avx2(uint16_t *o, const uint16_t *y, float wa, int64_t H) {
    const __m256 w = _mm256_set1_ps(wa);
    int64_t h = 0;
    for (; h + 8 <= H; h += 8)
        store_bf16x8(o + h, _mm256_add_ps(bf16x8(o + h), bf16_rounded8(_mm256_mul_ps(bf16x8(y + h), w))));
    add_scaled_row(o, y, wa, h, H);
}
#endif

static void combine_rows_task(void *c, int64_t i) {
    const combine_rows_job *j = (const combine_rows_job *)c;
    int64_t t1 = (i + 1) * COMBINE_ROWS < j->T ? (i + 1) * COMBINE_ROWS : j->T;
    for (int64_t t = i * COMBINE_ROWS; t < t1; t++) {
        uint16_t *o = j->out + t * j->H;
        for (int64_t h = 0; h < j->H; h++) o[h] = 0;  /* +0 */
        for (int64_t r = 0; r < j->K; r++) {
            int64_t a = j->at[t * j->K + r];
            if (t * j->K + r + 1 < t1 * j->K) {  /* the next row's bytes towards the cache (rows land anywhere) */
                const uint8_t *nx = (const uint8_t *)(j->ys + j->at[t * j->K + r + 1] * j->H);
                for (int64_t o = 0; o < 2 * j->H; o += 64) __builtin_prefetch(nx + o, 0, 3);
            }
            float wa = j->w_f32 ? ((const float *)j->w)[a] : bf16_float(((const uint16_t *)j->w)[a]);
            const uint16_t *y = j->ys + a * j->H;
#if SLUICE_X86
            if (ops_simd(j->scalar)) {
                add_scaled_row_avx2(o, y, wa, j->H);
                continue;
            }
#endif
            add_scaled_row(o, y, wa, 0, j->H);
        }
    }
}

void sluice_combine_rows_bf16(int64_t T, int64_t K, int64_t H, const uint16_t *ys, const void *w, int w_f32,
                              const int64_t *at, uint16_t *out, int scalar) {
    combine_rows_job j = {T, K, H, ys, w, w_f32, at, out, scalar};
    pool_run(combine_rows_task, &j, (T + COMBINE_ROWS - 1) / COMBINE_ROWS);
}

/* RMSNorm of rows of bf16 x ([rows, n]) with bf16 weight [n], as the reference computes it: statistics in float32,
 * the normalized row rounded to bf16, then times the weight (rounded to bf16). The sum of squares runs in 8 float
 * lanes (value i into lane i % 8, a product then a sum, lanes added ((0+4)+(2+6))+((1+5)+(3+7))), a fixed order
 * whatever the compiler vectorizes; torch's mean sums in another order, so a row can differ from the torch
 * expression in the last bit of its scale (relative ~1e-7), never by more. The AVX2 copy runs the same operations,
 * 8 lanes at a time; rows go over the pool (a prompt's [T, H] and q / k norms: 0.101 s of a peers Q4_K_M 2,048-token
 * prompt on one thread, scalar, 0.025 s this way: `benchmarks/prefill/knobs.py profile` at a19c08e and after). out
 * may be x. */
/* values [i, n) of x squared into lane[v % 8], in order */
static void square_lanes(const uint16_t *x, int64_t i, int64_t n, float *lane) {
    for (; i < n; i++) {
        float v = bf16_float(x[i]);
        lane[i % 8] = lane[i % 8] + v * v;
    }
}

static float rms_scale(const float *lane, int64_t n, float eps) { return 1.0f / sqrtf(reduce8(lane) / (float)n + eps); }

/* out[k] = bf16(w[k] * bf16(x[k] * scale)) for k from j to n - 1 */
static void scale_row(const uint16_t *x, const uint16_t *w, int64_t j, int64_t n, float scale, uint16_t *out) {
    for (; j < n; j++) out[j] = bf16_round(bf16_float(w[j]) * bf16_float(bf16_round(bf16_float(x[j]) * scale)));
}

/* out[k] = bf16((x[k] * scale) * w[k]) for k from j to n - 1: a float32 weight, one rounding (the zero-centred norm) */
static void scale_row_f32(const uint16_t *x, const float *w, int64_t j, int64_t n, float scale, uint16_t *out) {
    for (; j < n; j++) out[j] = bf16_round(bf16_float(x[j]) * scale * w[j]);
}

/* w bf16, or float32 when w_f32 */
static void rms_norm_row(const uint16_t *x, const void *w, int w_f32, int64_t n, float eps, uint16_t *out) {
    float lane[8] = {0};
    square_lanes(x, 0, n, lane);
    if (w_f32)
        scale_row_f32(x, w, 0, n, rms_scale(lane, n, eps), out);
    else
        scale_row(x, w, 0, n, rms_scale(lane, n, eps), out);
}

#if SLUICE_X86
AVX2 static void rms_norm_row_avx2(const uint16_t *x, const void *w, int w_f32, int64_t n, float eps,
                                   uint16_t *out) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = bf16x8(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    square_lanes(x, i, n, lane);
    float scale = rms_scale(lane, n, eps);
    const __m256 sv = _mm256_set1_ps(scale);
    int64_t j = 0;
    if (w_f32) {
        const float *wf = w;
        for (; j + 8 <= n; j += 8)
            store_bf16x8(out + j, _mm256_mul_ps(_mm256_mul_ps(bf16x8(x + j), sv), _mm256_loadu_ps(wf + j)));
        scale_row_f32(x, wf, j, n, scale, out);
        return;
    }
    const uint16_t *wb = w;
    for (; j + 8 <= n; j += 8)
        store_bf16x8(out + j, _mm256_mul_ps(bf16x8(wb + j), bf16_rounded8(_mm256_mul_ps(bf16x8(x + j), sv))));
    scale_row(x, wb, j, n, scale, out);
}
#endif

typedef struct {
    int64_t rows, n, per_task;
    const uint16_t *x;
    const void *w;
    int w_f32;
    float eps;
    uint16_t *out;
    int scalar;
} rms_job;

#define OPS_TASK_ELEMS 32768 /* elements per pool task: enough work to be worth another thread */

static void rms_task(void *c, int64_t i) {
    const rms_job *j = (const rms_job *)c;
    int64_t r1 = (i + 1) * j->per_task < j->rows ? (i + 1) * j->per_task : j->rows;
    for (int64_t r = i * j->per_task; r < r1; r++) {
#if SLUICE_X86
        if (ops_simd(j->scalar)) {
            rms_norm_row_avx2(j->x + r * j->n, j->w, j->w_f32, j->n, j->eps, j->out + r * j->n);
            continue;
        }
#endif
        rms_norm_row(j->x + r * j->n, j->w, j->w_f32, j->n, j->eps, j->out + r * j->n);
    }
}

static void rms_rows(int64_t rows, int64_t n, const uint16_t *x, const void *w, int w_f32, float eps, uint16_t *out,
                     int scalar) {
    int64_t per = n > 0 && OPS_TASK_ELEMS / n > 1 ? OPS_TASK_ELEMS / n : 1;
    rms_job j = {rows, n, per, x, w, w_f32, eps, out, scalar};
    pool_run(rms_task, &j, (rows + per - 1) / per);
}

void sluice_rms_norm_bf16(int64_t rows, int64_t n, const uint16_t *x, const uint16_t *w, float eps, uint16_t *out,
                          int scalar) {
    rms_rows(rows, n, x, w, 0, eps, out, scalar);
}

/* The zero-centred RMSNorm (Qwen3-Next, Qwen3.5; models/layers/norm.py Norm): the same statistics, then
 * out = bf16((x * scale) * w) with w float32 [n] (1 + the stored weight, computed once by the caller): one rounding,
 * the reference's order. */
void sluice_rms_norm_scaled_bf16(int64_t rows, int64_t n, const uint16_t *x, const float *w, float eps, uint16_t *out,
                                 int scalar) {
    rms_rows(rows, n, x, w, 1, eps, out, scalar);
}

/* Rotary embedding of bf16 x [heads, T, D] (element (h, t, d) at x + h * sh + t * st + d) by bf16 cos / sin
 * [T, rot] on its first rot dims, into out (contiguous [heads, T, D]): torch's
 *   out = x * cos + cat(-x[rot/2:], x[:rot/2]) * sin      (bf16 ops: each product and the sum rounded to bf16)
 * on the first rot dims, the rest copied. The AVX2 copy runs the same operations 8 dims at a time; (head, token)
 * rows go over the pool. */
static void rope_span(const uint16_t *xr, const uint16_t *c, const uint16_t *s, uint16_t *o, int64_t d0, int64_t d1,
                      int64_t half) {
    for (int64_t d = d0; d < d1; d++) {
        float r = d < half ? -bf16_float(xr[d + half]) : bf16_float(xr[d - half]);
        float a = bf16_float(bf16_round(bf16_float(xr[d]) * bf16_float(c[d])));
        float b = bf16_float(bf16_round(r * bf16_float(s[d])));
        o[d] = bf16_round(a + b);
    }
}

#if SLUICE_X86
/* dims [d0, d0 + 8k) of one row, the partner dims at xr + d + off, negated when neg */
AVX2 static int64_t rope_span_avx2(const uint16_t *xr, const uint16_t *c, const uint16_t *s, uint16_t *o, int64_t d0,
                                   int64_t d1, int64_t off, int neg) {
    const __m256 sign = _mm256_set1_ps(neg ? -0.0f : 0.0f);
    int64_t d = d0;
    for (; d + 8 <= d1; d += 8) {
        __m256 r = _mm256_xor_ps(bf16x8(xr + d + off), sign);
        __m256 a = bf16_rounded8(_mm256_mul_ps(bf16x8(xr + d), bf16x8(c + d)));
        __m256 b = bf16_rounded8(_mm256_mul_ps(r, bf16x8(s + d)));
        store_bf16x8(o + d, _mm256_add_ps(a, b));
    }
    return d;
}
#endif

static void rope_row(const uint16_t *xr, const uint16_t *c, const uint16_t *s, uint16_t *o, int64_t D, int64_t rot,
                     int scalar) {
    const int64_t half = rot / 2;
    int64_t d = 0, e = half;
#if SLUICE_X86
    if (ops_simd(scalar)) {
        d = rope_span_avx2(xr, c, s, o, 0, half, half, 1);
        e = rope_span_avx2(xr, c, s, o, half, rot, -half, 0);
    }
#endif
    rope_span(xr, c, s, o, d, half, half);
    rope_span(xr, c, s, o, e, rot, half);
    for (int64_t k = rot; k < D; k++) o[k] = xr[k];
}

typedef struct {
    int64_t heads, T, D, rot, sh, st, per_task;
    const uint16_t *x, *cos, *sin;
    uint16_t *out;
    int scalar;
} rope_job;

static void rope_task(void *c, int64_t i) {
    const rope_job *j = (const rope_job *)c;
    int64_t n = j->heads * j->T, r1 = (i + 1) * j->per_task < n ? (i + 1) * j->per_task : n;
    for (int64_t r = i * j->per_task; r < r1; r++) {
        int64_t h = r / j->T, t = r % j->T;
        rope_row(j->x + h * j->sh + t * j->st, j->cos + t * j->rot, j->sin + t * j->rot, j->out + r * j->D, j->D,
                 j->rot, j->scalar);
    }
}

void sluice_rope_bf16(int64_t heads, int64_t T, int64_t D, int64_t rot, const uint16_t *x, int64_t sh, int64_t st,
                      const uint16_t *cos, const uint16_t *sin, uint16_t *out, int scalar) {
    int64_t per = D > 0 && OPS_TASK_ELEMS / D > 1 ? OPS_TASK_ELEMS / D : 1;
    rope_job j = {heads, T, D, rot, sh, st, per, x, cos, sin, out, scalar};
    pool_run(rope_task, &j, (heads * T + per - 1) / per);
}

/* out = bf16(a + b) elementwise over n bf16 values (torch's `a + b` on bf16 tensors: float32 sum, rounded to
 * nearest even), in blocks over the pool: a prompt's residual adds ([2,048 x 1,024] took 1.0 ms in torch on AVX2:
 * benchmarks/results/quantized/breakdown/prompt-profile-2.txt; out may be a or b) */
typedef struct {
    const uint16_t *a, *b;
    uint16_t *out;
    int64_t n;
    int scalar;
} add_job;

#define ADD_BLOCK 16384 /* values a pool task */

#if SLUICE_X86
AVX2 static void add_avx2(const uint16_t *a, const uint16_t *b, uint16_t *o, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store_bf16x8(o + i, _mm256_add_ps(bf16x8(a + i), bf16x8(b + i)));
    for (; i < n; i++) o[i] = bf16_round(bf16_float(a[i]) + bf16_float(b[i]));
}
#endif

static void add_task(void *c, int64_t t) {
    const add_job *j = (const add_job *)c;
    int64_t i0 = t * ADD_BLOCK, i1 = i0 + ADD_BLOCK < j->n ? i0 + ADD_BLOCK : j->n;
#if SLUICE_X86
    if (ops_simd(j->scalar)) {
        add_avx2(j->a + i0, j->b + i0, j->out + i0, i1 - i0);
        return;
    }
#endif
    for (int64_t i = i0; i < i1; i++) j->out[i] = bf16_round(bf16_float(j->a[i]) + bf16_float(j->b[i]));
}

void sluice_add_bf16(int64_t n, const uint16_t *a, const uint16_t *b, uint16_t *out, int scalar) {
    add_job j = {a, b, out, n, scalar};
    if (n > 0) pool_run(add_task, &j, (n + ADD_BLOCK - 1) / ADD_BLOCK);
}

/* out = x widened, n bf16 values to float32 (exact: the same bits as torch's x.float()), in blocks over the pool: a
 * prompt's rows for a float32 GEMM (the router's [2,048 x 1,024], one of the 48 such copies of a prompt of the peers
 * model at 1.96 ms each in torch on AVX2: benchmarks/results/quantized/breakdown/prompt-profile-2.txt) */
typedef struct {
    const uint16_t *x;
    float *out;
    int64_t n;
    int scalar;
} widen_job;

#if SLUICE_X86
AVX2 static void widen_avx2(const uint16_t *x, float *o, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, bf16x8(x + i));
    for (; i < n; i++) o[i] = bf16_float(x[i]);
}
#endif

static void widen_task(void *c, int64_t t) {
    const widen_job *j = (const widen_job *)c;
    int64_t i0 = t * ADD_BLOCK, i1 = i0 + ADD_BLOCK < j->n ? i0 + ADD_BLOCK : j->n;
#if SLUICE_X86
    if (ops_simd(j->scalar)) {
        widen_avx2(j->x + i0, j->out + i0, i1 - i0);
        return;
    }
#endif
    for (int64_t i = i0; i < i1; i++) j->out[i] = bf16_float(j->x[i]);
}

void sluice_bf16_to_f32(int64_t n, const uint16_t *x, float *out, int scalar) {
    widen_job j = {x, out, n, scalar};
    if (n > 0) pool_run(widen_task, &j, (n + ADD_BLOCK - 1) / ADD_BLOCK);
}
