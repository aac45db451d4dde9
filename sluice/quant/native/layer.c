/* A decode token's steps of one layer in one call, for the steps the model would otherwise join with Python: each
 * step the same C function the separate calls run, on the same inputs, so the same bits; only the calls between them
 * (ctypes, torch allocations, checks: ~90 us of the model thread's a Gated DeltaNet layer on the issue-30 model,
 * AVX2 EPYC) are gone.
 *
 * sluice_deltanet_decode: a Gated DeltaNet layer's mixer at T = 1 (models/layers/gated_deltanet.py): the grouped
 * input projections (qkv, z, b, a as sluice_linears_q8 writes them, bf16), the step from the conv to the gated norm
 * (sluice_deltanet_step), then out_proj (sluice_linears_q8 on the step's bf16 output, widened), into out.
 *
 * sluice_attention_decode: an attention layer's mixer at T = 1 (models/layers/attention.py, gated_attention.py): q,
 * k, v grouped (sluice_linears_q8, bf16), a gated layer's q_proj rows parted into the queries and the gate (head by
 * head: D query rows, then D gate rows, as the torch view and its copy part them), the core (sluice_attend_bf16:
 * norms, rope, the cache writes, attention, the gate), then o_proj, into out. */
#include "common.h"

int sluice_linears_q8(int64_t m, const int64_t *descs, int64_t K, const float *x, int64_t T, int P, int scalar);
void sluice_deltanet_step(int64_t nK, int64_t Hv, int64_t Dk, int64_t Dv, int64_t K, int tiled, int bf16,
                          const void *qkv, const void *z, const void *b, const void *a, const void *conv_w,
                          void *conv_state, const float *neg_A, const float *dt_bias, const void *norm, float eps,
                          float *state, float *scratch, void *out, int kernel);

/* n bf16 values widened to float32: exact, as torch's .float() (a single row: the pool's sluice_bf16_to_f32 would
 * cost more than the loop) */
static void widen(const uint16_t *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_float(x[i]);
}

/* The output projection of a mixer's bf16 result o [1, n] into out, as the separate call does it: o widened into
 * of, then sluice_linears_q8 with desc (6 values) whose y address is out. */
static int out_proj(const int64_t *desc, const uint16_t *o, int64_t n, float *of, uint16_t *out, int P, int path) {
    widen(o, n, of);
    int64_t od[6];
    for (int i = 0; i < 6; i++) od[i] = desc[i];
    od[4] = (int64_t)(intptr_t)out;
    return sluice_linears_q8(1, od, n, of, 1, P, path);
}

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
    widen(x, H, xf);
    int rc = sluice_linears_q8(p[DD_M_IN], in, H, xf, 1, P, path);
    if (rc) return rc;
    sluice_deltanet_step(p[DD_NK], Hv, p[DD_DK], Dv, p[DD_KCONV], (int)p[DD_TILED], 1, (const void *)(intptr_t)in[4],
                         (const void *)(intptr_t)in[10], (const void *)(intptr_t)in[16],
                         (const void *)(intptr_t)in[22], (const void *)(intptr_t)p[DD_CONV_W],
                         (void *)(intptr_t)p[DD_CONV_STATE], (const float *)(intptr_t)p[DD_NEG_A],
                         (const float *)(intptr_t)p[DD_DT_BIAS], (const void *)(intptr_t)p[DD_NORM], eps,
                         (float *)(intptr_t)p[DD_STATE], (float *)(intptr_t)p[DD_SCRATCH], o, (int)p[DD_KERNEL]);
    return out_proj((const int64_t *)(intptr_t)p[DD_OUT_DESC], o, Hv * Dv, of, out, P, path);
}

int sluice_deltanet_decode_nargs(void) { return DD_N; }

void sluice_attend_bf16(int64_t nH, int64_t nKV, int64_t D, int64_t rot, uint16_t *q, uint16_t *k, const uint16_t *v,
                        int norm_mode, const void *qn, const void *kn, int norm_f32, float eps, float clip,
                        const uint16_t *cos, const uint16_t *sin, uint16_t *ck, uint16_t *cv, int64_t sh, int64_t sp,
                        int64_t pos, int64_t lo, const float *sinks, uint16_t *rq, float *scratch,
                        const uint16_t *gate, uint16_t *out, int scalar);

enum {  /* the int64 arguments of sluice_attention_decode, p[...] (addresses as integers; 0 for none) */
    AD_NH, AD_NKV, AD_D, AD_ROT, AD_GATED, /* sizes; 1: q_proj gives queries and a gate */
    AD_NORM_MODE, AD_QN, AD_KN, AD_NORM_F32, AD_COS, AD_SIN, AD_CK, AD_CV, AD_SH, AD_SP, AD_SINKS, AD_RQ,
    AD_SCRATCH, /* sluice_attend_bf16's arguments of the layer */
    AD_H, AD_QKV_DESCS, AD_OUT_DESC, AD_P, AD_PATH, /* the projections */
    AD_XF, AD_QG, AD_Q, AD_GATE, AD_O, AD_OF, /* scratch: float32 [H]; bf16 q_proj's output, queries, gate, the
                                                 core's output [nH D]; its float32 copy */
    AD_N
};

/* x bf16 [1, H] at position pos (keys lo..pos seen) -> out bf16 [1, H]. qkv descs: 3 x 6 (q_proj into AD_QG, or
 * into AD_Q when not gated; k, v into their buffers), out_desc o_proj's (y address replaced by out). */
int sluice_attention_decode(const int64_t *p, float eps, float clip, const uint16_t *x, int64_t pos, int64_t lo,
                            uint16_t *out) {
    const int64_t H = p[AD_H], nH = p[AD_NH], D = p[AD_D];
    const int64_t *qkv = (const int64_t *)(intptr_t)p[AD_QKV_DESCS];
    float *xf = (float *)(intptr_t)p[AD_XF], *of = (float *)(intptr_t)p[AD_OF];
    uint16_t *q = (uint16_t *)(intptr_t)p[AD_Q], *gate = p[AD_GATED] ? (uint16_t *)(intptr_t)p[AD_GATE] : NULL;
    uint16_t *o = (uint16_t *)(intptr_t)p[AD_O];
    const int P = (int)p[AD_P], path = (int)p[AD_PATH];
    widen(x, H, xf);
    int rc = sluice_linears_q8(3, qkv, H, xf, 1, P, path);
    if (rc) return rc;
    if (gate) {
        const uint16_t *qg = (const uint16_t *)(intptr_t)p[AD_QG];
        for (int64_t h = 0; h < nH; h++)
            for (int64_t d = 0; d < D; d++) {
                q[h * D + d] = qg[2 * h * D + d];
                gate[h * D + d] = qg[2 * h * D + D + d];
            }
    }
    sluice_attend_bf16(nH, p[AD_NKV], D, p[AD_ROT], q, (uint16_t *)(intptr_t)qkv[10], (const uint16_t *)(intptr_t)qkv[16],
                       (int)p[AD_NORM_MODE], (const void *)(intptr_t)p[AD_QN], (const void *)(intptr_t)p[AD_KN],
                       (int)p[AD_NORM_F32], eps, clip, (const uint16_t *)(intptr_t)p[AD_COS],
                       (const uint16_t *)(intptr_t)p[AD_SIN], (uint16_t *)(intptr_t)p[AD_CK],
                       (uint16_t *)(intptr_t)p[AD_CV], p[AD_SH], p[AD_SP], pos, lo, (const float *)(intptr_t)p[AD_SINKS],
                       (uint16_t *)(intptr_t)p[AD_RQ], (float *)(intptr_t)p[AD_SCRATCH], gate, o, path);
    return out_proj((const int64_t *)(intptr_t)p[AD_OUT_DESC], o, nH * D, of, out, P, path);
}

int sluice_attention_decode_nargs(void) { return AD_N; }
