/* torch.topk(largest=True, sorted=True) of one row of float32 values, ties resolved as torch resolves them.
 *
 * A softmax router's probabilities come from bf16 logits, so equal values are common (on the issue-30 UD file's
 * synthetic router, 34.8% of the router's and 36.0% of the guess's top-8 calls over 32 decode tokens met two equal
 * probabilities among or at the edge of the top 8: benchmarks/results/hybrid/topk-ties.txt), and the experts a tie
 * at the k-th value picks are whichever torch.topk picks. torch 2.13's CPU top-k (ATen/native/TopKImpl.h,
 * topk_impl_loop, the header ships with the wheel) fills (value, index) pairs and runs std::nth_element on the k-th
 * with the comparator "NaN first, then larger first" and std::sort on the first k - 1 (std::partial_sort of the
 * first k where k * 64 <= n). This file runs the same standard-library algorithms on such pairs with the same
 * comparator, so it lands on the same indices in the same order: not a reimplementation of their tie order but the
 * same calls. (The pairs' value type, float32 here, may be torch's accumulation type, double, there: the exact
 * widening orders every value, NaN included, the same way, so each comparison answers the same.) A library whose
 * algorithms differ (libc++ against a libstdc++-built torch) would break that, so sluice checks it against
 * torch.topk once per process before using it (quant/native/decode.py ties_exact) and keeps torch.topk for ties where
 * it differs.
 *
 * C++ for std::nth_element / std::partial_sort / std::sort alone: no exceptions, no allocation, C linkage. */
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <utility>

#include "topk.h"

namespace {
using elem_t = std::pair<float, int64_t>;  // TopKImpl.h: std::pair<accscalar_t, int64_t>

inline bool larger(const elem_t &x, const elem_t &y) {  // TopKImpl.h's comparator for largest
    return (std::isnan(x.first) && !std::isnan(y.first)) || (x.first > y.first);
}
}  // namespace

/* values [n] -> ids [k], out [k] (the values, as float): torch.topk(values, k)'s indices and values. Returns 1, or
 * 0 for k outside 1..n or n over SLUICE_TOPK_MAX (the pairs live on the stack: 64 KiB). */
extern "C" int sluice_topk_torch(int64_t n, const float *values, int64_t k, int64_t *ids, float *out) {
    if (k < 1 || k > n || n > SLUICE_TOPK_MAX) return 0;
    // raw storage, the n pairs constructed in it: an elem_t array would zero all 64 KiB on every call
    alignas(elem_t) unsigned char raw[sizeof(elem_t) * SLUICE_TOPK_MAX];
    elem_t *q = reinterpret_cast<elem_t *>(raw);
    for (int64_t j = 0; j < n; j++) new (q + j) elem_t(values[j], j);
    if (k * 64 <= n) {
        std::partial_sort(q, q + k, q + n, larger);
    } else {
        std::nth_element(q, q + k - 1, q + n, larger);
        std::sort(q, q + k - 1, larger);
    }
    for (int64_t j = 0; j < k; j++) {
        ids[j] = q[j].second;
        out[j] = q[j].first;
    }
    return 1;
}

/* 1 where this file was built against libstdc++, the C++ library torch's Linux wheels are built with (its tie order
 * is then torch's: a mismatch is a bug here, which the tests must catch, not skip); 0 for another (libc++) */
extern "C" int sluice_topk_libstdcxx(void) {
#if defined(__GLIBCXX__)
    return 1;
#else
    return 0;
#endif
}
