/* A prompt's causal attention in bf16 (AVX512_BF16 vdpbf16ps): out = softmax(q k^T / sqrt(D)) v per head, the
 * queries at positions pos .. pos + T - 1 seeing the keys 0 .. their own position, grouped-query heads sharing their
 * kv head. Flash-attention order: per block of 64 keys, scores in float32 from bf16 products, an online softmax
 * (running max and sum per row, exp_poly), the probabilities rounded to bf16 and multiplied with v in float32 sums;
 * one division and one rounding to bf16 at the end. This is what torch's SDPA computes on the same inputs up to
 * the order of float32 sums (sluice's matmul.sdpa runs it with bf16 products too), without its float32 copies of
 * k and v or its kernel dispatch: it only runs where the CPU has AVX512_BF16; elsewhere SDPA does.
 *
 * Work: k and v are first laid out for the two products (k as [block of 16 keys][D / 2][16 keys][2 values], v as
 * [pair of keys][D][2 keys]), then each task takes one kv head and 32 query positions of all its query heads. */
#include <math.h>

#include "common.h"

#define BK 64   /* keys per block */
#define BQ 32   /* query positions per task */
#define RQ 8    /* rows of a score pass */
#define RP 2    /* rows of a probability x v pass */

#if SLUICE_X86
#define BF16_FN __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define BF16_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

typedef struct {
    int64_t nH, nKV, G, T, D, pos, L, Lp, qh, qt, kvh, qblocks;
    const uint16_t *q, *k, *v;
    uint16_t *out;
    uint32_t *kt, *v2;  /* per kv head: [Lp / 16][D / 2][16] and [Lp / 2][D] pairs */
    float scale;
    volatile int failed;  /* a task found no memory for its scratch */
} att_job;

static void layout_task(void *c, int64_t i) {  /* kv head i / (Lp / 16), its block of 16 keys i % (Lp / 16) */
    const att_job *j = (const att_job *)c;
    int64_t nb = j->Lp / 16, h = i / nb, b = i % nb, D = j->D;
    uint32_t *kt = j->kt + h * j->Lp * D / 2 + b * 16 * (D / 2);
    uint32_t *v2 = j->v2 + h * j->Lp * D / 2 + b * 8 * D;
    const uint16_t *k = j->k + h * j->kvh, *v = j->v + h * j->kvh;
    for (int key = 0; key < 16; key++) {
        int64_t at = 16 * b + key;
        for (int64_t p = 0; p < D / 2; p++)
            kt[p * 16 + key] = at < j->L ? rd32(k + at * D + 2 * p) : 0;
    }
    for (int pr = 0; pr < 8; pr++) {
        int64_t a0 = 16 * b + 2 * pr, a1 = a0 + 1;
        for (int64_t d = 0; d < D; d++) {
            uint32_t lo = a0 < j->L ? v[a0 * D + d] : 0, hi = a1 < j->L ? v[a1 * D + d] : 0;
            v2[pr * D + d] = lo | hi << 16;
        }
    }
}

/* scores of RQ rows against 32 keys (two 16-key blocks of kt), times scale, into s[r][0..31]; qi holds the rows'
 * value pairs interleaved, [D / 2][RQ] (one pointer, fixed offsets: the broadcasts are loads) */
BF16_INLINE void scores(const uint32_t *qi, const uint32_t *kt0, const uint32_t *kt1, int64_t D, float scale,
                        float *s, int64_t lds) {
    __m512 acc[RQ][2];
    for (int r = 0; r < RQ; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; p++) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt0 + 16 * p), k1 = (__m512bh)_mm512_loadu_si512(kt1 + 16 * p);
        for (int r = 0; r < RQ; r++) {
            __m512bh qq = (__m512bh)_mm512_set1_epi32((int)qi[p * RQ + r]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qq);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qq);
        }
    }
    __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < RQ; r++) {
        _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(acc[r][0], sc));
        _mm512_storeu_ps(s + r * lds + 16, _mm512_mul_ps(acc[r][1], sc));
    }
}

/* columns c0 .. c0 + 16 NC of o[r] = o[r] * alpha[r] + p[r] @ v for RP rows: p bf16 [RP][BK] (pairs of keys), v2
 * the block's [BK / 2][D]; NC a constant at each call, so the accumulators stay in registers */
BF16_INLINE void weighted_cols(float *o, int64_t D, const float *alpha, const uint16_t *p, const uint32_t *v2,
                               int64_t c0, const int NC) {
    __m512 acc[RP][8];
    for (int r = 0; r < RP; r++)
        for (int c = 0; c < NC; c++)
            acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c0 + 16 * c), _mm512_set1_ps(alpha[r]));
    for (int jp = 0; jp < BK / 2; jp++) {
        __m512bh pp[RP];
        for (int r = 0; r < RP; r++) pp[r] = (__m512bh)_mm512_set1_epi32((int)rd32(p + r * BK + 2 * jp));
        for (int c = 0; c < NC; c++) {
            __m512bh vv = (__m512bh)_mm512_loadu_si512(v2 + jp * D + c0 + 16 * c);
            for (int r = 0; r < RP; r++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv, pp[r]);
        }
    }
    for (int r = 0; r < RP; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + r * D + c0 + 16 * c, acc[r][c]);
}

BF16_FN static void weighted(float *o, int64_t D, const float *alpha, const uint16_t *p, const uint32_t *v2) {
    int64_t c0 = 0;
    for (; c0 + 128 <= D; c0 += 128) weighted_cols(o, D, alpha, p, v2, c0, 8);
    switch ((D - c0) / 16) {  /* D is a multiple of 32 */
        case 6: weighted_cols(o, D, alpha, p, v2, c0, 6); break;
        case 4: weighted_cols(o, D, alpha, p, v2, c0, 4); break;
        case 2: weighted_cols(o, D, alpha, p, v2, c0, 2); break;
        default: break;
    }
}

static const uint16_t zero_row[512];

BF16_FN static void attend_task(void *c, int64_t i) {
    const att_job *j = (const att_job *)c;
    int64_t h = i / j->qblocks, t0 = i % j->qblocks * BQ, D = j->D, G = j->G;
    int64_t nq = j->T - t0 < BQ ? j->T - t0 : BQ, rows = G * nq, prow = (rows + RQ - 1) / RQ * RQ;
    /* scratch: scores [prow][BK] float, probabilities [prow][BK] bf16, o [prow][D], max, sum, alpha [prow] */
    size_t need = (size_t)prow * (BK * 4 + BK * 2 + D * 4 + 12 + D * 2) + 64;
    uint8_t *buf = thread_scratch(need);  /* ~170 KB at D = 128 and 4 query heads per kv head */
    if (!buf) {
        ((att_job *)j)->failed = 1;
        return;
    }
    float *s = (float *)buf, *o = s + prow * BK;
    float *mx = o + prow * D, *sum = mx + prow, *alpha = sum + prow;
    uint16_t *pb = (uint16_t *)(alpha + prow);
    uint32_t *qi = (uint32_t *)(pb + prow * BK);  /* [prow / RQ][D / 2][RQ] the rows' q pairs, interleaved */
    const uint16_t *qrow[RQ * 64];  /* prow <= G * BQ rows: G <= 16 */
    for (int64_t r = 0; r < prow; r++) {
        qrow[r] = r < rows ? j->q + (h * G + r / nq) * j->qh + (t0 + r % nq) * j->qt : zero_row;
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    memset(o, 0, (size_t)prow * D * 4);
    for (int64_t r = 0; r < prow; r++)
        for (int64_t p = 0; p < D / 2; p++) qi[(r / RQ * (D / 2) + p) * RQ + r % RQ] = rd32(qrow[r] + 2 * p);
    const uint32_t *kt = j->kt + h * j->Lp * D / 2, *v2 = j->v2 + h * j->Lp * D / 2;
    int64_t last = j->pos + t0 + nq;  /* keys the block's last query sees */
    for (int64_t k0 = 0; k0 < last; k0 += BK) {
        for (int64_t r = 0; r < prow; r += RQ)
            for (int64_t kk = 0; kk < BK; kk += 32)
                scores(qi + r * (D / 2), kt + (k0 + kk) / 16 * 16 * (D / 2), kt + (k0 + kk + 16) / 16 * 16 * (D / 2), D,
                       j->scale, s + r * BK + kk, BK);
        for (int64_t r = 0; r < prow; r++) {
            int64_t see = r < rows ? j->pos + t0 + r % nq + 1 - k0 : 0;  /* keys of this block row r sees */
            see = see > BK ? BK : see;
            float *sr = s + r * BK;
            uint16_t *pr = pb + r * BK;
            if (see <= 0) {
                alpha[r] = 1.0f;
                memset(pr, 0, BK * 2);
                continue;
            }
            __m512 m = _mm512_set1_ps(-INFINITY);
            __mmask16 keep[BK / 16];
            for (int c = 0; c < BK / 16; c++) {
                int64_t n = see - 16 * c;
                keep[c] = n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                m = _mm512_mask_max_ps(m, keep[c], m, _mm512_loadu_ps(sr + 16 * c));
            }
            float bm = _mm512_reduce_max_ps(m), nm = bm > mx[r] ? bm : mx[r];
            alpha[r] = mx[r] == -INFINITY ? 0.0f : exp_poly16(_mm512_set1_ps(mx[r] - nm))[0];
            mx[r] = nm;
            __m512 tot = _mm512_setzero_ps(), nmv = _mm512_set1_ps(nm);
            __mmask16 bad = 0;
            for (int c = 0; c < BK / 16; c++) {
                __m512 z = _mm512_sub_ps(_mm512_loadu_ps(sr + 16 * c), nmv);
                bad |= _mm512_mask_cmp_ps_mask(keep[c], z, z, _CMP_UNORD_Q);
                __m512 e = _mm512_maskz_mov_ps(keep[c], exp_poly16(z));
                tot = _mm512_add_ps(tot, e);
                _mm256_storeu_si256((__m256i *)(pr + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
            }
            /* exp_poly16 clamps a NaN away (maxps): a NaN score (or inf - inf) makes the row's sum, so its output, NaN
             * (as SDPA gives it), not a silent number */
            sum[r] = bad ? NAN : sum[r] * alpha[r] + _mm512_reduce_add_ps(tot);
        }
        for (int64_t r = 0; r < prow; r += RP) weighted(o + r * D, D, alpha + r, pb + r * BK, v2 + k0 / 2 * D);
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = j->out + (t0 + r % nq) * j->nH * D + (h * G + r / nq) * D;
        __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv)));
    }
}
#endif

/* 1 when this CPU runs sluice_prompt_attention (AVX512_BF16) */
int sluice_attention_bf16(void) { return SLUICE_X86 && sluice_cpu_avx512bf16(); }

/* out [T, nH * D] bf16 = causal attention of q [nH, T, D] bf16 (head stride qh, position stride qt, in elements)
 * over the cached k and v [nKV, >= pos + T, D] bf16 (head stride kvh, position stride D), the queries at positions
 * pos .. pos + T - 1, query head h on kv head h / (nH / nKV), scores times scale. D a multiple of 32 up to 512,
 * nH / nKV <= 16. Returns 0, -1 when memory is short, -2 for bad arguments or a CPU without AVX512_BF16. */
int sluice_prompt_attention(int64_t nH, int64_t nKV, int64_t T, int64_t D, int64_t pos, const uint16_t *q, int64_t qh,
                            int64_t qt, const uint16_t *k, const uint16_t *v, int64_t kvh, float scale, uint16_t *out) {
#if SLUICE_X86
    if (!sluice_attention_bf16() || nKV < 1 || nH % nKV || nH / nKV > 16 || D % 32 || D > 512 || T < 1 || pos < 0)
        return -2;
    att_job j = {.nH = nH, .nKV = nKV, .G = nH / nKV, .T = T, .D = D, .pos = pos, .L = pos + T, .qh = qh, .qt = qt,
                 .kvh = kvh, .q = q, .k = k, .v = v, .out = out, .scale = scale};
    j.Lp = (j.L + BK - 1) / BK * BK;
    j.qblocks = (T + BQ - 1) / BQ;
    size_t lay = (size_t)(nKV * j.Lp * D / 2) * 4;
    int owned;
    uint32_t *buf = (uint32_t *)keep_take(2 * lay, &owned);
    if (!buf) return -1;
    j.kt = buf;
    j.v2 = buf + lay / 4;
    pool_run(layout_task, &j, nKV * (j.Lp / 16));
    pool_run(attend_task, &j, nKV * j.qblocks);
    keep_give((uint8_t *)buf, owned);
    return j.failed ? -1 : 0;
#else
    (void)nH; (void)nKV; (void)T; (void)D; (void)pos; (void)q; (void)qh; (void)qt; (void)k; (void)v; (void)kvh;
    (void)scale; (void)out;
    return -2;
#endif
}
