/* One decode token's attention core and softmax router probabilities in bf16, each one native call. At one token
 * these are tiny (a 16-layer model's q/k norms, rope, cache writes and attention over a few hundred positions: well
 * under a millisecond of arithmetic) but took ~30 torch ops per layer: on the peers Q4_K_M model, resident, 30.3
 * against 25.3 ms/token with these calls (`benchmarks/knobs.py arms`; benchmarks/quantized/decode_ops.py counted
 * the ops, a removed script: its command is in benchmarks/results/quantized/README.md).
 *
 * Numerics: norms and rope are ops.c's functions (rope bitwise the torch expression, rms_norm to the last bit of a
 * row's scale). The attention computes in float32 from the bf16 q, k and v: scores q . k (8 lanes, a fixed order)
 * times 1 / sqrt(D), softmax with the row max subtracted (plus the head's sink logit in the denominator when the
 * model has sinks), the probability-weighted sum of v, one rounding to bf16 at the end. torch's SDPA gets the same
 * value to within its own bf16 rounding (it rounds the probabilities to bf16 before multiplying v); the router's
 * logits are rounded to bf16 as F.linear's are, then softmax runs in float32 as routing.softmax_topk does; their
 * sums run in another order than F.linear's, so a logit may land one bf16 step away from torch's and a near-tie
 * between two experts resolve the other way (the streamed and resident runs share this code, so they agree
 * bitwise). */
#include <math.h>
#include <string.h>

#include "common.h"
#include "topk.h"

/* sum of a[d] * b[d] over n bf16 values in 8 float lanes (value d into lane d % 8, a product then a sum: no fused
 * multiply-add), the lanes added by reduce8; the AVX2 copy does the same operations in one vector */
static float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t n) {
    float lane[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int l = 0; l < 8; l++) lane[l] = lane[l] + bf16_float(a[d + l]) * bf16_float(b[d + l]);
    for (; d < n; d++) lane[d % 8] = lane[d % 8] + bf16_float(a[d]) * bf16_float(b[d]);
    return reduce8(lane);
}

/* acc[d] += w * v[d] over n bf16 values */
static void axpy_bf16(float w, const uint16_t *v, float *acc, int64_t n) {
    for (int64_t d = 0; d < n; d++) acc[d] = acc[d] + w * bf16_float(v[d]);
}

#if SLUICE_X86
AVX2 static float dot_bf16_avx2(const uint16_t *a, const uint16_t *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(bf16x8(a + d), bf16x8(b + d)));
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    for (; d < n; d++) lane[d % 8] = lane[d % 8] + bf16_float(a[d]) * bf16_float(b[d]);
    return reduce8(lane);
}

AVX2 static void axpy_bf16_avx2(float w, const uint16_t *v, float *acc, int64_t n) {
    const __m256 wv = _mm256_set1_ps(w);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(wv, bf16x8(v + d))));
    for (; d < n; d++) acc[d] = acc[d] + w * bf16_float(v[d]);
}
#endif

typedef float (*dot_fn)(const uint16_t *, const uint16_t *, int64_t);
typedef void (*axpy_fn)(float, const uint16_t *, float *, int64_t);

/* the AVX2 copies where the CPU has them (the same bits), else the portable ones; scalar 1 forces those */
static void pick(int scalar, dot_fn *dot, axpy_fn *axpy) {
    *dot = dot_bf16;
    *axpy = axpy_bf16;
#if SLUICE_X86
    if (sluice_avx2_ok(scalar) && sluice_simd()) *dot = dot_bf16_avx2, *axpy = axpy_bf16_avx2;
#else
    (void)scalar;
#endif
}

/* one bf16 dot in float32 on the path `scalar` picks (moe_decode.c's shared-expert gate) */
float sluice_dot_bf16(const uint16_t *x, const uint16_t *w, int64_t n, int scalar) {
    dot_fn dot;
    axpy_fn axpy;
    pick(scalar, &dot, &axpy);
    return dot(x, w, n);
}

typedef struct {
    int64_t nH, group, D, n, sh, sp;
    const uint16_t *q, *ck, *cv;  /* q [nH, D] (normed, rotated); the caches from position lo */
    float scale;
    const float *sinks;  /* [nH] or NULL */
    float *scratch;      /* [nH, n + D] */
    uint16_t *out;       /* [nH, D] */
    dot_fn dot;
    axpy_fn axpy;
} attn_ctx;

static void head_task(void *c, int64_t h) {
    const attn_ctx *a = c;
    const int64_t D = a->D, n = a->n;
    const uint16_t *q = a->q + h * D, *kb = a->ck + h / a->group * a->sh, *vb = a->cv + h / a->group * a->sh;
    float *s = a->scratch + h * (n + D), *acc = s + n;
    float mx = a->sinks ? a->sinks[h] : -INFINITY;
    for (int64_t p = 0; p < n; p++) {
        s[p] = a->dot(q, kb + p * a->sp, D) * a->scale;
        if (s[p] > mx) mx = s[p];
    }
    float sum = a->sinks ? expf(a->sinks[h] - mx) : 0.0f;
    for (int64_t p = 0; p < n; p++) {
        s[p] = expf(s[p] - mx);
        sum = sum + s[p];
    }
    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (int64_t p = 0; p < n; p++) a->axpy(s[p], vb + p * a->sp, acc, D);
    for (int64_t d = 0; d < D; d++) a->out[h * D + d] = bf16_round(acc[d] / sum);
}

static void clip_bf16(uint16_t *x, int64_t n, float c) {  /* torch's x.clamp(-c, c) on bf16 */
    const uint16_t lo = bf16_round(-c), hi = bf16_round(c);
    for (int64_t i = 0; i < n; i++) {
        float f = bf16_float(x[i]);
        if (f < bf16_float(lo)) x[i] = lo;
        else if (f > bf16_float(hi)) x[i] = hi;
    }
}

/* RMSNorm of rows of x in place: weights bf16 (ops.c's norm), or float32 scales in one rounding (w_f32: the
 * zero-centred norm, 1 + the stored weight) */
static void norm_rows(int64_t rows, int64_t n, uint16_t *x, const void *w, int w_f32, float eps, int scalar) {
    if (w_f32)
        sluice_rms_norm_scaled_bf16(rows, n, x, w, eps, x, scalar);
    else
        sluice_rms_norm_bf16(rows, n, x, w, eps, x, scalar);
}

/* out[i] = bf16(out[i] * bf16(sigmoid(gate[i]))) for i in [i, n): gated attention's `o * torch.sigmoid(gate)` on bf16
 * (sigmoid 1 / (1 + exp_poly(-g)); torch's exp is within 1 ulp of e^x, this within 2, so a rounded sigmoid may land
 * one bf16 step from torch's) */
static void gate_tail(uint16_t *out, const uint16_t *gate, int64_t i, int64_t n) {
    for (; i < n; i++) {
        float s = bf16_float(bf16_round(1.0f / (1.0f + exp_poly(-bf16_float(gate[i])))));
        out[i] = bf16_round(bf16_float(out[i]) * s);
    }
}

#if SLUICE_X86
AVX2 static void gate_avx2(uint16_t *out, const uint16_t *gate, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 s = bf16_rounded8(_mm256_div_ps(one, _mm256_add_ps(one, exp_poly8(_mm256_xor_ps(bf16x8(gate + i),
                                                                                               sign)))));
        store_bf16x8(out + i, _mm256_mul_ps(bf16x8(out + i), s));
    }
    gate_tail(out, gate, i, n);
}
#endif

static void gate_bf16(uint16_t *out, const uint16_t *gate, int64_t n, int scalar) {
#if SLUICE_X86
    if (sluice_avx2_ok(scalar) && sluice_simd()) {
        gate_avx2(out, gate, n);
        return;
    }
#else
    (void)scalar;
#endif
    gate_tail(out, gate, 0, n);
}

/* Attention of one decode token at position pos over cache positions lo..pos, in the steps of
 * models/layers/attention.py Attention. q [nH * D], k and v [nKV * D]: bf16, the projections' outputs (q and k
 * are overwritten by their normed values). Steps:
 *   norm_mode 2 ("full"): q and k each over its whole row, weights qn [nH * D] / kn [nKV * D];
 *   clip >= 0: q, k and v clamped to +-clip (-1: none);
 *   norm_mode 1 ("head"): per head, weights qn / kn [D];
 *   (the norms' weights bf16, or norm_f32: float32 scales applied in one rounding, the zero-centred norm's form)
 *   rope by the tables cos / sin [P, rot] (row pos) on the first rot dims;
 *   k and v written to the caches ck / cv at (head g, pos), element (g, p, d) at g * sh + p * sp + d;
 *   attention -> out [nH * D] bf16;
 *   gate not NULL (gated attention, bf16 [nH * D]): out times sigmoid(gate), each rounded to bf16 (gate_bf16).
 * sinks: [nH] float32 (the sink logits, already rounded to bf16) or NULL. rq: bf16 scratch [(nH + nKV) * D];
 * scratch: float32 [nH * (n + D)] with n = pos - lo + 1. Heads go over the pool when the scores are worth it.
 * scalar: common.h's path cap (1: the portable loops). */
void sluice_attend_bf16(int64_t nH, int64_t nKV, int64_t D, int64_t rot, uint16_t *q, uint16_t *k, const uint16_t *v,
                        int norm_mode, const void *qn, const void *kn, int norm_f32, float eps, float clip,
                        const uint16_t *cos, const uint16_t *sin, uint16_t *ck, uint16_t *cv, int64_t sh, int64_t sp,
                        int64_t pos, int64_t lo, const float *sinks, uint16_t *rq, float *scratch,
                        const uint16_t *gate, uint16_t *out, int scalar) {
    if (norm_mode == 2) {
        norm_rows(1, nH * D, q, qn, norm_f32, eps, scalar);
        norm_rows(1, nKV * D, k, kn, norm_f32, eps, scalar);
    }
    if (clip >= 0.0f) {
        clip_bf16(q, nH * D, clip);
        clip_bf16(k, nKV * D, clip);
    }
    if (norm_mode == 1) {
        norm_rows(nH, D, q, qn, norm_f32, eps, scalar);
        norm_rows(nKV, D, k, kn, norm_f32, eps, scalar);
    }
    uint16_t *rk = rq + nH * D;
    sluice_rope_bf16(nH, 1, D, rot, q, D, 0, cos + pos * rot, sin + pos * rot, rq, scalar);
    sluice_rope_bf16(nKV, 1, D, rot, k, D, 0, cos + pos * rot, sin + pos * rot, rk, scalar);
    for (int64_t g = 0; g < nKV; g++) {  /* v is clipped on its way into the cache (the caller's v is kept) */
        memcpy(cv + g * sh + pos * sp, v + g * D, 2 * D);
        if (clip >= 0.0f) clip_bf16(cv + g * sh + pos * sp, D, clip);
        memcpy(ck + g * sh + pos * sp, rk + g * D, 2 * D);
    }
    attn_ctx a = {nH, nH / nKV, D, pos - lo + 1, sh, sp, rq, ck + lo * sp, cv + lo * sp, 1.0f / sqrtf((float)D),
                  sinks, scratch, out, NULL, NULL};
    pick(scalar, &a.dot, &a.axpy);
    if (nH * a.n * D >= 65536) pool_run(head_task, &a, nH);
    else
        for (int64_t h = 0; h < nH; h++) head_task(&a, h);
    if (gate) gate_bf16(out, gate, nH * D, scalar);
}

/* the logits of router rows [e0, e1) into probs (sluice_router_probs_bf16's first loop) */
typedef struct {
    int64_t E, H, per;
    const uint16_t *x, *w;
    float *probs;
    dot_fn dot;
} logits_t;

static void logits_task(void *ctx, int64_t i) {
    const logits_t *a = ctx;
    int64_t e1 = (i + 1) * a->per < a->E ? (i + 1) * a->per : a->E;
    for (int64_t e = i * a->per; e < e1; e++) {
#if SLUICE_X86
        /* the next row's lines requested ahead: the router sits in memory the layer's experts pushed out of the
         * caches (breakdown.py moe: `router`) */
        if (e + 1 < e1)
            for (int64_t b = 0; b < 2 * a->H; b += 64)
                _mm_prefetch((const char *)(a->w + (e + 1) * a->H) + b, _MM_HINT_T0);
#endif
        a->probs[e] = bf16_float(bf16_round(a->dot(a->x, a->w + e * a->H, a->H)));
    }
}

/* rows per task of the logits: the router's 256 KiB (256 experts x 512 bf16) read from memory in 4 tasks over the
 * native threads (one row a task costs more in hand-offs than it saves) */
#define LOGIT_ROWS 64

/* The softmax router's probabilities for one token (routing.softmax_topk's first two steps): logits = bf16(x . w_e)
 * for the E rows of w [E, H] (x and w bf16, rounded as F.linear's bf16 output is), then softmax in float32 into
 * probs [E]. Equal logits give equal probabilities and the order of unequal ones is kept, so torch.topk over them
 * picks what it picks over torch's own probabilities of the same logits (ties included). The logits in tasks of
 * LOGIT_ROWS rows over the pool (each the same dot whichever thread runs it: the same bits), the router cold in
 * memory at decode: the issue-30 UD file's streamed token, router and guess this way against on the model's thread
 * alone, paired -1.50 ms a token, 15 of 24 rounds faster (Intel Xeon AMX VM, 2 cores, noisy: the arms' medians
 * 63.70 / 62.99; benchmarks/results/hybrid/router-ab.txt). */
void sluice_router_probs_bf16(int64_t E, int64_t H, const uint16_t *x, const uint16_t *w, float *probs, int scalar) {
    dot_fn dot;
    axpy_fn axpy;
    pick(scalar, &dot, &axpy);
    logits_t a = {E, H, LOGIT_ROWS, x, w, probs, dot};
    pool_run(logits_task, &a, (E + LOGIT_ROWS - 1) / LOGIT_ROWS);
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; e++)
        if (probs[e] > mx) mx = probs[e];
    float sum = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        probs[e] = expf(probs[e] - mx);
        sum = sum + probs[e];
    }
    for (int64_t e = 0; e < E; e++) probs[e] = probs[e] / sum;
}

/* The rest of routing.top_of_probs for those probabilities, where it has one answer: the k largest of probs [E] in
 * descending order (ids [k], as torch.topk's), their weights [k] in float32 (divided by their sum when `norm`: the
 * sum in index order from 0, as torch 2.13's sum of k = 1, 2, 4 or 8 float32 values runs (not of 6 or 10: another
 * k with `norm` returns 0; tests/quant/test_decode.py holds torch to it) and, when `bf16` is 1, rounded to bf16 into
 * wb [k] as torch's .to(bfloat16). Two equal values among the k largest or between the k-th and the next (ties)
 * are resolved by `ties`, torch.topk's order (topk.cc: the same standard-library calls on the same pairs; decode.py
 * ties_exact checks it against torch once per process); where `ties` is NULL a tie returns 0 without writing and
 * the caller runs torch.topk on probs. Returns 1, or 0 for a NaN (torch's to rank) or such a tie. One call instead
 * of 4 torch ops, slow with the caches cold after the experts (breakdown.py moe: `topk`). */
int sluice_topk_probs(int64_t E, const float *probs, int64_t k, int norm, int bf16, topk_fn ties, int64_t *ids,
                      float *wf, uint16_t *wb) {
    if (k < 1 || k > 64 || k > E || (norm && k != 1 && k != 2 && k != 4 && k != 8)) return 0;
    int64_t id[64], n = 0;
    /* v: the k largest so far, descending (k <= E fills them all; zeroed for gcc's -Wmaybe-uninitialized, which
     * cannot see that); out: the largest of the others */
    float v[64] = {0}, out = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        float p = probs[e];
        if (p != p) return 0;
        if (n == k) {
            if (p <= v[k - 1]) {
                out = p > out ? p : out;
                continue;
            }
            out = v[k - 1] > out ? v[k - 1] : out;  /* the k-th drops out */
            n--;
        }
        int64_t at = n++;
        for (; at > 0 && v[at - 1] < p; at--) v[at] = v[at - 1], id[at] = id[at - 1];
        v[at] = p, id[at] = e;
    }
    int tied = out == v[k - 1];
    for (int64_t j = 1; j < k; j++) tied |= v[j] == v[j - 1];
    if (tied && !(ties && ties(E, probs, k, id, v))) return 0;
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) sum = sum + v[j];
    for (int64_t j = 0; j < k; j++) {
        ids[j] = id[j];
        wf[j] = norm ? v[j] / sum : v[j];
        if (bf16) wb[j] = bf16_round(wf[j]);
    }
    return 1;
}

/* A decode token's guess of the next MoE layer's experts (prerouter/predict.py RouterPrerouter.predict) in one call:
 * hb [H] = the zero-centred RMSNorm of x [H] by scale [H] (sluice_rms_norm_scaled_bf16 on the norm's path
 * norm_scalar), probs [E] = the router's softmax of hb (sluice_router_probs_bf16 on `scalar`), ids [k] = the k
 * largest (sluice_topk_probs, descending, ties by `ties`; wf [k] their probabilities). Returns 1, or 0 where
 * topk_probs leaves the choice to torch.topk (a NaN; ties where `ties` is NULL): probs then holds the probabilities.
 * The same bits as the three calls, one hand-off from Python where there were four (the norm, the router,
 * torch.topk and its index tensor): the guess took 2.98-3.39 ms of a streamed token's model thread on the 2-core
 * AMD EPYC, 2.38-2.43 this way (benchmarks/results/hybrid/fused-guess.txt). */
int sluice_guess_bf16(int64_t E, int64_t H, const uint16_t *x, const float *scale, float eps, int norm_scalar,
                      const uint16_t *w, int64_t k, topk_fn ties, uint16_t *hb, float *probs, int64_t *ids, float *wf,
                      int scalar) {
    sluice_rms_norm_scaled_bf16(1, H, x, scale, eps, hb, norm_scalar);
    sluice_router_probs_bf16(E, H, hb, w, probs, scalar);
    return sluice_topk_probs(E, probs, k, 0, 0, ties, ids, wf, NULL);
}

/* sluice_guess_bf16 with its arguments but x in a[0..13] (decode.py Guess.packed: in its order, a[2] unused, eps as
 * its float's bits, pointers as addresses), for C code calling it through a pointer (store/stream.c's decode layer) */
int sluice_guess_packed(const int64_t *a, const uint16_t *x) {
    const uint32_t bits = (uint32_t)a[4];
    float eps;
    memcpy(&eps, &bits, sizeof eps);
    return sluice_guess_bf16(a[0], a[1], x, (const float *)(intptr_t)a[3], eps, (int)a[5],
                             (const uint16_t *)(intptr_t)a[6], a[7], (topk_fn)(intptr_t)a[8], (uint16_t *)(intptr_t)a[9],
                             (float *)(intptr_t)a[10], (int64_t *)(intptr_t)a[11], (float *)(intptr_t)a[12], (int)a[13]);
}
