/* Shared by kernels.c (float path) and q8.c (int8 path): the weight descriptor, the formats, exact scalar
 * readers of the stored fields, and the AVX2 helpers both paths use. */
#ifndef SLUICE_NATIVE_COMMON_H
#define SLUICE_NATIVE_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the stored formats are little-endian and read as such here (x86-64, aarch64)"
#endif

/* the AVX2 path is compiled on x86 (-DSLUICE_NO_SIMD builds the portable path alone, as on aarch64) */
#if (defined(__x86_64__) || defined(__i386__)) && !defined(SLUICE_NO_SIMD)
#define SLUICE_X86 1
#else
#define SLUICE_X86 0
#endif

/* The `scalar` argument of every entry point caps the vector code a call may run, so that one CPU tests each path
 * (the Python side passes the model's Compute.path, LoadOptions.isa; tests pass each): 0 the best this CPU has, 1 the portable C
 * only, 2 at most AVX2 (no AVX-512 path: what an AVX2-only CPU runs). */
#define SLUICE_PATH_SCALAR 1
#define SLUICE_PATH_AVX2 2
static inline int sluice_avx2_ok(int scalar) { return scalar != SLUICE_PATH_SCALAR; }
static inline int sluice_avx512_ok(int scalar) { return scalar == 0; }

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, MLX4, MLX8, MXFP4_OAI,
       FP8,  /* float8_e4m3fn codes [N, K] with block scales in s (fp8.h says how sdt and gs describe them) */
       Q2_K, Q3_K, TQ1_0, TQ2_0, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, N_FORMATS };
/* MXFP4_OAI: gpt-oss's *_blocks [N, K/32, 16] (value 2i the low nibble of byte i) and *_scales [N, K/32] (in s).
 * Q2_K ... IQ1_M: the low-bit GGUF types, dequantized by lowbit.c, on the integer path in q8_low.c */
#define LOW_FIRST Q2_K
static inline int is_lowbit(int fmt) { return fmt >= LOW_FIRST && fmt <= IQ1_M; }
/* lowbit.c: row n of a low-bit weight -> its K float32 values, bitwise gguf's dequantization (portable C); the same
 * from the AVX2 unpacking (q8_low.c, x86 only) */
void lowbit_deq_row(int fmt, const uint8_t *row, int64_t K, float *o);
void lowbit_deq_row_avx2(int fmt, const uint8_t *row, int64_t K, float *o);
enum { S_F32, S_F16, S_BF16 };  /* MLX scale / bias dtype */

typedef struct {
    int fmt;
    int64_t N, K;
    const uint8_t *q;     /* ggml: the blocks [N, row_bytes]; MLX: the packed codes [N, K * bits / 8] */
    int64_t row_bytes;
    const uint8_t *s, *b; /* MLX scales and biases [N, K / gs] in dtype sdt; MXFP4_OAI: the exponents in s */
    int sdt, gs;
} wdesc;

/* ---- exact scalar helpers (shared by both paths) ---- */

static inline float f32_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023;
    if (e == 0) {  /* zero or subnormal: m * 2^-24, exact in float32 */
        float f = (float)m * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    if (e == 31) return f32_bits(sign | 0x7f800000u | (m << 13));
    return f32_bits(sign | ((e + 112) << 23) | (m << 13));
}

static inline float bf16_float(uint16_t h) { return f32_bits((uint32_t)h << 16); }

/* ggml's e8m0_to_fp32_half: 2^(e - 128), e < 2 the subnormals */
static inline float e8m0_half(uint8_t e) { return f32_bits(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

/* float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (c10::BFloat16's round_to_nearest_even) */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* the sum of 8 float lanes in one fixed order (the integer path's rows, the bf16 rms_norm and dot products) */
static inline float reduce8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline float rdf16(const uint8_t *p) { return f16_to_f32(rd16(p)); }
static inline uint32_t rd32(const void *p) { uint32_t v; memcpy(&v, p, 4); return v; }  /* any alignment */

/* Q4_K / Q5_K: the 12 packed scale bytes -> 8 scales and 8 mins (ggml's get_scale_min_k4), four bytes at a time:
 * scales 0-3 / mins 0-3 are the low 6 bits of bytes 0-3 / 4-7; scales 4-7 (mins 4-7) the low (high) nibbles of
 * bytes 8-11 with the top 2 bits of bytes 0-3 (4-7) above them */
static inline void k_scale_min(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    uint32_t u0, u1, u2, v;
    memcpy(&u0, q, 4);
    memcpy(&u1, q + 4, 4);
    memcpy(&u2, q + 8, 4);
    v = u0 & 0x3f3f3f3fu; memcpy(sc, &v, 4);
    v = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u); memcpy(sc + 4, &v, 4);
    v = u1 & 0x3f3f3f3fu; memcpy(mn, &v, 4);
    v = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u); memcpy(mn + 4, &v, 4);
}

/* e^z from a fixed polynomial (Cephes' expf: z = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n),
 * written once as plain float operations so that the AVX2 and AVX-512 copies below, doing the same operations in the
 * same order, give the same bits (libm's expf has no vector twin); within 2 ulp of e^z. z is clamped to [-87, 88]
 * first (e^z stays a normal float; silu of g < -88 is then g * 6e-39 instead of g * e^g, both ~0). */
static inline float exp_poly(float z) {
    z = z > -87.0f ? z : -87.0f;  /* maxps / minps order: a NaN becomes -87 */
    z = z < 88.0f ? z : 88.0f;
    float n = rintf(z * 1.44269504088896341f);
    float r = z - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * f32_bits((uint32_t)((int32_t)n + 127) << 23);
}

/* 1 when the CPU has AVX512_BF16 with AVX512 F / BW / VL / DQ (kernels.c; computed once) */
int sluice_cpu_avx512bf16(void);
/* 1 when the CPU has AVX512F (kernels.c; computed once): deltanet.c's 16-column state blocks */
int sluice_cpu_avx512f(void);
/* 1 when the AVX2 + FMA + F16C path runs on this CPU (kernels.c) */
int sluice_simd(void);

/* pool.c: fn(ctx, i) for i in [0, ntasks) over the threads sluice_set_threads allows, the caller included; returns
 * when all have run */
typedef void (*task_fn)(void *ctx, int64_t i);
void pool_run(task_fn fn, void *ctx, int64_t ntasks);
/* pool.c: a job the workers start on while the caller goes on with other work (1; pool_finish then runs what is
 * left of it and waits for the rest), or 0 where it could not start (one thread, no workers, the pool busy: the
 * caller runs it with pool_run). ctx lives until pool_finish returns. */
int pool_start(task_fn fn, void *ctx, int64_t ntasks);
void pool_finish(void);
int sluice_threads(void);
/* pool.c: a scratch of n bytes (64-aligned) for one call, the kept buffer when free (*owned 0) or a new allocation
 * (*owned 1; NULL when memory is short); keep_give returns it */
uint8_t *keep_take(size_t n, int *owned);
void keep_give(uint8_t *p, int owned);
/* pool.c: this thread's own scratch of n bytes (64-aligned; NULL when memory is short), kept for its next call and
 * freed when the thread exits */
uint8_t *thread_scratch(size_t n);

/* ops.c, also called by decode.c */
void sluice_rms_norm_bf16(int64_t rows, int64_t n, const uint16_t *x, const uint16_t *w, float eps, uint16_t *out,
                          int scalar);
void sluice_rms_norm_scaled_bf16(int64_t rows, int64_t n, const uint16_t *x, const float *w, float eps, uint16_t *out,
                                 int scalar);
void sluice_rope_bf16(int64_t heads, int64_t T, int64_t D, int64_t rot, const uint16_t *x, int64_t sh, int64_t st,
                      const uint16_t *cos, const uint16_t *sin, uint16_t *out, int scalar);

#if SLUICE_X86
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* bits 0-15 of m -> 16 bytes, 0x10 where the bit is set (Q5 high bits) */
AVX2_INLINE __m128i bits16(uint32_t m) {
    __m128i byte = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);  /* byte j: bits 8(j/8)..+7 */
    __m128i v = _mm_shuffle_epi8(_mm_set1_epi16((short)m), byte);
    __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, bit), bit), _mm_set1_epi8(0x10));
}

AVX2_INLINE float f16c(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* 8 bf16 values -> float32 */
AVX2_INLINE __m256 bf16x8(const uint16_t *p) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}

/* float32 bits -> bf16 bits in the low half of each lane, as bf16_round (round to nearest even, NaN -> 0x7FC0) */
AVX2_INLINE __m256i bf16_bits8(__m256i u) {
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    r = _mm256_srli_epi32(r, 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

/* 8 floats rounded to bf16 (bf16_round), back as floats */
AVX2_INLINE __m256 bf16_rounded8(__m256 x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(_mm256_castps_si256(x)), 16));
}

/* 8 floats rounded to bf16 (bf16_round), stored as 8 bf16 values */
AVX2_INLINE void store_bf16x8(uint16_t *p, __m256 x) {
    __m256i b = bf16_bits8(_mm256_castps_si256(x));  /* low halves: pack them (packus works per 128-bit lane) */
    __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}

/* exp_poly on 8 lanes: the same operations in the same order, so the same bits */
AVX2_INLINE __m256 exp_poly8(__m256 z) {
    z = _mm256_max_ps(z, _mm256_set1_ps(-87.0f));
    z = _mm256_min_ps(z, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(z, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(z, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(1.9875691500e-4f), r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))
/* exp_poly on 16 lanes: the same operations in the same order, so the same bits */
AVX512_INLINE __m512 exp_poly16(__m512 z) {
    z = _mm512_max_ps(z, _mm512_set1_ps(-87.0f));
    z = _mm512_min_ps(z, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(z, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(1.9875691500e-4f), r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

#endif
