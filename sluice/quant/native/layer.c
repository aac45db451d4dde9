/* A decode token's steps of one layer in one call, for the steps the model would otherwise join with Python: each
 * step the same C function the separate calls run, on the same inputs, so the same bits; only the calls between them
 * (ctypes, torch allocations, checks: ~90 us of the model thread's a Gated DeltaNet layer on the issue-30 model,
 * AVX2 EPYC) are gone.
 *
 * sluice_deltanet_decode: a Gated DeltaNet layer's mixer at T = 1 (models/layers/gated_deltanet.py): the grouped
 * input projections (qkv, z, b, a as sluice_linears_q8 writes them, bf16), the step from the conv to the gated norm
 * (sluice_deltanet_step), then out_proj (sluice_linears_q8 on the step's bf16 output, widened), into out. */
#include "common.h"

int sluice_linears_q8(int64_t m, const int64_t *descs, int64_t K, const float *x, int64_t T, int P, int scalar);
void sluice_deltanet_step(int64_t nK, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K, int tiled, int bf16,
                          const void *qkv, const void *z, const void *b, const void *a, const void *conv_w,
                          void *conv_state, const float *neg_A, const float *dt_bias, const void *norm, float eps,
                          float *state, float *scratch, void *out, int kernel);

enum {  /* the int64 arguments of sluice_deltanet_decode, p[...] (addresses as integers) */
    DD_NK, DD_HV, DD_DK, DD_DV, DD_KCONV, DD_TILED, DD_KERNEL, /* the step's sizes and kernel */
    DD_CONV_W, DD_CONV_STATE, DD_NEG_A, DD_DT_BIAS, DD_NORM, DD_STATE, DD_SCRATCH, /* its weights, states, scratch */
    DD_H, DD_M_IN, DD_IN_DESCS, DD_OUT_DESC, DD_P, DD_PATH, /* the projections: sluice_linears_q8's arguments */
    DD_XF, DD_O, DD_OF, /* float32 [H], bf16 [Hv Dv] and float32 [Hv Dv] scratch */
    DD_N
};

/* x bf16 [1, H] -> out bf16 [1, H]. p: DD_N values (above); in_descs: m_in x 6 sluice_linears_q8 descriptors of
 * qkv, z, b, a in that order, each writing bf16 into its buffer of the layer; out_desc: out_proj's, its y address
 * replaced by out here. Returns sluice_linears_q8's code (0, or -1 / -2). */
int sluice_deltanet_decode(const int64_t *p, float eps, const uint16_t *x, uint16_t *out) {
    const int64_t H = p[DD_H], Hv = p[DD_HV], Dv = p[DD_DV];
    const int64_t *in = (const int64_t *)(intptr_t)p[DD_IN_DESCS];
    float *xf = (float *)(intptr_t)p[DD_XF], *of = (float *)(intptr_t)p[DD_OF];
    uint16_t *o = (uint16_t *)(intptr_t)p[DD_O];
    const int P = (int)p[DD_P], path = (int)p[DD_PATH];
    for (int64_t i = 0; i < H; i++) xf[i] = bf16_float(x[i]);  /* exact, as x.float() */
    int rc = sluice_linears_q8(p[DD_M_IN], in, H, xf, 1, P, path);
    if (rc) return rc;
    sluice_deltanet_step(p[DD_NK], Hv, p[DD_DK], Dv, p[DD_KCONV], (int)p[DD_TILED], 1, (const void *)(intptr_t)in[4],
                         (const void *)(intptr_t)in[10], (const void *)(intptr_t)in[16],
                         (const void *)(intptr_t)in[22], (const void *)(intptr_t)p[DD_CONV_W],
                         (void *)(intptr_t)p[DD_CONV_STATE], (const float *)(intptr_t)p[DD_NEG_A],
                         (const float *)(intptr_t)p[DD_DT_BIAS], (const void *)(intptr_t)p[DD_NORM], eps,
                         (float *)(intptr_t)p[DD_STATE], (float *)(intptr_t)p[DD_SCRATCH], o, (int)p[DD_KERNEL]);
    for (int64_t i = 0; i < Hv * Dv; i++) of[i] = bf16_float(o[i]);
    int64_t od[6];
    const int64_t *d = (const int64_t *)(intptr_t)p[DD_OUT_DESC];
    for (int i = 0; i < 6; i++) od[i] = d[i];
    od[4] = (int64_t)(intptr_t)out;
    return sluice_linears_q8(1, od, Hv * Dv, of, 1, P, path);
}

int sluice_deltanet_decode_nargs(void) { return DD_N; }
