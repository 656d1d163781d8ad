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

#endif

#endif
