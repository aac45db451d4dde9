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
void sluice_bf16_to_f32(int64_t n, const uint16_t *x, float *out, int scalar);  /* ops.c */
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
uint16_t sluice_shared_weight_bf16(int64_t H, const uint16_t *x, const uint16_t *g, int scalar) {
    float v = bf16_float(bf16_round(sluice_dot_bf16(x, g, H, scalar)));
    return bf16_round(1.0f / (1.0f + expf(-v)));
}

/* The arguments of sluice_moe_experts, every one 64 bits (a ctypes Structure the caller keeps and fills: most
 * stay the same from token to token, and one pointer crosses from Python instead of 23 converted values).
 *   x [H] bf16, widened into xf [H] float32 when widen is 1 (a later call of the same token passes 0 and the same xf);
 *   expert e < n: its bytes at base + slots[e] * stride, gate, up and down at parts' offsets (parts: 3 x (format,
 *   offset, bytes per row)), its float32 output into ys row rows[e] ([R, H]); extra (9 values: format, address,
 *   bytes per row of gate, up, down) or NULL: the shared expert, into ys row extra_row; all of them in one
 *   sluice_experts_q8 call (P: its activation planes).
 * Then, when n_sum > 0: out [H] bf16 = 0, plus ys rows 0..n_sum-1 weighted by w[at[j]] (sluice_combine_bf16: rows in
 * ascending expert id; w float32 when w_f32, else bf16), plus, when has_shared, row extra_row times the shared
 * weight (gate [H] bf16, or 1 when gate is NULL), added last, as the block adds it. */
typedef struct {
    int64_t n;
    const int64_t *slots, *rows;
    const uint8_t *base;
    int64_t stride;
    const int64_t *parts, *extra;
    int64_t extra_row, H, I;
    const uint16_t *x;
    float *xf;
    int64_t widen;
    float *ys;
    int64_t P, n_sum;
    const void *w;
    int64_t w_f32;
    const int64_t *at;
    int64_t has_shared;
    const uint16_t *gate;
    uint16_t *out;
    int64_t scalar;
} moe_args;

/* A layer's experts and sum between sluice_moe_experts and sluice_moe_finish (the caller's memory,
 * sluice_moe_state_size bytes: one per layer, no state of the process's) */
typedef struct {
    experts_run r;
    int64_t d[10 * (MOE_MAX_K + 1)];  /* the experts' sluice_experts_q8 descriptions */
    moe_args a;                       /* the sum's arguments */
} moe_state;

size_t sluice_moe_state_size(void) { return sizeof(moe_state); }
size_t sluice_moe_args_size(void) { return sizeof(moe_args); }

void sluice_moe_finish(moe_state *st) {
    experts_q8_finish(&st->r);
    const moe_args *a = &st->a;
    int64_t H = a->H;
    if (a->n_sum) {
        memset(a->out, 0, (size_t)H * sizeof(uint16_t));
        sluice_combine_bf16(a->n_sum, a->ys, H, a->w, (int)a->w_f32, a->at, a->out, (int)a->scalar);
        if (a->has_shared) {
            uint16_t sw = a->gate ? sluice_shared_weight_bf16(H, a->x, a->gate, (int)a->scalar) : (uint16_t)0x3F80;  /* 1 */
            const int64_t zero = 0;
            sluice_combine_bf16(1, a->ys + a->extra_row * H, H, &sw, 0, &zero, a->out, (int)a->scalar);
        }
    }
    st->a.n_sum = 0;
}

/* The experts and sum of moe_args (above), into `st`: with `run` 1 to their end before returning; with 0 the call
 * returns with the experts' first step (gate and up rows) started on the pool's workers where it can, so the caller's
 * thread can do other work meanwhile (queue the next layer's guessed reads: models/layers/moe_decode.py), and
 * sluice_moe_finish(st) runs the rest and the sum (a's pointers stay valid until then). Returns sluice_experts_q8's
 * code (0; -1 no scratch; -2 a format without an integer path), or -3 for n or n_sum above 64 or negative (nothing
 * started: finish does nothing). */
int sluice_moe_experts(moe_state *st, const moe_args *a, int run) {
    st->r.n = st->r.started = 0;
    st->a.n_sum = 0;
    if (a->n < 0 || a->n > MOE_MAX_K || a->n_sum < 0 || a->n_sum > MOE_MAX_K) return -3;
    int64_t H = a->H;
    if (a->widen) sluice_bf16_to_f32(H, a->x, a->xf, (int)a->scalar);
    int64_t *d = st->d, m = 0;
    for (int64_t e = 0; e < a->n; e++, m++) {
        const uint8_t *at0 = a->base + a->slots[e] * a->stride;
        for (int p = 0; p < 3; p++) {
            d[10 * m + 3 * p] = a->parts[3 * p];
            d[10 * m + 3 * p + 1] = (int64_t)(intptr_t)(at0 + a->parts[3 * p + 1]);
            d[10 * m + 3 * p + 2] = a->parts[3 * p + 2];
        }
        d[10 * m + 9] = (int64_t)(intptr_t)(a->ys + a->rows[e] * H);
    }
    if (a->extra) {
        memcpy(d + 10 * m, a->extra, 9 * sizeof(int64_t));
        d[10 * m + 9] = (int64_t)(intptr_t)(a->ys + a->extra_row * H);
        m++;
    }
    st->a = *a;  /* the sum's arguments (the workers read only st->d) */
    st->a.n_sum = 0;
    int rc = m ? experts_q8_start(&st->r, m, d, H, a->I, a->xf, 1, (int)a->P, (int)a->scalar) : 0;
    if (rc) return rc;
    st->a.n_sum = a->n_sum;
    if (run) sluice_moe_finish(st);
    return 0;
}
