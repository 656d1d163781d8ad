/* Float helpers the decode (decode_attention*.c) and prefill (prefill_attention.c) attention
 * kernels share, so that both convert and round the same way: bfloat16 <-> float32, and
 * the softmax's exp(x) for x <= 0. */
#ifndef KVTIER_FLOAT_H
#define KVTIER_FLOAT_H

#include <stdint.h>
#include <string.h>

/* bfloat16 is a float32's top half. */
static inline float kvt_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 does; NaN stays a (quiet) NaN.
 * Branch-free, so loops of it vectorise. */
static inline uint16_t kvt_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t rounded = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    const uint16_t nan = (uint16_t)((u >> 16) | 0x40u);
    return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

/* What the attention kernels read a pool's elements as (a job's `kind`, and a constant in each
 * specialised variant): the model's float32 or bfloat16, 8-bit quants (times their rows' scales), or
 * float16 KV under a float32 or bfloat16 model. From KVT_I8 on, the pool's dtype is not q's: the
 * kernels widen its elements as they read them. */
enum { KVT_F32 = 0, KVT_BF16 = 1, KVT_I8 = 2, KVT_E4M3 = 3, KVT_F16 = 4 };

static inline int kvt_kind_scaled(int kind) { return kind == KVT_I8 || kind == KVT_E4M3; }
static inline int kvt_kind_bytes(int kind) { return kind == KVT_F32 ? 4 : kind == KVT_BF16 || kind == KVT_F16 ? 2 : 1; }

/* float16 as float32, exactly: as for e4m3 below, the magnitude bits moved under a float32's
 * exponent read 2^-112 too small (subnormals included) and are scaled back; infinities and NaNs
 * (exponent all ones) keep their meaning. */
static inline float kvt_f16_to_f32(uint16_t h) {
    const uint32_t mag = h & 0x7fffu;
    uint32_t u = mag << 13;
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p112f;
    memcpy(&u, &f, 4);
    if (mag >= 0x7c00u) u = 0x7f800000u | (mag & 0x3ffu) << 13;
    u |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &u, 4);
    return f;
}

/* f to the nearest float16, ties to even, as torch's float -> float16 rounds (its F16C path, NaNs
 * included): past 65,504 by half a step or more it is an infinity, below 2^-14 steps are 2^-24
 * apart (subnormals). */
static inline uint16_t kvt_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu); /* NaN: quieted, payload's top bits kept */
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* 65,520 and up: infinity */
    if (a >= 0x38800000u) return sign | (uint16_t)(((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10));
    float x;
    memcpy(&x, &a, 4);
    return sign | (uint16_t)__builtin_nearbyintf(x * 16777216.0f); /* 1024 is 2^-14's code */
}

/* float8 e4m3 (no infinities, 448 its largest) as float32, exactly: the byte's magnitude bits moved to
 * where a float32's exponent and mantissa meet, which reads the value 2^-120 times too small (the
 * biases differ by 120, subnormals included), then scaled back by a power of two. 0x7f is e4m3's
 * NaN; kvtier never writes it (kvt_f32_to_e4m3 takes |f| <= 448). */
static inline float kvt_e4m3_to_f32(uint8_t x) {
    const uint32_t u = ((uint32_t)(x & 0x80u) << 24) | ((uint32_t)(x & 0x7fu) << 20);
    float f;
    memcpy(&f, &u, 4);
    return f * 0x1p120f;
}

/* f (|f| <= 448) to the nearest e4m3, ties to even, as torch's float -> float8_e4m3fn rounds:
 * below 2^-6 the steps are 2^-9 apart (subnormals), above it 3 mantissa bits are kept. */
static inline uint8_t kvt_f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    u &= 0x7fffffffu;
    if (u < 0x3c800000u) { /* |f| < 2^-6: count the 2^-9 steps, rounded to nearest even (8 is 2^-6's code) */
        float a;
        memcpy(&a, &u, 4);
        return sign | (uint8_t)__builtin_nearbyintf(a * 512.0f);
    }
    const uint32_t r = (u + 0x7ffffu + ((u >> 20) & 1u)) >> 20; /* 8 exponent and 3 mantissa bits, rounded */
    return sign | (uint8_t)(r - ((127u - 7u) << 3));
}

/* The polynomial's coefficients (Cephes expf), and ln 2 split in two for the reduction:
 * one list for the scalar, 8-wide and 16-wide forms below. */
#define KVT_EXP_LOG2E 1.44269504088896341f
#define KVT_EXP_LN2_HI 0.693359375f
#define KVT_EXP_LN2_LO (-2.12194440e-4f)
#define KVT_EXP_P0 1.9875691500e-4f
#define KVT_EXP_P1 1.3981999507e-3f
#define KVT_EXP_P2 8.3334519073e-3f
#define KVT_EXP_P3 4.1665795894e-2f
#define KVT_EXP_P4 1.6666665459e-1f
#define KVT_EXP_P5 5.0000001201e-1f

/* exp(x) for x <= 0 (Cephes expf): x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
 * polynomial in r, 2^n put straight into the exponent bits. Relative error ~2e-7.
 * Inputs below -87 give exp(-87) ~ 1.6e-38 rather than 0, harmless next to the
 * running maximum's exp(0) = 1. Branch-free, so loops of it vectorise. */
static inline __attribute__((always_inline)) float kvt_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * KVT_EXP_LOG2E + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = x - n * KVT_EXP_LN2_HI;
    r = r - n * KVT_EXP_LN2_LO;
    float y = KVT_EXP_P0;
    y = y * r + KVT_EXP_P1;
    y = y * r + KVT_EXP_P2;
    y = y * r + KVT_EXP_P3;
    y = y * r + KVT_EXP_P4;
    y = y * r + KVT_EXP_P5;
    y = y * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float p;
    memcpy(&p, &e, 4);
    return y * p;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* kvt_exp, 8 at a time (the same polynomial; 2^n built in the exponent bits). */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) __m256 kvt_exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n =
        _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(KVT_EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KVT_EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(KVT_EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(KVT_EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(KVT_EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(KVT_EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(KVT_EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(KVT_EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(KVT_EXP_P5));
    y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* kvt_exp, 16 at a time (the same polynomial; scalef puts in 2^n). */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) __m512 kvt_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(KVT_EXP_LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KVT_EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KVT_EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(KVT_EXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(KVT_EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(KVT_EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(KVT_EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(KVT_EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(KVT_EXP_P5));
    y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* 8 float8 e4m3 at p as float32, as kvt_e4m3_to_f32: each byte, sign-extended to 16 bits and shifted
 * left 7, is a float16 whose value is the e4m3's times 2^-8 once bit 14 (a copy of the sign) is masked
 * off (the biases differ by 8; subnormals land on float16 subnormals), widened by F16C and scaled back
 * by a power of two: five instructions, three of them on half-width lanes. */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) __m256 kvt_e4m3_256(const uint8_t *p) {
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i h = _mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xbf80));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}

/* 16 float8 e4m3 at p as float32, likewise. */
__attribute__((target("avx512f,avx2"))) static inline __attribute__((always_inline)) __m512 kvt_e4m3_512(const uint8_t *p) {
    const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), _mm256_set1_epi16((short)0xbf80));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

/* 8 float16s at p as float32: F16C's conversion, exact (subnormals, infinities and NaNs kept), as
 * kvt_f16_to_f32 (every AVX2 CPU has F16C; the builds that use this check for it). */
__attribute__((target("avx2,fma,f16c"))) static inline __attribute__((always_inline)) __m256 kvt_f16_256(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 16 float16s at p as float32 (AVX-512F's own conversion). */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) __m512 kvt_f16_512(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

#endif

#endif
