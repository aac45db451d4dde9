/* A prompt's Q4_K projections on 8-bit activations: y[T, N] = x[T, K] @ W^T with integer dot products (AVX512-VNNI
 * vpdpbusd: 64 products of a 4-bit code and an 8-bit code an instruction, twice the multiplies of a bf16 dot
 * product), for the many rows of a prompt's expert at LoadOptions.activations "int8" (decode's int8 path is q8.c);
 * where a prompt's GEMMs are float32 (no bf16 dot products, or --isa avx2) at either coding, on AVX2
 * (prompt_avx2.c, and prompt_q6k.c for Q6_K).
 *
 * Two planes (activations int16): lo = rint((x / D - code) * 256) (clamped to +-127, as q8.c codes it) and its sums
 * per 32 values too, and per super-block the same two fma with the lo plane's integer sums and D / 256 after the
 * first two. The VNNI tiles take one plane only; the AVX2 and portable tiles both.
 *
 * Activations: each x row in super-blocks of 256 values, llama.cpp's Q8_K coding as q8.c's one-plane layout has
 * it: D = amax / 127, code = rint(x * (127 / amax)) (half to even, |code| <= 127), plus the sum of the codes of each
 * 32 values (for Q4_K's mins). Weights: Q4_K as stored, value = d * sc_j * q - dmin * m_j per 32-value sub-block j
 * (q 4-bit, sc_j / m_j 6-bit). Per super-block b of row n and token t, with S1_j = sum of q * code over sub-block j
 * and S2_j = sum of code over it (integers, exact):
 *   acc = fma((float)(sum_j sc_j * S1_j), d * D_t, acc)
 *   acc = fma(-(float)(sum_j m_j * S2_j), dmin * D_t, acc)       y[t, n] = acc after the last super-block
 * The same float operations in the same order on the AVX-512 path (16 rows a vector) and the portable one, so both
 * give the same bits, and row t of y depends on neither T nor the thread that ran it.
 *
 * Layout: each task packs a tile of 16 weight rows: per super-block, per sub-block j, four 64-byte vectors whose
 * byte 4r + i of vector v holds row r's codes 4v + i (low nibble) and 16 + 4v + i (high nibble) of the sub-block;
 * then sc_j as int32 x 16 rows x 8, the mins as int16 pairs (m_2p, m_2p+1) x 16 rows x 4, d and dmin x 16 rows. The
 * tile is packed once and serves every token of the call: 8 tokens at a time, each weight vector loaded once for
 * the 8. */
#include <math.h>

#include "prompt.h"

void sluice_to_bf16(int64_t n, const float *x, uint16_t *out, int scalar);  /* kernels.c */
int sluice_prompt_expert_coded(const uint8_t *gq, int64_t grb, const uint8_t *uq, int64_t urb, int gfmt,
                               const uint8_t *dq, int64_t drb, int dfmt, int64_t H, int64_t I, const uint16_t *x, const uint8_t *xc, int64_t Tc,
                               const int64_t *idx, int64_t T, uint16_t *y, uint16_t *h, int P, int scalar);

#define MR 8                                   /* tokens per kernel pass */

/* ---- activations ---- */

/* one row of K values (float32, or bf16 when bf16) -> K codes, K / 256 scales, K / 32 code sums (int16); lo not
 * NULL: also the second plane lo = rint((x / D - hi) * 256) (clamped to +-127, as q8.c codes it) and its sums sl.
 * Inlined into a portable and an AVX2-target copy (the compiler vectorizes the latter): the same IEEE operations,
 * the same bytes */
static inline __attribute__((always_inline)) void quant_row_body(const void *x, int bf16, int64_t K, int8_t *c,
                                                                 float *d, int16_t *s, int8_t *lo, int16_t *sl) {
    for (int64_t b = 0; b < K; b += 256) {
        float v[256], amax = 0.0f;
        int nan = 0;
        for (int i = 0; i < 256; i++) {
            v[i] = bf16 ? bf16_float(((const uint16_t *)x)[b + i]) : ((const float *)x)[b + i];
            float a = fabsf(v[i]);
            amax = amax > a ? amax : a;  /* maxps's order */
            nan |= v[i] != v[i];
        }
        amax = nan ? 0.0f : amax;  /* a NaN in the block: codes 0 (-127 for the NaN) and scale NaN, on both paths */
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b / 256] = nan ? NAN : amax / 127.0f;
        for (int j = 0; j < 8; j++) {
            int sum = 0, suml = 0;
            for (int i = 32 * j; i < 32 * j + 32; i++) {
                float r = v[i] * inv;  /* clamped as maxps / minps clamp (a NaN becomes -127), then rounded */
                r = r > -127.0f ? r : -127.0f;
                r = r < 127.0f ? r : 127.0f;
                float q = rintf(r);
                c[b + i] = (int8_t)(int)q;
                sum += (int)q;
                if (lo) {  /* r - q is exact; |.| * 256 <= 128 */
                    float l = rintf((r - q) * 256.0f);
                    l = l < 127.0f ? l : 127.0f;
                    lo[b + i] = (int8_t)(int)l;
                    suml += (int)l;
                }
            }
            s[b / 32 + j] = (int16_t)sum;
            if (lo) sl[b / 32 + j] = (int16_t)suml;
        }
    }
}

static void quant_row_scalar(const void *x, int bf16, int64_t K, int8_t *c, float *d, int16_t *s, int8_t *lo,
                             int16_t *sl) {
    quant_row_body(x, bf16, K, c, d, s, lo, sl);
}

/* silu(g) * u = g / (1 + e^-g) * u with common.h's exp_poly, whose AVX-512 twin gives the same bits */
static void silu_mul_scalar(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
}

/* ---- weights ---- */

/* row r's 256 codes (0..15) of Q4_K super-block blk, in value order */
static void q4k_codes(const uint8_t *blk, uint8_t *q) {
    const uint8_t *qs = blk + 16;
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < 32; l++) {
            q[64 * p + l] = qs[32 * p + l] & 15;
            q[64 * p + 32 + l] = qs[32 * p + l] >> 4;
        }
}

/* the tile of rows n0 .. n0 + 15 (rows past N are zeros) of a Q4_K matrix with K / 256 super-blocks a row */
static void pack_tile_scalar(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0, uint8_t *tile) {
    memset(tile, 0, (size_t)(nsb * SB_TILE));
    for (int r = 0; r < TILE_ROWS && n0 + r < N; r++)
        for (int64_t b = 0; b < nsb; b++) {
            const uint8_t *blk = w + (n0 + r) * row_bytes + 144 * b;
            uint8_t *t = tile + b * SB_TILE, q[256];
            q4k_codes(blk, q);
            for (int j = 0; j < 8; j++)
                for (int v = 0; v < 4; v++)
                    for (int i = 0; i < 4; i++)
                        t[256 * j + 64 * v + 4 * r + i] =
                            (uint8_t)(q[32 * j + 4 * v + i] | q[32 * j + 16 + 4 * v + i] << 4);
            tile_scales(t, r, blk);
        }
}

/* ---- the portable kernel: tokens t0 .. t1 of one tile ---- */

/* wide not NULL: the codes one a byte there (Q5_K, prompt_q5k.c), not the tile's nibbles */
void sluice_prompt_tile_scalar(const uint8_t *tile, const uint8_t *wide, int64_t nsb, const xq_t *x, int64_t t0,
                               int64_t t1, int rows, float *y, int64_t ldy) {
    for (int64_t t = t0; t < t1; t++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nsb; b++) {
                const uint8_t *tb = tile + b * SB_TILE;
                const int8_t *xc = x->c + t * x->K + 256 * b;
                const int32_t *sc32 = (const int32_t *)(tb + SB_CODES);
                const int16_t *m16 = (const int16_t *)(tb + SB_CODES + 512);
                const float *df = (const float *)(tb + SB_CODES + 768);
                const int8_t *xl = x->lo ? x->lo + t * x->K + 256 * b : NULL;
                int32_t isum = 0, msum = 0, isl = 0, msl = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t s1 = 0, l1 = 0;
                    for (int v = 0; v < 4; v++)
                        for (int i = 0; i < 4; i++) {
                            int a = 32 * j + 4 * v + i, qa, qb;  /* the codes of values a and a + 16 */
                            if (wide) {
                                const uint8_t *o = wide + b * SB_WIDE + 512 * j + 256 * (r / 8) + 64 * v + 4 * (r % 8);
                                qa = o[i], qb = o[32 + i];
                            } else {
                                uint8_t u = tb[256 * j + 64 * v + 4 * r + i];
                                qa = u & 15, qb = u >> 4;
                            }
                            s1 += qa * xc[a] + qb * xc[a + 16];
                            if (xl) l1 += qa * xl[a] + qb * xl[a + 16];
                        }
                    int32_t m = m16[32 * (j / 2) + 2 * r + (j & 1)];
                    isum += sc32[16 * j + r] * s1;
                    msum += m * x->s[t * (x->K / 32) + 8 * b + j];
                    if (xl) {
                        isl += sc32[16 * j + r] * l1;
                        msl += m * x->sl[t * (x->K / 32) + 8 * b + j];
                    }
                }
                float dx = x->d[t * (x->K / 256) + b];
                acc = fmaf((float)isum, df[r] * dx, acc);
                acc = fmaf(-(float)msum, df[16 + r] * dx, acc);
                if (xl) {  /* the lo plane in 1/256ths of D (prompt_avx2.c: the same operations) */
                    float dxl = dx * (1.0f / 256.0f);
                    acc = fmaf((float)isl, df[r] * dxl, acc);
                    acc = fmaf(-(float)msl, df[16 + r] * dxl, acc);
                }
            }
            y[(t - t0) * ldy + r] = acc;
        }
}

/* ---- AVX512-VNNI ---- */
#if SLUICE_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define VNNI_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vnni")))

static int have_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
}

VNNI static void quant_row_vnni(const void *x, int bf16, int64_t K, int8_t *c, float *d, int16_t *s) {
    for (int64_t b = 0; b < K; b += 256) {
        __m512 v[16], m = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) {
            if (bf16) {
                __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + b + 16 * i));
                v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            } else {
                v[i] = _mm512_loadu_ps((const float *)x + b + 16 * i);
            }
            m = _mm512_max_ps(m, _mm512_abs_ps(v[i]));
        }
        float amax = _mm512_reduce_max_ps(m);  /* max is exact in any order (NaN aside: below) */
        __mmask16 nan = 0;
        for (int i = 0; i < 16; i++) nan |= _mm512_cmp_ps_mask(v[i], v[i], _CMP_UNORD_Q);
        amax = nan ? 0.0f : amax;  /* as the scalar path (the lanes' max saw a NaN or not, by its place) */
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b / 256] = nan ? NAN : amax / 127.0f;
        __m512 vi = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.0f), lo = _mm512_set1_ps(-127.0f);
        for (int j = 0; j < 8; j++) {
            /* rint under the default rounding mode: cvtps_epi32 rounds half to even, as rintf */
            __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v[2 * j], vi), lo), hi));
            __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v[2 * j + 1], vi), lo), hi));
            _mm_storeu_si128((__m128i *)(c + b + 32 * j), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(c + b + 32 * j + 16), _mm512_cvtepi32_epi8(q1));
            s[b / 32 + j] = (int16_t)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
    }
}

VNNI static void silu_mul_vnni(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i);
        __m512 e = exp_poly16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
    silu_mul_scalar(g + i, u + i, n - i);
}

/* 16 rows' dwords at p + r * stride */
VNNI_INLINE __m512i gather16(const uint8_t *p, __m512i offs) { return _mm512_i32gather_epi32(offs, p, 1); }

VNNI static void pack_tile_vnni(const uint8_t *w, int64_t row_bytes, int64_t N, int64_t nsb, int64_t n0,
                                uint8_t *tile) {
    int rows = N - n0 < TILE_ROWS ? (int)(N - n0) : TILE_ROWS;
    if (rows < TILE_ROWS || row_bytes * (TILE_ROWS - 1) > INT32_MAX) {
        pack_tile_scalar(w, row_bytes, N, nsb, n0, tile);
        return;
    }
    __m512i offs = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32((int)row_bytes));
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *base = w + n0 * row_bytes + 144 * b;
        uint8_t *t = tile + b * SB_TILE;
        for (int p = 0; p < 4; p++)      /* 64 values: sub-blocks 2p (low nibbles) and 2p + 1 (high) */
            for (int v = 0; v < 4; v++) {
                __m512i a = gather16(base + 16 + 32 * p + 4 * v, offs);       /* values 4v .. +3 (and +32) */
                __m512i c = gather16(base + 16 + 32 * p + 16 + 4 * v, offs);  /* values 16 + 4v .. (and +32) */
                __m512i e = _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_slli_epi16(_mm512_and_si512(c, m4), 4));
                __m512i o = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), m4),
                                            _mm512_andnot_si512(m4, c));
                _mm512_storeu_si512(t + 256 * (2 * p) + 64 * v, e);
                _mm512_storeu_si512(t + 256 * (2 * p + 1) + 64 * v, o);
            }
        for (int r = 0; r < TILE_ROWS; r++) tile_scales(t, r, base + r * row_bytes);
    }
}

/* tokens t0 .. t0 + NT of one tile; NT a constant at each call so the accumulators stay in registers */
VNNI_INLINE void tile_vnni_n(const uint8_t *tile, int64_t nsb, const xq_t *x, int64_t t0, const int NT, int rows,
                             float *y, int64_t ldy) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int64_t K = x->K;
    __m512 acc[MR];
    __m512i isum[MR], tmp[MR];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *tb = tile + b * SB_TILE;
        const int8_t *xc = x->c + t0 * K + 256 * b;
        for (int t = 0; t < NT; t++) isum[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            for (int t = 0; t < NT; t++) tmp[t] = _mm512_setzero_si512();
            for (int v = 0; v < 4; v++) {
                __m512i u = _mm512_loadu_si512(tb + 256 * j + 64 * v);
                __m512i lo = _mm512_and_si512(u, m4), hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), m4);
                for (int t = 0; t < NT; t++) {
                    const int8_t *p = xc + t * K + 32 * j + 4 * v;
                    tmp[t] = _mm512_dpbusd_epi32(tmp[t], lo, _mm512_set1_epi32((int)rd32(p)));
                    tmp[t] = _mm512_dpbusd_epi32(tmp[t], hi, _mm512_set1_epi32((int)rd32(p + 16)));
                }
            }
            __m512i sc = _mm512_loadu_si512(tb + SB_CODES + 64 * j);
            for (int t = 0; t < NT; t++) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(tmp[t], sc));
        }
        __m512 d = _mm512_loadu_ps((const float *)(tb + SB_CODES + 768));
        __m512 dmin = _mm512_loadu_ps((const float *)(tb + SB_CODES + 768) + 16);
        for (int t = 0; t < NT; t++) {
            const int16_t *s2 = x->s + (t0 + t) * (K / 32) + 8 * b;
            __m512i ms = _mm512_setzero_si512();
            for (int p = 0; p < 4; p++)  /* m_2p * S2_2p + m_2p+1 * S2_2p+1 per row, exact in int32 */
                ms = _mm512_dpwssd_epi32(ms, _mm512_loadu_si512(tb + SB_CODES + 512 + 64 * p),
                                         _mm512_set1_epi32((int)rd32(s2 + 2 * p)));
            __m512 dx = _mm512_set1_ps(x->d[(t0 + t) * (K / 256) + b]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, dx), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dmin, dx), acc[t]);
        }
    }
    __mmask16 keep = (__mmask16)((1u << rows) - 1);
    for (int t = 0; t < NT; t++) _mm512_mask_storeu_ps(y + t * ldy, keep, acc[t]);
}

VNNI static void tile_vnni(const uint8_t *tile, int64_t nsb, const xq_t *x, int64_t t0, int64_t t1, int rows,
                           float *y, int64_t ldy) {
    int64_t t = t0;
    for (; t + MR <= t1; t += MR) tile_vnni_n(tile, nsb, x, t, MR, rows, y + (t - t0) * ldy, ldy);
    float *yt = y + (t - t0) * ldy;
    switch (t1 - t) {
        case 7: tile_vnni_n(tile, nsb, x, t, 7, rows, yt, ldy); break;
        case 6: tile_vnni_n(tile, nsb, x, t, 6, rows, yt, ldy); break;
        case 5: tile_vnni_n(tile, nsb, x, t, 5, rows, yt, ldy); break;
        case 4: tile_vnni_n(tile, nsb, x, t, 4, rows, yt, ldy); break;
        case 3: tile_vnni_n(tile, nsb, x, t, 3, rows, yt, ldy); break;
        case 2: tile_vnni_n(tile, nsb, x, t, 2, rows, yt, ldy); break;
        case 1: tile_vnni_n(tile, nsb, x, t, 1, rows, yt, ldy); break;
        default: break;
    }
}
#else
static int have_vnni(void) { return 0; }
#endif

/* 1 when this CPU runs the AVX512-VNNI path (what makes the int8 prompt path worth taking) */
int sluice_prompt_vnni(void) {
    static int v = -1;
    if (v < 0) v = have_vnni();
    return v;
}

/* ---- jobs over the pool ---- */

typedef struct {
    const void *x;
    int bf16, scalar;
    xq_t xq;
} quant_job;

#if SLUICE_X86
/* 32 float codes (four vectors, each already rounded to an integer value) -> 32 int8 in order, and their sum */
AVX2_INLINE int codes32(const __m256 q[4], int8_t *out) {
    __m256i a = _mm256_cvtps_epi32(q[0]), b = _mm256_cvtps_epi32(q[1]), e = _mm256_cvtps_epi32(q[2]),
            f = _mm256_cvtps_epi32(q[3]);
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(e, f));
    __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(e, f));  /* lanes interleaved */
    w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, w);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* quant_row_body on AVX2 intrinsics: the same IEEE operations lane by lane (maxps / minps as its comparisons,
 * roundps to nearest as rintf in the default rounding mode), so the same bytes. The compiler left the body's loop
 * poorly vectorized: under perf, prompt_tile.py 256 spent 0.58% of its samples here against the tiles' 1.38%; now
 * 0.19% against 1.25%, and 74.0 -> 103.4 GMAC/s one thread in the same runs
 * (benchmarks/results/quantized/breakdown/prompt-tile-perf.txt). */
AVX2 static void quant_row_avx2(const void *x, int bf16, int64_t K, int8_t *c, float *d, int16_t *s, int8_t *lo,
                                int16_t *sl) {
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f), k256 = _mm256_set1_ps(256.0f);
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const int R = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t b = 0; b < K; b += 256) {
        __m256 v[32], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) {
            v[i] = bf16 ? bf16x8((const uint16_t *)x + b + 8 * i) : _mm256_loadu_ps((const float *)x + b + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], sign));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        float m[8];
        _mm256_storeu_ps(m, amax);
        float am = 0.0f;
        for (int i = 0; i < 8; i++) am = am > m[i] ? am : m[i];
        int isnan = _mm256_movemask_ps(nan) != 0;
        am = isnan ? 0.0f : am;
        float inv = am > 0.0f ? 127.0f / am : 0.0f;
        d[b / 256] = isnan ? NAN : am / 127.0f;
        __m256 vinv = _mm256_set1_ps(inv);
        for (int j = 0; j < 8; j++) {
            __m256 q[4], l[4];
            for (int k = 0; k < 4; k++) {
                __m256 r = _mm256_mul_ps(v[4 * j + k], vinv);
                r = _mm256_min_ps(_mm256_max_ps(r, nlim), lim);  /* r > -127 ? r : -127, then r < 127 ? r : 127 */
                q[k] = _mm256_round_ps(r, R);
                if (lo) l[k] = _mm256_min_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(r, q[k]), k256), R), lim);
            }
            s[b / 32 + j] = (int16_t)codes32(q, c + b + 32 * j);
            if (lo) sl[b / 32 + j] = (int16_t)codes32(l, lo + b + 32 * j);
        }
    }
}
#endif

/* row t of x into row t of xq (its second plane too when xq has one) */
static void quant_row(const void *x, int bf16, const xq_t *xq, int64_t t, int scalar) {
    int64_t K = xq->K;
    int8_t *c = (int8_t *)xq->c + t * K, *lo = xq->lo ? (int8_t *)xq->lo + t * K : NULL;
    float *d = (float *)xq->d + t * (K / 256);
    int16_t *s = (int16_t *)xq->s + t * (K / 32), *sl = xq->lo ? (int16_t *)xq->sl + t * (K / 32) : NULL;
#if SLUICE_X86
    if (!lo && sluice_avx512_ok(scalar) && sluice_prompt_vnni()) {
        quant_row_vnni(x, bf16, K, c, d, s);
        return;
    }
    if (sluice_avx2_ok(scalar) && sluice_simd()) {
        quant_row_avx2(x, bf16, K, c, d, s, lo, sl);
        return;
    }
#endif
    quant_row_scalar(x, bf16, K, c, d, s, lo, sl);
}

/* rows a pool task takes in the per-row phases below (coding, gathering, glu, bf16): a task claims a shared counter
 * and counts itself done, two contended atomics; a phase of a 256-row expert took 256 of them. One prompt expert
 * call of the peers model (T = 256, 2 threads, Intel Xeon capped at AVX2): 2.15-2.25 -> 2.02-2.19 ms, 5 of 6 paired
 * runs faster (`benchmarks/quantized/expert_prompt.py`, benchmarks/results/quantized/breakdown/expert-rows.txt) */
#define ROWS_A_TASK 8
#define ROW_TASKS(T) (((T) + ROWS_A_TASK - 1) / ROWS_A_TASK)
/* task i's rows of a phase of T rows: row_fn(c, t) for each */
static inline void rows_of_task(void (*row_fn)(void *, int64_t), void *c, int64_t i, int64_t T) {
    for (int64_t t = i * ROWS_A_TASK; t < T && t < (i + 1) * ROWS_A_TASK; t++) row_fn(c, t);
}

static void quant_task(void *c, int64_t t) {
    const quant_job *j = (const quant_job *)c;
    int64_t K = j->xq.K;
    const void *row = j->bf16 ? (const void *)((const uint16_t *)j->x + t * K)
                              : (const void *)((const float *)j->x + t * K);
    quant_row(row, j->bf16, &j->xq, t, j->scalar);
}
static void quant_rows(void *c, int64_t i) { rows_of_task(quant_task, c, i, ((const quant_job *)c)->xq.T); }

/* bytes of T coded rows of K values at P planes, and the coded rows' layout at p: codes, scales, sums, then with
 * two planes the lo codes and their sums */
static size_t xq_bytes(int64_t T, int64_t K, int P) {
    return (size_t)(P * (T * K + T * (K / 32) * 2) + T * (K / 256) * 4 + 63) / 64 * 64;
}
static xq_t xq_at(uint8_t *p, int64_t T, int64_t K, int P) {
    uint8_t *lo = p + T * K + T * (K / 256) * 4 + T * (K / 32) * 2;
    return (xq_t){.c = (const int8_t *)p, .d = (const float *)(p + T * K),
                  .s = (const int16_t *)(p + T * K + T * (K / 256) * 4),
                  .lo = P == 2 ? (const int8_t *)lo : NULL, .sl = P == 2 ? (const int16_t *)(lo + T * K) : NULL,
                  .K = K, .T = T};
}

/* x [T, K] (float32, or bf16) coded into xq, rows over the pool */
static void quantize(const void *x, int bf16, xq_t xq, int scalar) {
    quant_job j = {.x = x, .bf16 = bf16, .scalar = scalar, .xq = xq};
    pool_run(quant_rows, &j, ROW_TASKS(xq.T));
}

/* x [T, K] bf16 coded at P planes into out (xq_bytes(T, K, P) bytes, the layout xq_at reads): a layer's rows coded
 * once, each expert then gathering its own (sluice_prompt_expert with xc). Returns 0, -2 for bad arguments. */
int sluice_prompt_code(const uint16_t *x, int64_t T, int64_t K, uint8_t *out, int P, int scalar) {
    if (T < 0 || K <= 0 || K % 256 || (P != 1 && P != 2)) return -2;
    if (T) quantize(x, 1, xq_at(out, T, K, P), scalar);
    return 0;
}

int64_t sluice_prompt_code_bytes(int64_t T, int64_t K, int P) { return (int64_t)xq_bytes(T, K, P); }

typedef struct {
    const float *y;
    uint16_t *out;
    int64_t T, N, ldy, ldo;
    int scalar;
} bf16_rows_job;

static void bf16_row(void *c, int64_t t) {
    const bf16_rows_job *j = (const bf16_rows_job *)c;
    sluice_to_bf16(j->N, j->y + t * j->ldy, j->out + t * j->ldo, j->scalar);
}
static void bf16_rows(void *c, int64_t i) { rows_of_task(bf16_row, c, i, ((const bf16_rows_job *)c)->T); }

/* out [T, N] (rows ldo apart) = y [T, N] (float32, rows ldy apart) rounded to bf16 (round to nearest even, NaN to
 * 0x7fc0: torch's .to(torch.bfloat16)), rows over the pool: a prompt projection's output, where torch's conversion
 * took ~2 ms a [2,048 x 1,024] (its profiler, AVX2: the prompt's copy_ 118 -> 15 ms with this and the widening,
 * benchmarks/quantized/prompt_profile.py, benchmarks/results/quantized/breakdown/prompt-profile-2.txt) */
void sluice_prompt_bf16(const float *y, int64_t T, int64_t N, int64_t ldy, uint16_t *out, int64_t ldo, int scalar) {
    bf16_rows_job j = {y, out, T, N, ldy, ldo, scalar};
    if (T > 0 && N > 0) pool_run(bf16_rows, &j, ROW_TASKS(T));
}

typedef struct {
    xq_t from, to;
    const int64_t *idx;
} gather_job;

static void gather_task(void *c, int64_t t) {  /* row idx[t] of `from` into row t of `to`: the same bytes */
    const gather_job *j = (const gather_job *)c;
    int64_t K = j->to.K, r = j->idx[t];
    memcpy((int8_t *)j->to.c + t * K, j->from.c + r * K, (size_t)K);
    memcpy((float *)j->to.d + t * (K / 256), j->from.d + r * (K / 256), (size_t)(K / 256) * 4);
    if (j->to.lo) {
        memcpy((int8_t *)j->to.lo + t * K, j->from.lo + r * K, (size_t)K);
        memcpy((int16_t *)j->to.sl + t * (K / 32), j->from.sl + r * (K / 32), (size_t)(K / 32) * 2);
    }
    memcpy((int16_t *)j->to.s + t * (K / 32), j->from.s + r * (K / 32), (size_t)(K / 32) * 2);
}
static void gather_rows(void *c, int64_t i) { rows_of_task(gather_task, c, i, ((const gather_job *)c)->to.T); }

#define MAX_PROJ 4
typedef struct {
    int scalar, m;
    int64_t nsb, tiles[MAX_PROJ + 1];  /* tiles[a]: the first task of projection a; tiles[m]: all */
    int64_t d[5 * MAX_PROJ];            /* m x (N, codes address, bytes per row, y address, ldy) */
    int fmt[MAX_PROJ];                  /* Q4_K or Q6_K (prompt_q6k.c) */
    const xq_t *xq;
    volatile int failed;                /* a task found no memory for its tile */
} tile_job;

static void tile_task(void *c, int64_t i) {
    const tile_job *j = (const tile_job *)c;
    int a = 0;
    while (j->tiles[a + 1] <= i) a++;
    const int64_t *d = j->d + 5 * a;
    int64_t N = d[0], n0 = (i - j->tiles[a]) * TILE_ROWS, ldy = d[4];
    const uint8_t *w = (const uint8_t *)(intptr_t)d[1];
    float *y = (float *)(intptr_t)d[3] + n0;
    int rows = N - n0 < TILE_ROWS ? (int)(N - n0) : TILE_ROWS;
    /* packed here, used by this task only (the AVX2 tiles' wide codes after it) */
    size_t bytes = j->fmt[a] == Q6_K ? (size_t)sluice_prompt_q6k_tile_bytes(j->nsb)
                                     : (size_t)(j->nsb * (SB_TILE + SB_WIDE));
    uint8_t *tile = thread_scratch(bytes);
    if (!tile) {
        ((tile_job *)j)->failed = 1;
        return;
    }
    if (j->fmt[a] != Q4_K) {
        int avx2 = SLUICE_X86 && sluice_avx2_ok(j->scalar) && sluice_simd();
        if (j->fmt[a] == Q6_K) sluice_prompt_q6k_tile(w, d[2], N, j->nsb, n0, tile, j->xq, rows, y, ldy, avx2);
        else sluice_prompt_q5k_tile(w, d[2], N, j->nsb, n0, tile, j->xq, rows, y, ldy, avx2);
        return;
    }
#if SLUICE_X86
    if (!j->xq->lo && sluice_avx512_ok(j->scalar) && sluice_prompt_vnni()) {  /* one plane: the VNNI tiles */
        pack_tile_vnni(w, d[2], N, j->nsb, n0, tile);
        tile_vnni(tile, j->nsb, j->xq, 0, j->xq->T, rows, y, ldy);
        return;
    }
    if (sluice_avx2_ok(j->scalar) && sluice_simd()) {
        if (rows == TILE_ROWS && d[2] * (TILE_ROWS - 1) <= INT32_MAX)
            sluice_prompt_pack_avx2(w + n0 * d[2], d[2], j->nsb, tile);
        else
            pack_tile_scalar(w, d[2], N, j->nsb, n0, tile);
        sluice_prompt_tile_avx2(tile, tile + j->nsb * SB_TILE, 0, j->nsb, j->xq, rows, y, ldy);
        return;
    }
#endif
    pack_tile_scalar(w, d[2], N, j->nsb, n0, tile);
    sluice_prompt_tile_scalar(tile, NULL, j->nsb, j->xq, 0, j->xq->T, rows, y, ldy);
}

/* descs: m x (format, N, codes address, bytes per row, y address, ldy); 0, or -1 for a bad descriptor (a format
 * other than Q4_K / Q6_K, or rows shorter than K's blocks) */
static int tile_setup(tile_job *j, int64_t m, const int64_t *descs, int64_t K) {
    j->m = (int)m;
    j->nsb = K / 256;
    j->tiles[0] = 0;
    for (int64_t a = 0; a < m; a++) {
        const int64_t *e = descs + 6 * a;
        if ((e[0] != Q4_K && e[0] != Q5_K && e[0] != Q6_K) || e[1] < 1
            || e[3] < (e[0] == Q4_K ? 144 : e[0] == Q5_K ? 176 : 210) * j->nsb)
            return -1;
        j->fmt[a] = (int)e[0];
        j->tiles[a + 1] = j->tiles[a] + (e[1] + TILE_ROWS - 1) / TILE_ROWS;
        for (int k = 0; k < 5; k++) j->d[5 * a + k] = e[1 + k];
    }
    return 0;
}

/* y_a [T, N_a] (float32, rows ldy_a apart) = x [T, K] @ W_a^T for m <= 4 Q4_K / Q6_K projections of one x (an
 * expert's gate and up; its down), x float32 or bf16 (bf16 = 1), K a multiple of 256: x coded once at P planes,
 * the 16-row tiles of all projections split over the pool. descs: m x (format, N, codes address, bytes per row,
 * y address, ldy). Each y element is the same bits whichever thread ran it and whatever T. Returns 0, -1 when the
 * scratch cannot be allocated, -2 for bad arguments. */
int sluice_prompt_linears(int64_t m, const int64_t *descs, int64_t K, const void *x, int bf16, int64_t T, int P,
                      int scalar) {
    if (m < 1 || m > MAX_PROJ || K <= 0 || K % 256 || T < 0 || (P != 1 && P != 2)) return -2;
    if (T == 0) return 0;
    tile_job j = {.scalar = scalar};
    if (tile_setup(&j, m, descs, K) < 0) return -2;
    int owned;
    uint8_t *buf = keep_take(xq_bytes(T, K, P), &owned);
    if (!buf) return -1;
    xq_t xq = xq_at(buf, T, K, P);
    j.xq = &xq;
    quantize(x, bf16, xq, scalar);
    pool_run(tile_task, &j, j.tiles[m]);
    keep_give(buf, owned);
    return j.failed ? -1 : 0;
}

/* ---- one SwiGLU expert ---- */

typedef struct {
    float *gu;         /* [T, 2I]: gate | up, then silu(gate) * up over the gate half */
    int64_t I;
    xq_t xq;           /* the product coded for the down (xq.c NULL: written as bf16 to h) */
    uint16_t *h;
    int scalar;
    int64_t T;
} glu_job;

static void glu_task(void *c, int64_t t) {
    const glu_job *j = (const glu_job *)c;
    float *g = j->gu + t * 2 * j->I, *u = g + j->I;
#if SLUICE_X86
    if (sluice_avx512_ok(j->scalar) && sluice_prompt_vnni())
        silu_mul_vnni(g, u, j->I);
    else if (sluice_avx2_ok(j->scalar) && sluice_simd())
        sluice_prompt_silu_mul_avx2(g, u, j->I);
    else
#endif
        silu_mul_scalar(g, u, j->I);
    if (j->xq.c)
        quant_row(g, 0, &j->xq, t, j->scalar);
    else
        sluice_to_bf16(j->I, g, j->h + t * j->I, j->scalar);
}
static void glu_rows(void *c, int64_t i) { rows_of_task(glu_task, c, i, ((const glu_job *)c)->T); }

/* y [T, H] bf16 = down(silu(gate x) * up x) for x [T, H] bf16, gate and up [I, H] of format gfmt (Q4_K, or Q5_K
 * / Q6_K on the AVX2 and portable tiles; gq / uq and their bytes
 * per row; uq NULL: gq holds [gate; up] as one [2I, H] matrix), in one call: x coded once, gate and up tiles over
 * the pool, silu(g) * u in float32 (exp_poly) per row, then a Q4_K or Q6_K down (dfmt; dq not NULL; I a multiple
 * of 256) on the product coded again, its float32 rows rounded to bf16 into y; with dq NULL the product is written
 * rounded to bf16 into h [T, I] for the caller's down. Returns 0, -1 when the scratch cannot be allocated, -2 for bad
 * arguments. */
int sluice_prompt_expert(const uint8_t *gq, int64_t grb, const uint8_t *uq, int64_t urb, int gfmt,
                         const uint8_t *dq, int64_t drb, int dfmt, int64_t H, int64_t I, const uint16_t *x, int64_t T, uint16_t *y,
                         uint16_t *h, int P, int scalar) {
    return sluice_prompt_expert_coded(gq, grb, uq, urb, gfmt, dq, drb, dfmt, H, I, x, NULL, 0, NULL, T, y, h, P, scalar);
}

/* sluice_prompt_expert on rows idx[0 .. T) of a layer's coded rows xc (sluice_prompt_code of Tc rows) when xc is
 * not NULL (x unused): each row's codes are the bytes coding it alone gives, so the result is the same bits */
int sluice_prompt_expert_coded(const uint8_t *gq, int64_t grb, const uint8_t *uq, int64_t urb, int gfmt,
                               const uint8_t *dq, int64_t drb, int dfmt, int64_t H, int64_t I, const uint16_t *x, const uint8_t *xc, int64_t Tc,
                               const int64_t *idx, int64_t T, uint16_t *y, uint16_t *h, int P, int scalar) {
    if (P != 1 && P != 2) return -2;
    if (H <= 0 || H % 256 || I <= 0 || (dq && I % 256) || T < 0 || (!dq && !h) || (dq && !y)) return -2;
    if (xc && !idx) return -2;
    for (int64_t t = 0; xc && t < T; t++)
        if (idx[t] < 0 || idx[t] >= Tc) return -2;
    if (T == 0) return 0;
    tile_job up = {.scalar = scalar}, dn = {.scalar = scalar};
    float *gu_base = NULL;
    int64_t du[12] = {gfmt, I, (intptr_t)gq, grb, 0, 2 * I, gfmt, I, (intptr_t)uq, urb, 0, 2 * I};
    if (!uq) du[1] = 2 * I;
    int64_t dd[6] = {dfmt, H, (intptr_t)dq, drb, 0, H};
    if (tile_setup(&up, uq ? 2 : 1, du, H) < 0 || (dq && tile_setup(&dn, 1, dd, I) < 0)) return -2;
    size_t xb = xq_bytes(T, H, P), gb = (size_t)(T * 2 * I) * 4;
    size_t hb = dq ? xq_bytes(T, I, P) : 0, yb = dq ? (size_t)(T * H) * 4 : 0;
    int owned;
    uint8_t *buf = keep_take(xb + gb + hb + yb, &owned);
    if (!buf) return -1;
    xq_t xq = xq_at(buf, T, H, P);
    gu_base = (float *)(buf + xb);
    up.d[3] = (intptr_t)gu_base;
    up.d[8] = (intptr_t)(gu_base + I);
    up.xq = &xq;
    if (xc) {
        gather_job gj = {.from = xq_at((uint8_t *)xc, Tc, H, P), .to = xq, .idx = idx};
        pool_run(gather_rows, &gj, ROW_TASKS(T));
    } else {
        quantize(x, 1, xq, scalar);
    }
    pool_run(tile_task, &up, up.tiles[up.m]);
    glu_job g = {.gu = gu_base, .I = I, .h = h, .scalar = scalar, .T = T};
    if (dq) g.xq = xq_at(buf + xb + gb, T, I, P);
    pool_run(glu_rows, &g, ROW_TASKS(T));
    if (dq) {
        float *yf = (float *)(buf + xb + gb + hb);
        dn.d[3] = (intptr_t)yf;
        dn.xq = &g.xq;
        pool_run(tile_task, &dn, dn.tiles[1]);
        sluice_prompt_bf16(yf, T, H, H, y, H, scalar);
    }
    keep_give(buf, owned);
    return up.failed || dn.failed ? -1 : 0;
}

/* n experts of one format on rows of a layer's coded x (sluice_prompt_code of Tc rows), one call for a pass's
 * experts already in memory (the Python loop around each call: experts_run - experts_C 0.06-0.08 s of a 2,048-token
 * prompt of the peers model before, 0.005 now: `benchmarks/quantized/breakdown.py prompt --isa avx2`,
 * benchmarks/results/quantized/breakdown/prompt-avx2-5.txt and expert-loop.txt). Expert e: its stored bytes at
 * w[e] (gate rows there, up at + uo, or uo < 0 for gate and up as one [2I, H] matrix; down at + dof), its rows
 * idx[a[e] .. a[e] + T[e]) of xc (idx and y: nrows rows), its output bf16 rows y + a[e] * H. Each expert is
 * sluice_prompt_expert_coded, in the order given; the same bits. Returns 0, or the first nonzero code
 * (-1 no memory, -2 bad arguments). */
int sluice_prompt_experts_coded(int64_t n, const int64_t *w, const int64_t *a, const int64_t *T, int64_t grb,
                                int64_t uo, int64_t urb, int gfmt, int64_t dof, int64_t drb, int dfmt, int64_t H,
                                int64_t I, const uint8_t *xc, int64_t Tc, const int64_t *idx, int64_t nrows,
                                uint16_t *y, int P, int scalar) {
    for (int64_t e = 0; e < n; e++) {
        const uint8_t *base = (const uint8_t *)(intptr_t)w[e];
        if (!base || a[e] < 0 || T[e] < 0 || a[e] + T[e] > nrows) return -2;
        int rc = sluice_prompt_expert_coded(base, grb, uo < 0 ? NULL : base + uo, urb, gfmt, base + dof, drb, dfmt, H,
                                            I, NULL, xc, Tc, idx + a[e], T[e], y + a[e] * H, NULL, P, scalar);
        if (rc) return rc;
    }
    return 0;
}
