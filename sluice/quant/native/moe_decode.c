/* A decode token's MoE block in two native calls (models/layers/moe_decode.py): the router's top-k, then, once the
 * store has the experts' slots, the experts, the shared expert and the weighted sum. Each is the composition of the
 * calls the block made one by one from Python (decode.c's router and top-k, q8.c's experts, ops.c's sum), so each
 * result has their bits; what goes is the Python between them: ~10 hand-offs a layer, with their argument checks,
 * tensors and lists, which were about a third of a resident MoE block's ~480 us on the 2-core Intel VM
 * (benchmarks/results/hybrid/moe-decode.txt). */
#include <math.h>
#include <string.h>

#include "common.h"
#include "q8.h"
#include "topk.h"

void sluice_router_probs_bf16(int64_t E, int64_t H, const uint16_t *x, const uint16_t *w, float *probs, int scalar);
int sluice_topk_probs(int64_t E, const float *probs, int64_t k, int norm, int bf16, topk_fn ties, int64_t *ids,
                      float *wf, uint16_t *wb);
void sluice_combine_bf16(int64_t n, const float *ys, int64_t H, const void *w, int w_f32, const int64_t *at,
                         uint16_t *out, int scalar);
float sluice_dot_bf16(const uint16_t *x, const uint16_t *w, int64_t n, int scalar);  /* decode.c */

#define MOE_MAX_K 64

/* The softmax router's top k for one bf16 token x [H] (router w [E, H] bf16): sluice_router_probs_bf16 into probs
 * [E], then sluice_topk_probs (ids [k] by descending probability, weights wf [k] float32 and, when bf16, wb [k]),
 * and the same ids ascending into sorted [k] with at [k] their positions in ids (the block sums its experts in
 * ascending id). Returns 1, or 0 where sluice_topk_probs leaves the choice to torch.topk (a NaN; a tie without
 * `ties`): probs then holds the probabilities, nothing else is written. */
int sluice_moe_route_bf16(int64_t E, int64_t H, const uint16_t *x, const uint16_t *w, float *probs, int64_t k,
                          int norm, int bf16, topk_fn ties, int64_t *ids, float *wf, uint16_t *wb, int64_t *sorted,
                          int64_t *at, int scalar) {
    sluice_router_probs_bf16(E, H, x, w, probs, scalar);
    if (!sluice_topk_probs(E, probs, k, norm, bf16, ties, ids, wf, wb)) return 0;
    for (int64_t j = 0; j < k; j++) {  /* insertion by id: k <= 64, and the ids are distinct */
        int64_t i = j;
        for (; i > 0 && sorted[i - 1] > ids[j]; i--) sorted[i] = sorted[i - 1], at[i] = at[i - 1];
        sorted[i] = ids[j], at[i] = j;
    }
    return 1;
}

/* The shared expert's weight of a decode token: bf16(sigmoid(bf16(x . g))) for its gate g [H] bf16, as
 * torch.sigmoid(F.linear(x, g)) in bf16 gives it up to the dot's order (the router's logits differ from F.linear's
 * in the same way: decode.c); the value as bf16 bits. */
static uint16_t shared_weight(int64_t H, const uint16_t *x, const uint16_t *g, int scalar) {
    float v = bf16_float(bf16_round(sluice_dot_bf16(x, g, H, scalar)));
    return bf16_round(1.0f / (1.0f + expf(-v)));
}

uint16_t sluice_shared_weight_bf16(int64_t H, const uint16_t *x, const uint16_t *g, int scalar) {
    return shared_weight(H, x, g, scalar);
}

/* A layer's experts and sum between sluice_moe_experts_start and sluice_moe_experts_finish (the caller's memory,
 * sluice_moe_state_size bytes: one per layer, no state of the process's) */
typedef struct {
    experts_run r;
    int64_t d[10 * (MOE_MAX_K + 1)];  /* the experts' sluice_experts_q8 descriptions */
    int64_t H, n_sum, extra_row;
    const uint16_t *x, *gate;
    const void *w;
    const int64_t *at;
    const float *ys;
    uint16_t *out;
    int w_f32, has_shared, scalar;
} moe_state;

size_t sluice_moe_state_size(void) { return sizeof(moe_state); }

/* Experts of one layer on one token, and (n_sum > 0) the block's weighted sum.
 *   x [H] bf16, widened into xf [H] float32 when widen is 1 (a later call of the same token passes 0 and the same xf);
 *   expert e < n: its bytes at base + slots[e] * stride, gate, up and down at parts' offsets (parts: 3 x (format,
 *   offset, bytes per row)), its float32 output into ys row rows[e] ([R, H]); extra (9 values: format, address,
 *   bytes per row of gate, up, down) or NULL: the shared expert, into ys row extra_row; all of them in one
 *   sluice_experts_q8 call (P: its activation planes).
 * Then, when n_sum > 0: out [H] bf16 = 0, plus ys rows 0..n_sum-1 weighted by w[at[j]] (sluice_combine_bf16: rows in
 * ascending expert id), plus, when has_shared, row extra_row times the shared weight (gate [H] bf16, or 1 when gate
 * is NULL), added last, as the block adds it. sluice_moe_experts_start returns with the experts' first step (gate
 * and up rows) started on the pool's workers where it can, so the caller's thread can do other work meanwhile
 * (queue the next layer's guessed reads: models/layers/moe_decode.py); sluice_moe_experts_finish runs the rest and
 * the sum; the arguments stay valid until it returns. sluice_moe_experts_bf16 is the two back to back. Returns
 * sluice_experts_q8's code (0; -1 no scratch; -2 a format without an integer path), or -3 for n or n_sum above 64
 * or a negative count (nothing started: finish does nothing). */
int sluice_moe_experts_start(moe_state *st, int64_t n, const int64_t *slots, const int64_t *rows, const uint8_t *base,
                             int64_t stride, const int64_t *parts, const int64_t *extra, int64_t extra_row, int64_t H,
                             int64_t I, const uint16_t *x, float *xf, int widen, float *ys, int P, int64_t n_sum,
                             const void *w, int w_f32, const int64_t *at, int has_shared, const uint16_t *gate,
                             uint16_t *out, int scalar) {
    st->r.n = st->r.started = 0;
    st->n_sum = 0;
    if (n < 0 || n > MOE_MAX_K || n_sum < 0 || n_sum > MOE_MAX_K) return -3;
    if (widen)
        for (int64_t h = 0; h < H; h++) xf[h] = bf16_float(x[h]);
    int64_t *d = st->d, m = 0;
    for (int64_t e = 0; e < n; e++, m++) {
        const uint8_t *at0 = base + slots[e] * stride;
        for (int p = 0; p < 3; p++) {
            d[10 * m + 3 * p] = parts[3 * p];
            d[10 * m + 3 * p + 1] = (int64_t)(intptr_t)(at0 + parts[3 * p + 1]);
            d[10 * m + 3 * p + 2] = parts[3 * p + 2];
        }
        d[10 * m + 9] = (int64_t)(intptr_t)(ys + rows[e] * H);
    }
    if (extra) {
        memcpy(d + 10 * m, extra, 9 * sizeof(int64_t));
        d[10 * m + 9] = (int64_t)(intptr_t)(ys + extra_row * H);
        m++;
    }
    int rc = m ? experts_q8_start(&st->r, m, d, H, I, xf, 1, P, scalar) : 0;
    if (rc) return rc;
    /* the workers read st->d (the started experts' descriptions) until finish: the other fields one by one */
    st->H = H, st->n_sum = n_sum, st->extra_row = extra_row, st->x = x, st->gate = gate, st->w = w, st->at = at;
    st->ys = ys, st->out = out, st->w_f32 = w_f32, st->has_shared = has_shared, st->scalar = scalar;
    return 0;
}

void sluice_moe_experts_finish(moe_state *st) {
    experts_q8_finish(&st->r);
    int64_t H = st->H;
    if (st->n_sum) {
        memset(st->out, 0, (size_t)H * sizeof(uint16_t));
        sluice_combine_bf16(st->n_sum, st->ys, H, st->w, st->w_f32, st->at, st->out, st->scalar);
        if (st->has_shared) {
            uint16_t sw = st->gate ? shared_weight(H, st->x, st->gate, st->scalar) : (uint16_t)0x3F80;  /* bf16 1 */
            const int64_t zero = 0;
            sluice_combine_bf16(1, st->ys + st->extra_row * H, H, &sw, 0, &zero, st->out, st->scalar);
        }
    }
    st->n_sum = 0;
}

int sluice_moe_experts_bf16(int64_t n, const int64_t *slots, const int64_t *rows, const uint8_t *base, int64_t stride,
                            const int64_t *parts, const int64_t *extra, int64_t extra_row, int64_t H, int64_t I,
                            const uint16_t *x, float *xf, int widen, float *ys, int P, int64_t n_sum, const void *w,
                            int w_f32, const int64_t *at, int has_shared, const uint16_t *gate, uint16_t *out,
                            int scalar) {
    moe_state st;
    int rc = sluice_moe_experts_start(&st, n, slots, rows, base, stride, parts, extra, extra_row, H, I, x, xf, widen,
                                      ys, P, n_sum, w, w_f32, at, has_shared, gate, out, scalar);
    if (rc) return rc;
    sluice_moe_experts_finish(&st);
    return 0;
}
