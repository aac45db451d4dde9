/* What deltanet.c (a decode token of a Gated DeltaNet layer) and delta_prompt.c (the chunked rule over a prompt)
 * share: the kernels' numbers, the l2 norm's epsilon and its sum's order, the model dtype's loads and roundings. */
#ifndef SLUICE_NATIVE_DELTANET_H
#define SLUICE_NATIVE_DELTANET_H

#include "common.h"

#define DN_L2_EPS 1e-6f /* delta_rule.L2_EPS */

enum { DN_PORTABLE, DN_AVX2, DN_AVX512 };  /* the kernels, as native/deltanet.py KERNELS names them */

/* deltanet.c: the best kernel this CPU has under the path cap scalar (common.h: 0 any, 2 at most AVX2, 1 the
 * portable C); both files' vector kernels run on the same CPU features */
int sluice_deltanet_kernel(int scalar);

/* the AVX-512 kernels' target (their AVX2 twins: common.h AVX2) */
#define AVX512F __attribute__((target("avx512f,avx2,fma,f16c")))

/* value i of a tensor in the model's dtype (bf16 when bf16, else float32), as float32 */
static inline float load_x(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float round_x(float f, int bf16) { return bf16 ? bf16_float(bf16_round(f)) : f; }

/* sum of squares of n floats in 8 lanes (value d into lane d % 8), added by reduce8 */
static inline float sum_squares(const float *x, int64_t n) {
    float lane[8] = {0};
    for (int64_t d = 0; d < n; d++) lane[d % 8] = lane[d % 8] + x[d] * x[d];
    return reduce8(lane);
}

#endif
