/* What q8.c (the integer path of the Q4_0 - Q6_K formats) and q8_low.c (the low-bit GGUF types) share: the
 * layouts of the quantized x rows, exact readers of their fields, the fixed-order float reductions, and the
 * per-row kernel type. Every order here is part of the bits both C paths must agree on. */
#ifndef SLUICE_NATIVE_Q8_H
#define SLUICE_NATIVE_Q8_H

#include "common.h"

/* bytes of one quantized 32-value block with P planes of codes (1 or 2) */
#define XB(P) (8 + 32 * (P))

/* Super-block layout (XF = 3), the K-quants' with two planes: per 256 values float d, int32 bsum[16] (the sum of
 * the combined codes 256 * hi + lo of each 16 values), int8 hi[256], int8 lo[256]; hi and lo as quant_block
 * computes them with one D = amax / 127 for the 256 values. A K-quant block's sub-blocks then sum in integers
 * (sub-block scale times codes times codes) and convert to float once per 256 values, as llama.cpp's Q4_K x Q8_K
 * does, where the 32-value layout converts once per 32. A token's 128 experts of the peers shape (Q4_K gate / up,
 * Q4_K or Q6_K down) took ~10% less on one thread, the same on two (memory-bound there), alternated in one process
 * (`benchmarks/knobs.py layouts`). The two planes keep x to ~1/32,000 of the 256-block max (llama.cpp's
 * Q8_K: 1/127). */
#define SB 580
#define SB_HI 68
#define SB_LO 324
/* XF = 4, the K-quants' with one plane (llama.cpp's Q8_K: x to 1/127 of the 256-block max): the same without lo,
 * bsum the sums of hi, d = D */
#define SB1 324
#define SB_BYTES(P) ((P) == 2 ? SB : SB1)

/* the super-block layout for P planes, and the planes of a super-block layout */
static inline int sb_xf(int P) { return P == 2 ? 3 : 4; }
static inline int sb_planes(int XF) { return XF == 3 ? 2 : 1; }

/* q8.c's SwiGLU experts of one x (sluice_experts_q8), their scratch and steps, held between experts_q8_start and
 * experts_q8_finish (moe_decode.c) */
typedef struct {
    const int64_t *e;  /* n x (gate format, codes, bytes per row, up ..., down ..., y address) */
    int64_t H, I, T, step1, tasks1, step3, tasks3, hrb;
    uint8_t *xq[2];
    float *g, *u;
    uint8_t *hq;
    int P, scalar;
} exp_job;

typedef struct {
    exp_job j;
    uint8_t *xbuf;
    float *gu;
    int64_t n;    /* experts in flight (0: none, nothing to free) */
    int started;  /* their gate and up rows on the pool's workers (pool_start) */
} experts_run;

int experts_q8_start(experts_run *r, int64_t n, const int64_t *experts, int64_t H, int64_t I, const float *x,
                     int64_t T, int P, int scalar);
void experts_q8_finish(experts_run *r);

static inline float rdf32(const uint8_t *p) { float f; memcpy(&f, p, 4); return f; }
static inline int32_t rdi32(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

static inline float reduce16(const float *a0, const float *a1) {
    float a[8];
    for (int l = 0; l < 8; l++) a[l] = a0[l] + a1[l];
    return reduce8(a);
}

/* one weight row against R <= 4 quantized x rows (row r at xq + r * rb): y[r * ldy] */
typedef void (*dot_fn)(const uint8_t *row, const uint8_t *xq, int64_t rb, int64_t K, float *y, int64_t ldy);

/* rows n0 .. n1 - 1 of the weights q (row n at q + n * row_bytes) against ONE quantized x row: y[n], each row's dot
 * as the R = 1 dot_fn computes it (the same bits), the lines pf bytes past each row's start prefetched (ROWS_BODY,
 * q8.c's rows_q8 loop for every T). A decode token's projections are this: one call per task instead of one indirect
 * call per row, whose prologue, epilogue and row loop cost about a fifth of a 168-byte Q2_K row's time */
typedef void (*rows_fn)(const uint8_t *q, int64_t row_bytes, const uint8_t *xq, int64_t K, float *y, int64_t n0,
                        int64_t n1, int64_t pf);

/* a task's row loop (q, row_bytes, n0, n1, pf in scope): the lines pf bytes ahead prefetched, then CALL on `row` */
#define ROWS_BODY(CALL)                                                                                                \
    for (int64_t n = n0; n < n1; n++) {                                                                                \
        const uint8_t *row = q + n * row_bytes;                                                                        \
        if (pf) { /* the lines of [start + pf, next start + pf), within the task's rows */                             \
            const uint8_t *a = row + pf, *e = q + n1 * row_bytes;                                                      \
            for (const uint8_t *p = a; p < a + row_bytes && p < e; p += 64)                                            \
                _mm_prefetch((const char *)p, _MM_HINT_T0);                                                            \
        }                                                                                                              \
        CALL;                                                                                                          \
    }

/* q8_low.c: the low-bit GGUF types (MXFP4, Q2_K, Q3_K, TQ1_0, TQ2_0, the IQ types) on the integer path */
int low_q8_has(int fmt);        /* 1 when q8_low.c computes fmt */
int low_q8_sb(int fmt);         /* 1 when fmt reads x in super-blocks (every 256-value type), 0: 32-value blocks */
/* the dot product of one weight row with one quantized x row in the layout XF (portable C) */
float low_q8_dot_scalar(int fmt, const uint8_t *row, const uint8_t *xq, int64_t K, int XF);

#if SLUICE_X86
dot_fn low_q8_dot_avx2(int fmt, int XF, int R);  /* the AVX2 kernel of fmt for layout XF and R x rows */
rows_fn low_q8_rows_avx2(int fmt, int XF);       /* its rows at one x row */

/* f * (float)(w . x per 4 values, times the int16 scales sc), the 8 lane terms; sign: w signed (abs / sign trick) */
AVX2_INLINE __m256 lanes_avx2(__m256i w, const uint8_t *xb, __m256i sc, float f, int sign, int P) {
    __m256i x = _mm256_loadu_si256((const __m256i *)(xb + 8)), aw = sign ? _mm256_sign_epi8(w, w) : w;
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sign ? _mm256_sign_epi8(x, w) : x), sc);
    if (P == 2) {  /* 256 * (w . hi) + w . lo: exact in int32 (|.| < 2^30 for every format) */
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(xb + 40));
        __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sign ? _mm256_sign_epi8(x2, w) : x2), sc);
        p = _mm256_add_epi32(_mm256_slli_epi32(p, 8), p2);
    }
    return _mm256_mul_ps(_mm256_set1_ps(f), _mm256_cvtepi32_ps(p));
}

/* reduce16(l0, l1) + m in registers, reduce8's order: a = l0 + l1, then (a0 + a4, a1 + a5, a2 + a6, a3 + a7) from
 * the two halves, then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
AVX2_INLINE float sum8(__m256 a) {  /* reduce8(a) */
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
AVX2_INLINE float finish(__m256 l0, __m256 l1, float m) { return sum8(_mm256_add_ps(l0, l1)) + m; }


AVX2_INLINE __m256i nibbles32(const uint8_t *p) {  /* 16 bytes -> low nibbles (values 0-15), high (16-31) */
    __m128i qs = _mm_loadu_si128((const __m128i *)p), m4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), m4), _mm_and_si128(qs, m4));
}

/* the int16 scale of 16-value group g (0..7) of a 128-bit lane, broadcast: byte shuffle masks (2g, 2g + 1) */
AVX2_INLINE __m256i pick16(__m256i v, int g0, int g1) {  /* low lane: group g0 of v's low lane; high: g1 of high */
    const __m256i m = _mm256_setr_epi8(2 * g0, 2 * g0 + 1, 2 * g0, 2 * g0 + 1, 2 * g0, 2 * g0 + 1, 2 * g0, 2 * g0 + 1,
                                       2 * g0, 2 * g0 + 1, 2 * g0, 2 * g0 + 1, 2 * g0, 2 * g0 + 1, 2 * g0, 2 * g0 + 1,
                                       2 * g1, 2 * g1 + 1, 2 * g1, 2 * g1 + 1, 2 * g1, 2 * g1 + 1, 2 * g1, 2 * g1 + 1,
                                       2 * g1, 2 * g1 + 1, 2 * g1, 2 * g1 + 1, 2 * g1, 2 * g1 + 1, 2 * g1, 2 * g1 + 1);
    return _mm256_shuffle_epi8(v, m);
}
#endif

#endif
