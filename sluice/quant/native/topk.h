/* topk.cc (its own extension, sluice.quant.native._topk): torch.topk of one float32 row, ties as torch resolves
 * them. decode.c takes it as a function pointer (NULL where the extension is not built: ties go to torch). */
#ifndef SLUICE_TOPK_H
#define SLUICE_TOPK_H
#include <stdint.h>

#define SLUICE_TOPK_MAX 4096 /* the longest row: a router's experts */

/* values [n] -> ids [k], out [k]: torch.topk(values, k)'s indices and values; 1, or 0 (k outside 1..n, n too long) */
typedef int (*topk_fn)(int64_t n, const float *values, int64_t k, int64_t *ids, float *out);

#ifdef __cplusplus
extern "C" {
#endif
int sluice_topk_torch(int64_t n, const float *values, int64_t k, int64_t *ids, float *out);
int sluice_topk_libstdcxx(void); /* 1: built against libstdc++ (torch's library on Linux), 0: another */
#ifdef __cplusplus
}
#endif
#endif
