/* The gated delta rule over a prompt in blocks of DP_CHUNK tokens (models/layers/delta_rule.py `chunked`, the
 * reference) in one native call per layer, in place of ~30 torch ops a block; the conv before it and the gated norm
 * after it stay torch steps. Per value head h and block of n <= 64 tokens, with its key head kh (h / (Hv / nK):
 * grouped; h % nK: tiled) and the block's start state S [Dk, Dv] (float32, where the layer's state lies):
 *
 *   k_i = k_i / sqrt(|k_i|^2 + 1e-6), q_i likewise then / sqrt(Dk)     (8 lanes in reduce8's order: deltanet.h)
 *   c_i = g_1 + ... + g_i (in order), e_i = exp(c_i), D_ij = exp(c_i - c_j) for j <= i     (the decays)
 *   A_ij = (k_i . k_j) D_ij beta_i for j < i; W_ij = (q_i . k_j) D_ij for j <= i           (the [n, n] products)
 *   u = (I + A)^-1 (beta (v - e k S)), by forward substitution, row i from row 0 up   (what each token writes)
 *   o = e q S + W u;  S = exp(c_n) S + (k exp(c_n - c))^T u                             (o rounded to the dtype)
 *
 * the reference's algebra with its (I + A)^-1 applied by substitution to one right-hand side instead of built and
 * multiplied into two. Every product is C = C0 + A B in `tile` order: the sum over the inner index in order, added
 * to C's old value or to 0, per output element; rows go in tiles of DP_MR on every kernel and a triangular product
 * sums a tile's rows over the same range (its zeros included), so each element sees the same operations whatever the
 * kernel or thread. The [n, n] decays come from exp_poly (common.h; its 8-lane twin gives the same bits; within 2 ulp
 * and, below c_i - c_j < -87, e^-87 for 0: both nothing next to 1), the per-token ones from libm's expf.
 *
 * Three kernels (deltanet.h; the decode step's choice, once per model): portable C, AVX2 (tiles of 4 rows x 16
 * columns) and AVX-512 (4 x 64), the same bits (no fused multiply-add: -ffp-contract=off, each product a mul then an
 * add, also in the vectors). Key heads go over the pool (pool.c): a task takes one through the prompt's blocks in
 * order, normalises its keys and queries and makes k k^T and q k^T once a block, then runs the block of each value
 * head that reads it on that head's state; the block's operands (~256 KiB at Qwen3.5's shapes) lie in the thread's
 * own scratch, in L2 with the states. Against torch's chunked (other summation orders: its bmm's, its solve's),
 * float32 outputs agree to float32 rounding, not bitwise (tests/quant/test_delta_prompt.py states the bound).
 *
 * At Qwen3.5's shapes (16 key heads, 32 value heads tiled, 128 x 128; bf16; 2,048 tokens in slices of 256; 2
 * threads of an AMD EPYC): 37 ms a layer on AVX-512, 53 on AVX2, against 151 for chunked's torch steps (q and k
 * repeated first); float32 outputs 8.7e-7 from a float64 run, chunked's 1.2e-6. Some 8.5 GFLOP a layer (k S, q S and
 * the state's update dominate: ~7 MFLOP a value head and block), so ~230 GFLOP/s on the 2 cores, multiplies and adds
 * separate. `PYTHONPATH=. .venv/bin/python benchmarks/results/hybrid/delta_rule_timing.py`, its output
 * delta_rule_timing_native.txt (the machine's probe 0.64-0.69 ms, quiet ~0.57). */
#include <math.h>

#include "deltanet.h"

#define DP_CHUNK 64 /* tokens per block: spec.DELTA_CHUNK, the reference's */
#define DP_MR 4     /* rows per tile of every product, on every kernel */

/* C[r, j] = (init ? C[r, j] : 0) + sum_{d < K} A[r lda + d] B[d ldb + j], for r < rows, j < N: the sum in d order */
typedef void (*rows_fn)(int64_t rows, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                        float *C, int64_t ldc, int init);

static void rows_portable(int64_t rows, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                          int64_t ldb, float *C, int64_t ldc, int init) {
    for (int64_t r = 0; r < rows; r++) {
        float *c = C + r * ldc;
        if (!init)
            for (int64_t j = 0; j < N; j++) c[j] = 0.0f;
        for (int64_t d = 0; d < K; d++) {
            const float a = A[r * lda + d], *b = B + d * ldb;
            for (int64_t j = 0; j < N; j++) c[j] = c[j] + a * b[j];
        }
    }
}

/* dst [Dk] = x / sqrt(sum of squares + eps) * scale, x the Dk values of p from element `at` in the model's dtype: the
 * sum in 8 lanes (deltanet.h sum_squares' order) */
typedef void (*norm_fn)(const void *p, int64_t at, int64_t Dk, int bf16, float scale, float *dst);

static void normalised(const float *x, int64_t Dk, float ss, float scale, float *dst) {
    const float s = 1.0f / sqrtf(ss + DN_L2_EPS);
    for (int64_t d = 0; d < Dk; d++) dst[d] = x[d] * s * scale;
}

static void norm_portable(const void *p, int64_t at, int64_t Dk, int bf16, float scale, float *dst) {
    for (int64_t d = 0; d < Dk; d++) dst[d] = load_x(p, at + d, bf16);
    normalised(dst, Dk, sum_squares(dst, Dk), scale, dst);
}

/* dr[j] = exp_poly(c - cum[j]) for j <= i (the vector copy: to the next multiple of 8; cum has room) */
typedef void (*decay_fn)(const float *cum, int64_t i, float *dr);

static void decays_portable(const float *cum, int64_t i, float *dr) {
    for (int64_t j = 0; j <= i; j++) dr[j] = exp_poly(cum[i] - cum[j]);
}

#if SLUICE_X86
/* rows_portable on R rows of NV vectors of W columns, in registers: VEC the vector type, P its intrinsics' prefix */
#define DP_TILE(NAME, TARGET, VEC, P, W, NV, R)                                                                       \
    TARGET static inline void NAME(int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,    \
                                   int64_t ldc, int init) {                                                          \
        VEC acc[R][NV];                                                                                              \
        for (int r = 0; r < R; r++)                                                                                  \
            for (int t = 0; t < NV; t++) acc[r][t] = init ? P##_loadu_ps(C + r * ldc + W * t) : P##_setzero_ps();    \
        for (int64_t d = 0; d < K; d++) {                                                                            \
            VEC b[NV];                                                                                               \
            for (int t = 0; t < NV; t++) b[t] = P##_loadu_ps(B + d * ldb + W * t);                                   \
            for (int r = 0; r < R; r++) {                                                                            \
                const VEC a = P##_set1_ps(A[r * lda + d]);                                                           \
                for (int t = 0; t < NV; t++) acc[r][t] = P##_add_ps(acc[r][t], P##_mul_ps(a, b[t]));                 \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++)                                                                                  \
            for (int t = 0; t < NV; t++) P##_storeu_ps(C + r * ldc + W * t, acc[r][t]);                              \
    }

/* columns [j, j + width) of the row tile: 4 rows at once, else row by row */
#define DP_PANEL(R4, R1)                                                                                             \
    do {                                                                                                             \
        if (rows == DP_MR)                                                                                           \
            R4(K, A, lda, B + j, ldb, C + j, ldc, init);                                                             \
        else                                                                                                         \
            for (int64_t r = 0; r < rows; r++) R1(K, A + r * lda, lda, B + j, ldb, C + r * ldc + j, ldc, init);      \
    } while (0)

DP_TILE(t8x2r4, AVX2, __m256, _mm256, 8, 2, DP_MR)
DP_TILE(t8x2r1, AVX2, __m256, _mm256, 8, 2, 1)
DP_TILE(t8x1r4, AVX2, __m256, _mm256, 8, 1, DP_MR)
DP_TILE(t8x1r1, AVX2, __m256, _mm256, 8, 1, 1)

AVX2 static void rows_avx2(int64_t rows, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, int init) {
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) DP_PANEL(t8x2r4, t8x2r1);
    for (; j + 8 <= N; j += 8) DP_PANEL(t8x1r4, t8x1r1);
    if (j < N) rows_portable(rows, N - j, K, A, lda, B + j, ldb, C + j, ldc, init);
}

DP_TILE(t16x4r4, AVX512F, __m512, _mm512, 16, 4, DP_MR)
DP_TILE(t16x4r1, AVX512F, __m512, _mm512, 16, 4, 1)
DP_TILE(t16x1r4, AVX512F, __m512, _mm512, 16, 1, DP_MR)
DP_TILE(t16x1r1, AVX512F, __m512, _mm512, 16, 1, 1)

AVX512F static void rows_avx512(int64_t rows, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                                int64_t ldb, float *C, int64_t ldc, int init) {
    int64_t j = 0;
    for (; j + 64 <= N; j += 64) DP_PANEL(t16x4r4, t16x4r1);
    for (; j + 16 <= N; j += 16) DP_PANEL(t16x1r4, t16x1r1);
    for (; j + 8 <= N; j += 8) DP_PANEL(t8x1r4, t8x1r1);
    if (j < N) rows_portable(rows, N - j, K, A, lda, B + j, ldb, C + j, ldc, init);
}

AVX2 static void norm_avx2(const void *p, int64_t at, int64_t Dk, int bf16, float scale, float *dst) {
    __m256 acc = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= Dk; d += 8) {
        const __m256 x = bf16 ? bf16x8((const uint16_t *)p + at + d) : _mm256_loadu_ps((const float *)p + at + d);
        _mm256_storeu_ps(dst + d, x);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(x, x));
    }
    float lane[8];
    _mm256_storeu_ps(lane, acc);
    for (; d < Dk; d++) {
        dst[d] = load_x(p, at + d, bf16);
        lane[d % 8] = lane[d % 8] + dst[d] * dst[d];
    }
    normalised(dst, Dk, reduce8(lane), scale, dst);
}

AVX2 static void decays_avx2(const float *cum, int64_t i, float *dr) {
    const __m256 c = _mm256_set1_ps(cum[i]);
    for (int64_t j = 0; j <= i; j += 8) _mm256_storeu_ps(dr + j, exp_poly8(_mm256_sub_ps(c, _mm256_loadu_ps(cum + j))));
}
#endif

typedef struct {
    rows_fn rows;
    decay_fn decays;
    norm_fn norm;
} kernel_fns;

static kernel_fns kernel_of(int kernel) {
#if SLUICE_X86
    if (kernel == DN_AVX512) return (kernel_fns){rows_avx512, decays_avx2, norm_avx2};
    if (kernel == DN_AVX2) return (kernel_fns){rows_avx2, decays_avx2, norm_avx2};
#endif
    (void)kernel;
    return (kernel_fns){rows_portable, decays_portable, norm_portable};
}

/* C [M, N] = C0 + A B, rows in tiles of DP_MR: tile i0 sums d < K, or (tri_k) d < min(K, i0 + DP_MR), and computes
 * columns < N, or (tri_n) < min(N, i0 + DP_MR rounded up to 16): the columns the rule keeps, in whole vectors */
static void product(const kernel_fns *f, int64_t M, int64_t N, int64_t K, int tri_k, int tri_n, const float *A,
                    int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int init) {
    for (int64_t i0 = 0; i0 < M; i0 += DP_MR) {
        const int64_t rows = M - i0 < DP_MR ? M - i0 : DP_MR, end = (i0 + DP_MR + 15) / 16 * 16;
        const int64_t Kt = tri_k && i0 + DP_MR < K ? i0 + DP_MR : K, Nt = tri_n && end < N ? end : N;
        f->rows(rows, Nt, Kt, A + i0 * lda, lda, B, ldb, C + i0 * ldc, ldc, init);
    }
}

/* u [n, Dv] = (I + A)^-1 u in place, An = -A (strictly lower, rows of DP_CHUNK): row i = u_i + sum_{j < i} An_ij u_j,
 * j in order; a tile of rows takes the rows above it in one product, then its own rows one by one */
static void solve(const kernel_fns *f, int64_t n, int64_t Dv, const float *An, float *u) {
    for (int64_t i0 = 0; i0 < n; i0 += DP_MR) {
        const int64_t rows = n - i0 < DP_MR ? n - i0 : DP_MR;
        f->rows(rows, Dv, i0, An + i0 * DP_CHUNK, DP_CHUNK, u, Dv, u + i0 * Dv, Dv, 1);
        for (int64_t i = i0 + 1; i < i0 + rows; i++)
            f->rows(1, Dv, i - i0, An + i * DP_CHUNK + i0, DP_CHUNK, u + i0 * Dv, Dv, u + i * Dv, Dv, 1);
    }
}

typedef struct {
    int64_t T, nK, Hv, Dk, Dv, group;
    int tiled, bf16;
    kernel_fns f;
    const void *q, *k, *v, *beta;  /* [T, nK, Dk] x2 (token strides ldq, ldk), [T, Hv, Dv] (ldv), [T, Hv]: dtype */
    int64_t ldq, ldk, ldv;
    const float *g;                /* [T, Hv] */
    float *state;                  /* [Hv, Dk, Dv] */
    void *out;                     /* [T, Hv, Dv] dtype */
    _Atomic int failed;            /* a thread's scratch could not be allocated */
} prompt_ctx;

/* One key head's block of n tokens in the thread's scratch: what its value heads share, then one value head's */
typedef struct {
    int64_t n;
    float *kq;        /* [2n, Dk]: the normalised keys, then the normalised and scaled queries */
    float *kT;        /* [Dk, DP_CHUNK]: the keys transposed (columns past n zero) */
    float *kw;        /* [Dk, DP_CHUNK]: a value head's keys decayed to the block's end */
    float *G0, *W0;   /* [n, DP_CHUNK]: k k^T, q k^T (the columns the rule keeps) */
    float *A, *W;     /* [n, DP_CHUNK]: a value head's -A and W */
    float *PQ;        /* [2n, Dv]: k S, then u; q S, then o */
    float *vrow;      /* [Dv]: a token's values in float32 */
    float *cum, *bt;  /* [DP_CHUNK + 8]: c (the 8 past n zero: decays_avx2's loads); [DP_CHUNK] beta */
    float *dr;        /* [DP_CHUNK + 8]: a row of decays */
} block_t;

/* key head kh's n tokens from t0: keys and queries normalised, k transposed, k k^T and q k^T */
static void key_block(const prompt_ctx *a, int64_t kh, int64_t t0, block_t *b) {
    const int64_t n = b->n, Dk = a->Dk;
    const float scale = 1.0f / sqrtf((float)Dk);
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = t0 + i;
        float *kn = b->kq + i * Dk;
        a->f.norm(a->k, t * a->ldk + kh * Dk, Dk, a->bf16, 1.0f, kn);
        a->f.norm(a->q, t * a->ldq + kh * Dk, Dk, a->bf16, scale, b->kq + (n + i) * Dk);
        for (int64_t d = 0; d < Dk; d++) b->kT[d * DP_CHUNK + i] = kn[d];
    }
    if (n < DP_CHUNK)
        for (int64_t d = 0; d < Dk; d++)
            for (int64_t i = n; i < DP_CHUNK; i++) b->kT[d * DP_CHUNK + i] = 0.0f;
    product(&a->f, n, DP_CHUNK, Dk, 0, 1, b->kq, Dk, b->kT, DP_CHUNK, b->G0, DP_CHUNK, 0);           /* k k^T */
    product(&a->f, n, DP_CHUNK, Dk, 0, 1, b->kq + n * Dk, Dk, b->kT, DP_CHUNK, b->W0, DP_CHUNK, 0);  /* q k^T */
}

/* value head h's c and beta, -A (row i: -(G_ij D_ij) beta_i, j < i) and W (W_ij D_ij, j <= i; 0 from i + 1 to the
 * tile's end, the columns the product W u sums over) */
static void decayed(const prompt_ctx *a, int64_t h, int64_t t0, block_t *b) {
    const int64_t n = b->n;
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = t0 + i;
        b->cum[i] = (i ? b->cum[i - 1] : 0.0f) + a->g[t * a->Hv + h];
        b->bt[i] = load_x(a->beta, t * a->Hv + h, a->bf16);
    }
    for (int64_t i = n; i < DP_CHUNK + 8; i++) b->cum[i] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float *G0 = b->G0 + i * DP_CHUNK, *W0 = b->W0 + i * DP_CHUNK, bt = b->bt[i];
        float *A = b->A + i * DP_CHUNK, *W = b->W + i * DP_CHUNK, *dr = b->dr;
        a->f.decays(b->cum, i, dr);
        for (int64_t j = 0; j < i; j++) A[j] = -(G0[j] * dr[j] * bt);
        for (int64_t j = 0; j <= i; j++) W[j] = W0[j] * dr[j];
        const int64_t end = (i / DP_MR + 1) * DP_MR;
        for (int64_t j = i + 1; j < end && j < n; j++) W[j] = 0.0f;
    }
}

/* u = beta (v - e k S) and o = e q S in place of k S and q S (PQ), token by token */
static void right_sides(const prompt_ctx *a, int64_t h, int64_t t0, block_t *b) {
    const int64_t n = b->n, Dv = a->Dv;
    float *u = b->PQ, *o = b->PQ + n * Dv, *x = b->vrow;
    for (int64_t i = 0; i < n; i++, u += Dv, o += Dv) {
        const float e = expf(b->cum[i]), bt = b->bt[i];
        const int64_t at = (t0 + i) * a->ldv + h * Dv;
        if (a->bf16)
            for (int64_t j = 0; j < Dv; j++) x[j] = bf16_float(((const uint16_t *)a->v)[at + j]);
        else
            memcpy(x, (const float *)a->v + at, (size_t)Dv * sizeof(float));
        for (int64_t j = 0; j < Dv; j++) {
            u[j] = (x[j] - e * u[j]) * bt;
            o[j] = o[j] * e;
        }
    }
}

/* value head h's block (after key_block and decayed): its output rows, its state S moved past the block */
static void value_block(const prompt_ctx *a, int64_t h, int64_t t0, block_t *b, float *S) {
    const int64_t n = b->n, Dk = a->Dk, Dv = a->Dv, Hv = a->Hv;
    const kernel_fns *f = &a->f;
    product(f, 2 * n, Dv, Dk, 0, 0, b->kq, Dk, S, Dv, b->PQ, Dv, 0);        /* k S; q S */
    right_sides(a, h, t0, b);
    float *u = b->PQ, *o = b->PQ + n * Dv;
    solve(f, n, Dv, b->A, u);
    product(f, n, Dv, n, 1, 0, b->W, DP_CHUNK, u, Dv, o, Dv, 1);             /* + W u */
    for (int64_t i = 0; i < n; i++) {
        const int64_t at = ((t0 + i) * Hv + h) * Dv;
        if (a->bf16)
            for (int64_t j = 0; j < Dv; j++) ((uint16_t *)a->out)[at + j] = bf16_round(o[i * Dv + j]);
        else
            memcpy((float *)a->out + at, o + i * Dv, (size_t)Dv * sizeof(float));
    }
    const float last = b->cum[n - 1], eb = expf(last);
    for (int64_t j = 0; j < n; j++) b->dr[j] = expf(last - b->cum[j]);
    for (int64_t d = 0; d < Dk; d++)
        for (int64_t j = 0; j < n; j++) b->kw[d * DP_CHUNK + j] = b->kT[d * DP_CHUNK + j] * b->dr[j];
    for (int64_t i = 0; i < Dk * Dv; i++) S[i] = S[i] * eb;
    product(f, Dk, Dv, n, 0, 0, b->kw, DP_CHUNK, u, Dv, S, Dv, 1);          /* + k^T u */
}

/* floats of one thread's block scratch for key / value heads of Dk / Dv */
static int64_t block_floats(int64_t Dk, int64_t Dv) {
    return 4 * DP_CHUNK * Dk + 4 * DP_CHUNK * DP_CHUNK + 2 * DP_CHUNK * Dv + Dv + 3 * DP_CHUNK + 16;
}

/* key head kh through the prompt's blocks in order, each block through the value heads that read kh */
static void key_task(void *c, int64_t kh) {
    prompt_ctx *a = c;
    const int64_t Dk = a->Dk, Dv = a->Dv, r = a->group, C2 = DP_CHUNK * DP_CHUNK;
    float *s = (float *)thread_scratch((size_t)block_floats(Dk, Dv) * sizeof(float));
    if (!s) {
        a->failed = 1;
        return;
    }
    block_t b = {0, s, s + 2 * DP_CHUNK * Dk, s + 3 * DP_CHUNK * Dk, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                 NULL};
    b.G0 = b.kw + DP_CHUNK * Dk;
    b.W0 = b.G0 + C2, b.A = b.W0 + C2, b.W = b.A + C2, b.PQ = b.W + C2;
    b.vrow = b.PQ + 2 * DP_CHUNK * Dv, b.cum = b.vrow + Dv, b.bt = b.cum + DP_CHUNK + 8, b.dr = b.bt + DP_CHUNK;
    for (int64_t t0 = 0; t0 < a->T; t0 += DP_CHUNK) {
        b.n = a->T - t0 < DP_CHUNK ? a->T - t0 : DP_CHUNK;
        key_block(a, kh, t0, &b);
        for (int64_t i = 0; i < r; i++) {
            const int64_t h = a->tiled ? kh + i * a->nK : kh * r + i;
            decayed(a, h, t0, &b);
            value_block(a, h, t0, &b, a->state + h * Dk * Dv);
        }
    }
}

/* The chunked gated delta rule over T tokens of one layer: nK key heads and Hv value heads (a multiple) of Dk / Dv.
 * q, k [T, nK, Dk] (token strides ldq, ldk, in elements; the model's l2 norm and q's scale are applied here), v
 * [T, Hv, Dv] (token stride ldv), beta [T, Hv]: the model's dtype (bf16: 1 bf16, 0 float32); g [T, Hv] float32;
 * state [Hv, Dk, Dv] float32, read and written in place; out [T, Hv, Dv] in the dtype. tiled: value head h reads
 * key head h % nK, else h / (Hv / nK). kernel: sluice_deltanet_kernel's choice, made once per model (one above what
 * this CPU runs is taken down to it). Returns 0, or -1 when a thread's scratch could not be allocated (the state is
 * then partly moved on). */
int sluice_delta_prompt(int64_t T, int64_t nK, int64_t Hv, int64_t Dk, int64_t Dv, int tiled, int bf16,
                        const void *q, int64_t ldq, const void *k, int64_t ldk, const void *v, int64_t ldv,
                        const float *g, const void *beta, float *state, void *out, int kernel) {
    const int best = sluice_deltanet_kernel(0);
    prompt_ctx c = {T, nK, Hv, Dk, Dv, Hv / nK, tiled != 0, bf16 != 0, kernel_of(kernel < best ? kernel : best),
                    q, k, v, beta, ldq, ldk, ldv, g, state, out, 0};
    if (T > 0) pool_run(key_task, &c, nK);
    return c.failed ? -1 : 0;
}

/* ---- the causal conv before the rule, over a prompt ----
 * The depthwise conv of K taps over C channels with silu, token by token what deltanet.c's conv step does for one:
 * y[t, c] = x(silu(x(sum_j w[c, j] seq[c, t + j]))), the taps in order from 0 (acc = 0, then acc + w s each), seq =
 * the channel's last K - 1 inputs (st) followed by the prompt's; st then holds the last K - 1 inputs (as bits). In
 * place of the torch steps' transposing concatenation, conv1d, silu and the copies back to token rows: on the
 * issue-30 model a 2,048-token prompt under cProfile spent ~2.1 s of 12.4 in them (cat 1.11, conv1d 0.45, contiguous
 * 0.36, silu ~0.2) and spends 0.54 s in this call (`benchmarks/results/hybrid/step_profile.py prompt`, before / after:
 * step_profile_prompt_before.txt, step_profile_prompt.txt; 12.4 -> 9.8 s in all, other moments of the VM). Channels go
 * over the pool in blocks of CONV_BLOCK, each block through every token; AVX2 does 8 channels a vector (the AVX-512
 * kernel runs it too), the portable code one: the same operations per channel, so the same bits. */
#define CONV_BLOCK 256
#define CONV_MAX_K 8  /* taps a kernel may have (Qwen3.5 / Qwen3-Next: 4) */
#define CONV_AHEAD 8  /* tokens ahead whose rows of the block are prefetched: a 2,048-token layer of the hybrid benchmark
                       * model, 8,192 channels, 2 threads, 28.8-30.7 -> 25.7-26.5 ms, the same bits
                       * (benchmarks/hybrid/conv_prompt.py, benchmarks/results/hybrid/conv_prompt.txt) */

typedef struct {
    int64_t T, C, K, ldx;
    const void *x, *w;
    void *st, *out;
    int bf16, simd;
} conv_ctx;

/* channels [c0, c1) of token row t: taps from hist (float32 [K - 1][CONV_BLOCK], the block's state as rows) while
 * t + j < K - 1, then from x's rows */
static void conv_cols(const conv_ctx *a, int64_t t, int64_t c0, int64_t c1, const float *hist, const float *wt,
                      int64_t cb) {
    const int64_t K = a->K;
    for (int64_t c = c0; c < c1; c++) {
        float acc = 0.0f;
        for (int64_t j = 0; j < K; j++) {
            const int64_t m = t + j;  /* seq's column: < K - 1 the state */
            const float s = m < K - 1 ? hist[m * CONV_BLOCK + (c - cb)] : load_x(a->x, (m - (K - 1)) * a->ldx + c, a->bf16);
            acc = acc + wt[j * CONV_BLOCK + (c - cb)] * s;
        }
        const float y = round_x(acc, a->bf16), o = y / (1.0f + exp_poly(-y));
        if (a->bf16)
            ((uint16_t *)a->out)[t * a->C + c] = bf16_round(o);
        else
            ((float *)a->out)[t * a->C + c] = o;
    }
}

#if SLUICE_X86
/* 8 values of a row in the model's dtype from element i, as float32 */
AVX2_INLINE __m256 load8_x(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

AVX2 static int64_t conv_avx2(const conv_ctx *a, int64_t t, int64_t c0, int64_t c1, const float *hist,
                              const float *wt, int64_t cb) {
    const int64_t K = a->K;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < K; j++) {
            const int64_t m = t + j;
            const __m256 s = m < K - 1 ? _mm256_loadu_ps(hist + m * CONV_BLOCK + (c - cb))
                                       : load8_x(a->x, (m - (K - 1)) * a->ldx + c, a->bf16);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(wt + j * CONV_BLOCK + (c - cb)), s));
        }
        const __m256 y = a->bf16 ? bf16_rounded8(acc) : acc;
        const __m256 o = _mm256_div_ps(y, _mm256_add_ps(one, exp_poly8(_mm256_xor_ps(y, sign))));
        if (a->bf16)
            store_bf16x8((uint16_t *)a->out + t * a->C + c, o);
        else
            _mm256_storeu_ps((float *)a->out + t * a->C + c, o);
    }
    return c;
}
#endif

static void conv_task(void *p, int64_t i) {
    const conv_ctx *a = (const conv_ctx *)p;
    const int64_t K = a->K, cb = i * CONV_BLOCK, ce = cb + CONV_BLOCK < a->C ? cb + CONV_BLOCK : a->C;
    float hist[(CONV_MAX_K - 1) * CONV_BLOCK], wt[CONV_MAX_K * CONV_BLOCK];
    for (int64_t c = cb; c < ce; c++) {
        for (int64_t j = 0; j < K; j++) wt[j * CONV_BLOCK + (c - cb)] = load_x(a->w, c * K + j, a->bf16);
        for (int64_t j = 0; j < K - 1; j++) hist[j * CONV_BLOCK + (c - cb)] = load_x(a->st, c * (K - 1) + j, a->bf16);
    }
    const int64_t sz = a->bf16 ? 2 : 4;
    for (int64_t t = 0; t < a->T; t++) {
        int64_t c = cb;
        if (t + CONV_AHEAD < a->T) {  /* token rows lie ldx apart (16 KiB and more): the hardware prefetchers stop */
            const char *xn = (const char *)a->x + ((t + CONV_AHEAD) * a->ldx + cb) * sz;
            char *on = (char *)a->out + ((t + CONV_AHEAD) * a->C + cb) * sz;
            for (int64_t off = 0; off < (ce - cb) * sz; off += 64) {
                __builtin_prefetch(xn + off, 0);
                __builtin_prefetch(on + off, 1);
            }
        }
#if SLUICE_X86
        if (a->simd) c = conv_avx2(a, t, cb, ce, hist, wt, cb);
#endif
        conv_cols(a, t, c, ce, hist, wt, cb);
    }
    /* the state: the last K - 1 inputs of seq (the old state's tail when T < K - 1), moved as bits */
    const int64_t n = K - 1;
    for (int64_t c = cb; c < ce; c++) {
        uint8_t *s = (uint8_t *)a->st + c * n * sz;
        for (int64_t j = 0; j < n; j++) {
            const int64_t m = a->T + j;  /* seq's column m, for the new state's column j */
            if (m < n)
                memmove(s + j * sz, s + m * sz, (size_t)sz);
            else
                memcpy(s + j * sz, (const uint8_t *)a->x + ((m - n) * a->ldx + c) * sz, (size_t)sz);
        }
    }
}

/* The conv over T tokens: x [T, C] (token stride ldx, in elements), w [C, K], st [C, K - 1] (updated in place), out
 * [T, C] contiguous, all in the model's dtype (bf16: 1 bf16, 0 float32); kernel as sluice_delta_prompt's. Returns 0,
 * or -2 when K is not within 1..CONV_MAX_K. */
int sluice_conv_prompt(int64_t T, int64_t C, int64_t K, const void *x, int64_t ldx, const void *w, void *st,
                       void *out, int bf16, int kernel) {
    if (K < 1 || K > CONV_MAX_K) return -2;
    const int best = sluice_deltanet_kernel(0), k = kernel < best ? kernel : best;
    conv_ctx c = {T, C, K, ldx, x, w, st, out, bf16 != 0, k != DN_PORTABLE};
    if (T > 0 && C > 0) pool_run(conv_task, &c, (C + CONV_BLOCK - 1) / CONV_BLOCK);
    return 0;
}
