/* A prompt's causal attention in float32, for CPUs without AVX512_BF16 (and --isa avx2 / portable): attend.c's flash
 * order on AVX2 + FMA, with a portable twin of the same bits. out = softmax(q k^T / sqrt(D)) v per head, the queries at positions pos .. pos + T - 1 seeing the keys
 * 0 .. their own position, grouped-query heads sharing their kv head. Per block of 64 keys: scores as float32 sums
 * of the (exact) products of the bf16 inputs, an online softmax (running max and sum per row, exp_poly8), the
 * probabilities kept in float32 (attend.c rounds them to bf16 for its bf16 dot products; here the products are
 * float32 either way, so the closer sums cost nothing) and multiplied with v in float32 sums; one division and one
 * rounding to bf16 at the end. torch's SDPA on these bf16 inputs computes the same up to the order of its sums and
 * its rounding of the probabilities (tests/quant/test_attend.py bounds both against float64).
 *
 * Work: k and v are first widened to float32 and laid out for the two products (k as [block of 8 keys][D][8 keys],
 * v as [key][D]), then each task takes one kv head and 32 query positions of all its query heads, as attend.c. */
#include <math.h>

#include "common.h"

#define BK 64  /* keys per block */
#define BQ 32  /* query positions per task */
#define RQ 6   /* rows of a score pass: 6 x 2 accumulators of 8 keys */
#define RP 3   /* rows of a probability x v pass: 3 x 4 accumulators of 8 columns */

typedef struct {
    int64_t nH, nKV, G, T, D, pos, L, Lp, qh, qt, kvh, qblocks;
    const uint16_t *q, *k, *v;
    uint16_t *out;
    float *kt, *vf;  /* per kv head: [Lp / 8][D][8] and [Lp][D] */
    float scale;
    int simd;             /* AVX2 + FMA, else the portable twin */
    volatile int failed;  /* a task found no memory for its scratch */
} att2_job;

static void layout_task(void *c, int64_t i) {  /* kv head i / (Lp / 8), its block of 8 keys i % (Lp / 8) */
    const att2_job *j = (const att2_job *)c;
    int64_t nb = j->Lp / 8, h = i / nb, b = i % nb, D = j->D;
    float *kt = j->kt + h * j->Lp * D + b * 8 * D, *vf = j->vf + h * j->Lp * D + b * 8 * D;
    const uint16_t *k = j->k + h * j->kvh, *v = j->v + h * j->kvh;
    for (int key = 0; key < 8; key++) {
        int64_t at = 8 * b + key;
        for (int64_t d = 0; d < D; d++) {
            kt[d * 8 + key] = at < j->L ? bf16_float(k[at * D + d]) : 0.0f;
            vf[key * D + d] = at < j->L ? bf16_float(v[at * D + d]) : 0.0f;
        }
    }
}

#if SLUICE_X86
/* scores of RQ rows (q float [RQ][D]) against 16 keys (two 8-key blocks of kt), times scale, into s[r][0..15] */
AVX2_INLINE void scores(const float *q, const float *kt0, const float *kt1, int64_t D, float scale, float *s,
                        int64_t lds) {
    __m256 acc[RQ][2];
    for (int r = 0; r < RQ; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 k0 = _mm256_loadu_ps(kt0 + 8 * d), k1 = _mm256_loadu_ps(kt1 + 8 * d);
        for (int r = 0; r < RQ; r++) {
            __m256 qq = _mm256_broadcast_ss(q + r * D + d);
            acc[r][0] = _mm256_fmadd_ps(k0, qq, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(k1, qq, acc[r][1]);
        }
    }
    __m256 sc = _mm256_set1_ps(scale);
    for (int r = 0; r < RQ; r++) {
        _mm256_storeu_ps(s + r * lds, _mm256_mul_ps(acc[r][0], sc));
        _mm256_storeu_ps(s + r * lds + 8, _mm256_mul_ps(acc[r][1], sc));
    }
}

/* columns c0 .. c0 + 31 of o[r] = o[r] * alpha[r] + p[r] @ v for RP rows: p float [RP][BK], v the block's [BK][D] */
AVX2_INLINE void weighted_cols(float *o, int64_t D, const float *alpha, const float *p, const float *v, int64_t c0) {
    __m256 acc[RP][4];
    for (int r = 0; r < RP; r++)
        for (int c = 0; c < 4; c++)
            acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + c0 + 8 * c), _mm256_set1_ps(alpha[r]));
    for (int key = 0; key < BK; key++) {
        __m256 pp[RP];
        for (int r = 0; r < RP; r++) pp[r] = _mm256_broadcast_ss(p + r * BK + key);
        for (int c = 0; c < 4; c++) {
            __m256 vv = _mm256_loadu_ps(v + key * D + c0 + 8 * c);
            for (int r = 0; r < RP; r++) acc[r][c] = _mm256_fmadd_ps(vv, pp[r], acc[r][c]);
        }
    }
    for (int r = 0; r < RP; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + r * D + c0 + 8 * c, acc[r][c]);
}

/* The block's scores: rows 0 .. prow (a multiple of RQ) of q against keys k0 .. k0 + BK, times scale, into s */
AVX2 static void block_scores_avx2(const float *q, int64_t prow, const float *kt, int64_t k0, int64_t D, float scale,
                                   float *s) {
    for (int64_t r = 0; r < prow; r += RQ)
        for (int64_t kk = 0; kk < BK; kk += 16)
            scores(q + r * D, kt + (k0 + kk) * D, kt + (k0 + kk + 8) * D, D, scale, s + r * BK + kk, BK);
}

/* row sr's scores (the first `see` of BK kept) -> its probabilities in place; *mx, *sum moved on, the old terms'
 * factor in *alpha. The keys' lanes: maxima per lane over the 8-key vectors, then the lanes in order; the sum
 * likewise. exp_poly8 clamps a NaN away (maxps): a NaN score (or inf - inf) makes the row's sum, so its output, NaN.
 * `whole` (a constant at each call): the row sees every key of the block (all but the diagonal block), so no lane is
 * masked: the same operations on every kept lane (a 2,048-token layer 47.1-47.3 -> 45.8-46.0 ms without the masks,
 * 2 threads: benchmarks/results/quantized/breakdown/attend-avx2-2.txt) */
AVX2_INLINE void row_softmax_body(float *sr, int64_t see, float *mx, float *sum, float *alpha, const int whole) {
    __m256 v[BK / 8], keep[BK / 8], m = _mm256_set1_ps(-INFINITY);
    for (int c = 0; c < BK / 8; c++) {
        v[c] = _mm256_loadu_ps(sr + 8 * c);
        if (!whole)
            keep[c] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(see - 8 * c)),
                                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        m = _mm256_max_ps(m, whole ? v[c] : _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v[c], keep[c]));
    }
    float lanes[8], bm = -INFINITY;
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++) bm = lanes[l] > bm ? lanes[l] : bm;
    float nm = bm > *mx ? bm : *mx;
    *alpha = *mx == -INFINITY ? 0.0f : exp_poly(*mx - nm);
    *mx = nm;
    __m256 tot = _mm256_setzero_ps(), nmv = _mm256_set1_ps(nm), bad = _mm256_setzero_ps();
    for (int c = 0; c < BK / 8; c++) {
        __m256 z = _mm256_sub_ps(v[c], nmv), nan = _mm256_cmp_ps(z, z, _CMP_UNORD_Q), e = exp_poly8(z);
        if (!whole) {
            nan = _mm256_and_ps(keep[c], nan);
            e = _mm256_and_ps(keep[c], e);
        }
        bad = _mm256_or_ps(bad, nan);
        tot = _mm256_add_ps(tot, e);
        _mm256_storeu_ps(sr + 8 * c, e);
    }
    _mm256_storeu_ps(lanes, tot);
    float t = 0.0f;
    for (int l = 0; l < 8; l++) t += lanes[l];
    *sum = _mm256_movemask_ps(bad) ? NAN : *sum * *alpha + t;
}

AVX2 static void row_softmax_avx2(float *sr, int64_t see, float *mx, float *sum, float *alpha) {
    if (see >= BK) row_softmax_body(sr, see, mx, sum, alpha, 1);
    else row_softmax_body(sr, see, mx, sum, alpha, 0);
}

/* o [prow][D] = o * alpha + p @ v of the block (v: its [BK][D]) */
AVX2 static void block_weighted_avx2(float *o, int64_t prow, int64_t D, const float *alpha, const float *p,
                                     const float *v) {
    for (int64_t r = 0; r < prow; r += RP)
        for (int64_t c0 = 0; c0 < D; c0 += 32) weighted_cols(o + r * D, D, alpha + r, p + r * BK, v, c0);
}

/* q row -> float (zeros for a padding row); o row / sum -> bf16 */
AVX2 static void q_row_avx2(const uint16_t *src, int64_t D, float *q) {
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(q + d, src ? bf16x8(src + d) : _mm256_setzero_ps());
}
AVX2 static void out_row_avx2(const float *o, int64_t D, float sum, uint16_t *dst) {
    __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int64_t d = 0; d < D; d += 8) store_bf16x8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
}
#endif

/* ---- the portable twin: the same operations in the same order (fmaf for each FMA lane, the 8 lanes of every
 * vector sum kept apart and added in order, exp_poly for exp_poly8), so the same bits ---- */

static void block_scores_portable(const float *q, int64_t prow, const float *kt, int64_t k0, int64_t D, float scale,
                                  float *s) {
    for (int64_t r = 0; r < prow; r++)
        for (int64_t key = 0; key < BK; key++) {
            const float *kb = kt + (k0 + key) / 8 * 8 * D + (key % 8);
            float acc = 0.0f;
            for (int64_t d = 0; d < D; d++) acc = fmaf(kb[8 * d], q[r * D + d], acc);
            s[r * BK + key] = acc * scale;
        }
}

static void row_softmax_portable(float *sr, int64_t see, float *mx, float *sum, float *alpha) {
    float m[8];
    for (int l = 0; l < 8; l++) m[l] = -INFINITY;
    for (int c = 0; c < BK / 8; c++)
        for (int l = 0; l < 8; l++) {
            float x = 8 * c + l < see ? sr[8 * c + l] : -INFINITY;
            m[l] = m[l] > x ? m[l] : x;  /* maxps(m, x) */
        }
    float bm = -INFINITY;
    for (int l = 0; l < 8; l++) bm = m[l] > bm ? m[l] : bm;
    float nm = bm > *mx ? bm : *mx;
    *alpha = *mx == -INFINITY ? 0.0f : exp_poly(*mx - nm);
    *mx = nm;
    float tot[8] = {0}, t = 0.0f;
    int bad = 0;
    for (int c = 0; c < BK / 8; c++)
        for (int l = 0; l < 8; l++) {
            int at = 8 * c + l;
            float z = sr[at] - nm, e = at < see ? exp_poly(z) : 0.0f;
            bad |= at < see && z != z;
            tot[l] += e;
            sr[at] = e;
        }
    for (int l = 0; l < 8; l++) t += tot[l];
    *sum = bad ? NAN : *sum * *alpha + t;
}

static void block_weighted_portable(float *o, int64_t prow, int64_t D, const float *alpha, const float *p,
                                    const float *v) {
    for (int64_t r = 0; r < prow; r++)
        for (int64_t d = 0; d < D; d++) {
            float acc = o[r * D + d] * alpha[r];
            for (int key = 0; key < BK; key++) acc = fmaf(v[key * D + d], p[r * BK + key], acc);
            o[r * D + d] = acc;
        }
}

static void attend_task(void *c, int64_t i) {
    const att2_job *j = (const att2_job *)c;
    const int simd = j->simd;
    int64_t h = i / j->qblocks, t0 = i % j->qblocks * BQ, D = j->D, G = j->G;
    int64_t nq = j->T - t0 < BQ ? j->T - t0 : BQ, rows = G * nq, prow = (rows + RQ - 1) / RQ * RQ;
    /* scratch: q [prow][D], scores then probabilities [prow][BK], o [prow][D], max, sum, alpha [prow] */
    size_t need = (size_t)prow * (D * 4 + BK * 4 + D * 4 + 12) + 64;
    uint8_t *buf = thread_scratch(need);  /* ~170 KB at D = 128 and 4 query heads per kv head */
    if (!buf) {
        ((att2_job *)j)->failed = 1;
        return;
    }
    float *q = (float *)buf, *s = q + prow * D, *o = s + prow * BK;
    float *mx = o + prow * D, *sum = mx + prow, *alpha = sum + prow;
    for (int64_t r = 0; r < prow; r++) {
        const uint16_t *src = r < rows ? j->q + (h * G + r / nq) * j->qh + (t0 + r % nq) * j->qt : NULL;
#if SLUICE_X86
        if (simd) q_row_avx2(src, D, q + r * D);
        else
#endif
            for (int64_t d = 0; d < D; d++) q[r * D + d] = src ? bf16_float(src[d]) : 0.0f;
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    memset(o, 0, (size_t)prow * D * 4);
    const float *kt = j->kt + h * j->Lp * D, *vf = j->vf + h * j->Lp * D;
    int64_t last = j->pos + t0 + nq;  /* keys the block's last query sees */
    for (int64_t k0 = 0; k0 < last; k0 += BK) {
#if SLUICE_X86
        if (simd) block_scores_avx2(q, prow, kt, k0, D, j->scale, s);
        else
#endif
            block_scores_portable(q, prow, kt, k0, D, j->scale, s);
        for (int64_t r = 0; r < prow; r++) {
            int64_t see = r < rows ? j->pos + t0 + r % nq + 1 - k0 : 0;  /* keys of this block row r sees */
            see = see > BK ? BK : see;
            if (see <= 0) {
                alpha[r] = 1.0f;
                memset(s + r * BK, 0, BK * 4);
                continue;
            }
#if SLUICE_X86
            if (simd) row_softmax_avx2(s + r * BK, see, mx + r, sum + r, alpha + r);
            else
#endif
                row_softmax_portable(s + r * BK, see, mx + r, sum + r, alpha + r);
        }
#if SLUICE_X86
        if (simd) block_weighted_avx2(o, prow, D, alpha, s, vf + k0 * D);
        else
#endif
            block_weighted_portable(o, prow, D, alpha, s, vf + k0 * D);
    }
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *dst = j->out + (t0 + r % nq) * j->nH * D + (h * G + r / nq) * D;
#if SLUICE_X86
        if (simd) {
            out_row_avx2(o + r * D, D, sum[r], dst);
            continue;
        }
#endif
        float inv = 1.0f / sum[r];
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_round(o[r * D + d] * inv);
    }
}

/* sluice_prompt_attention's arguments and layout (attend.c), in float32 (products and probabilities): on AVX2 + FMA
 * unless `path` (native/_lib.py: 0 best, 1 portable, 2 AVX2) is portable or the CPU lacks them, then the portable
 * twin, the same bits. Returns 0, -1 when memory is short, -2 for bad arguments. */
int sluice_prompt_attention_f32(int64_t nH, int64_t nKV, int64_t T, int64_t D, int64_t pos, const uint16_t *q,
                                int64_t qh, int64_t qt, const uint16_t *k, const uint16_t *v, int64_t kvh, float scale,
                                uint16_t *out, int path) {
    if (nKV < 1 || nH % nKV || nH / nKV > 16 || D % 32 || D > 512 || T < 1 || pos < 0) return -2;
    att2_job j = {.nH = nH, .nKV = nKV, .G = nH / nKV, .T = T, .D = D, .pos = pos, .L = pos + T, .qh = qh, .qt = qt,
                  .kvh = kvh, .q = q, .k = k, .v = v, .out = out, .scale = scale,
                  .simd = SLUICE_X86 && sluice_avx2_ok(path) && sluice_simd()};
    j.Lp = (j.L + BK - 1) / BK * BK;
    j.qblocks = (T + BQ - 1) / BQ;
    size_t lay = (size_t)(nKV * j.Lp * D) * 4;
    int owned;
    float *buf = (float *)keep_take(2 * lay, &owned);
    if (!buf) return -1;
    j.kt = buf;
    j.vf = buf + lay / 4;
    pool_run(layout_task, &j, nKV * (j.Lp / 8));
    pool_run(attend_task, &j, nKV * j.qblocks);
    keep_give((uint8_t *)buf, owned);
    return j.failed ? -1 : 0;
}
