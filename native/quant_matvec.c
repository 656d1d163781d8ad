/*
 * quant_matvec: the decode step's weight products read straight from the GGUF's own
 * quantized blocks.
 *
 * A decode step multiplies one activation row per sequence by every weight matrix:
 * it is bound by the bytes of weights it reads, not by arithmetic. The embedded model
 * ships its projections as Q4_1 (32 weights in 20 bytes) and its embedding as Q8_0
 * (32 in 34); dequantized to float32 they are 5-6x larger, and reading them is most of
 * a float32 decode step. These kernels read the quantized form instead, repacked once
 * at load (kvtier/model/blocks.py maps every supported GGML format, K-quants included,
 * onto three forms): per row, the blocks' quants back to back, and the blocks' scales
 * (and minimums) as float32 arrays of their own.
 *
 *   Q4_1:  w[j] = d * q[j] + m, q in 0..15; byte k of a block holds q[k] (low nibble)
 *          and q[k + 16] (high nibble), as in GGML.
 *   Q8_0:  w[j] = d * q[j] (+ m where minimums are given), q an int8.
 *   Q8_16: w[j] = d[j / 16] * q[j], q an int8: two scales per 32-weight block (Q6_K).
 *
 * The K-quants keep their scales as small integer factors of one float16 per 256 weights
 * (Q4_K/Q5_K: 6-bit scale and minimum factors per 32, Q6_K: an int8 per 16). Repacked to a
 * float32 per block those cost 8 bytes per 32 weights, a third of Q4_K's own bytes; so
 * they may come factored instead (d_fac, m_fac: an int8 per scale, d and m then one
 * float32 per 256 weights). A worker multiplies a row's factors out into a buffer of its
 * own as it starts the row, once per row, with the float32 product gguf's dequantizer
 * rounds them with: the same scales, and a quarter of their bytes streamed from DRAM.
 *
 * out[i, r] = sum_j w[r, j] * x[i, j], in float32, for i < n rows of x. Per block,
 * sum_j (d q_j + m) x_j = d * (q . x) + m * sum(x): the sums of x per block are taken
 * once per call and shared by all rows. Every output row is computed by one thread in a
 * fixed order, the same whether x has one row or many, so the result depends neither on
 * the thread count nor on the other rows of the call. It differs from a
 * float32 matmul of the dequantized weights only in summation order (a few ulps).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "float_math.h"
#include "kernels.h"
#include "team.h"

#if defined(__x86_64__) || defined(__i386__)
#define QV_X86 1
#include <immintrin.h>
#endif

#define QV_BLOCK 32
/*
 * Rows are dealt out in units a thread streams start to finish: two per thread, a
 * multiple of 16 rows (whole cache lines of out per unit). A decode step reads every
 * matrix from DRAM, and the hardware prefetchers follow one long sequential run but
 * start over at every jump; in units of 16 rows (4.6 KB of Q4_1 quants at 576
 * columns) the two threads' rows came at a fraction of the bandwidth. Two units rather
 * than one let a worker that joins late take less.
 */
#define QV_UNITS_PER_THREAD 2
#define QV_UNIT_ALIGN 16
#define QV_MAX_X 64   /* rows of x per call: a decode batch */
#define QV_GROUP 4    /* rows of x sharing one unpacking of a weight block */
#define QV_SUPER 256  /* weights per factored scale (a K-quant super-block) */
#define QV_MAX_ROW_SCALES KVT_QUANT_MAX_ROW_SCALES

typedef enum { QV_Q4_1 = 0, QV_Q8_0 = 1, QV_Q8_16 = 2 } qv_kind_t;

typedef struct {
    qv_kind_t kind;
    const uint8_t *q;  /* rows x row_bytes */
    const float *d;    /* rows x scales */
    const float *m;    /* rows x blocks, or NULL (no minimums) */
    const int8_t *dfac; /* factored: rows x scales, and d is rows x supers */
    const int8_t *mfac; /* factored with minimums: rows x blocks, and m is rows x supers */
    int64_t supers;     /* cols / QV_SUPER where factored */
    const float *x;    /* n x cols */
    const float *xsum; /* n x blocks (where m is given) */
    const uint16_t *xb; /* the bfloat16 build's x: n x pairs x 64, in its lane order (qv_arrange) */
    const float *xs8;   /* and its minimums' sums: n x pairs x 16 */
    const uint16_t *xh; /* the int8 forms' bfloat16 build: x as given, n x cols */
    const int8_t *xq;   /* the 8-bit build: x quantized, n x pairs x 64, in the form's lane order (qv8_quantize) */
    const float *xs16;  /* its per-block scales, in each lane of the block: n x pairs x 16 */
    const int32_t *xc;  /* int8 forms: -128 * the sum of each lane's four quants, n x pairs x 16 */
    const float *xsq;   /* scale * sum of quants per block (the minimums' share): n x blocks */
    int64_t pairs;      /* blocks / 2, rounded up */
    float *out;        /* n x rows */
    int64_t rows, cols, blocks, row_bytes;
    int64_t scales;    /* scales per row: blocks, or 2 * blocks for Q8_16 */
    int n;
    int64_t unit_rows; /* rows per unit of work (QV_UNITS_PER_THREAD) */
    size_t next, n_units;
    void (*rows_fn)(const void *job, int64_t r0, int64_t r1);
} qv_job_t;

/* Row r's scales and minimums, one float32 per scale: the job's own where they are
 * plain, multiplied out into dbuf and mbuf (QV_MAX_ROW_SCALES each) where factored. */
static inline void qv_row_scales(const qv_job_t *j, int64_t r, float *dbuf, float *mbuf, const float **d,
                                 const float **m) {
    if (j->dfac == NULL) {
        *d = j->d + r * j->scales;
        *m = j->m == NULL ? NULL : j->m + r * j->blocks;
        return;
    }
    const int64_t per_d = j->scales / j->supers, per_m = j->blocks / j->supers;
    const float *ds = j->d + r * j->supers;
    const int8_t *df = j->dfac + r * j->scales;
    for (int64_t s = 0; s < j->supers; s++)
        for (int64_t k = 0; k < per_d; k++) dbuf[s * per_d + k] = ds[s] * (float)df[s * per_d + k];
    *d = dbuf;
    *m = NULL;
    if (j->m != NULL) {
        const float *ms = j->m + r * j->supers;
        const int8_t *mf = j->mfac + r * j->blocks;
        for (int64_t s = 0; s < j->supers; s++)
            for (int64_t k = 0; k < per_m; k++) mbuf[s * per_m + k] = ms[s] * (float)mf[s * per_m + k];
        *m = mbuf;
    }
}

/* -- portable ------------------------------------------------------------------- */
static void qv_rows_base(const void *job, int64_t r0, int64_t r1) {
    const qv_job_t *j = job;
    float w[QV_BLOCK], dbuf[QV_MAX_ROW_SCALES], mbuf[QV_MAX_ROW_SCALES];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = j->q + r * j->row_bytes;
        const float *d, *m;
        qv_row_scales(j, r, dbuf, mbuf, &d, &m);
        for (int i = 0; i < j->n; i++) {
            const float *x = j->x + (int64_t)i * j->cols;
            float total = 0.0f;
            for (int64_t b = 0; b < j->blocks; b++) {
                if (j->kind == QV_Q8_16) {
                    const int8_t *p = (const int8_t *)q + b * QV_BLOCK;
                    float lo = 0.0f, hi = 0.0f;
                    for (int k = 0; k < QV_BLOCK / 2; k++) lo += (float)p[k] * x[b * QV_BLOCK + k];
                    for (int k = QV_BLOCK / 2; k < QV_BLOCK; k++) hi += (float)p[k] * x[b * QV_BLOCK + k];
                    total += d[2 * b] * lo + d[2 * b + 1] * hi;
                    continue;
                }
                float dot = 0.0f;
                if (j->kind == QV_Q4_1) {
                    const uint8_t *p = q + b * (QV_BLOCK / 2);
                    for (int k = 0; k < QV_BLOCK / 2; k++) {
                        w[k] = (float)(p[k] & 0x0F);
                        w[k + QV_BLOCK / 2] = (float)(p[k] >> 4);
                    }
                } else {
                    const int8_t *p = (const int8_t *)q + b * QV_BLOCK;
                    for (int k = 0; k < QV_BLOCK; k++) w[k] = (float)p[k];
                }
                for (int k = 0; k < QV_BLOCK; k++) dot += w[k] * x[b * QV_BLOCK + k];
                total += d[b] * dot;
                if (m != NULL) total += m[b] * j->xsum[(int64_t)i * j->blocks + b];
            }
            j->out[(int64_t)i * j->rows + r] = total;
        }
    }
}

/* -- AVX2 + FMA ------------------------------------------------------------------ */
#ifdef QV_X86
#define QV_AVX2 __attribute__((target("avx2,fma")))

QV_AVX2 static inline float qv_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 weights of one block as four vectors of 8 floats, without scale or minimum. */
QV_AVX2 static inline void qv_unpack(qv_kind_t kind, const uint8_t *p, __m256 f[4]) {
    if (kind == QV_Q4_1) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(bytes, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        for (int k = 0; k < 4; k++)
            f[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * k))));
    }
}

/* One row of x (a single decoding sequence, the common case): two blocks per step into
 * two accumulators and each block's dot split in two chains, so the out-of-order core
 * overlaps blocks instead of waiting on one long chain of dependent FMAs. */
QV_AVX2 static inline __m256 qv_block_dot(const __m256 f[4], const float *x) {
    const __m256 a = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(x)));
    const __m256 b = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(x + 16)));
    return _mm256_add_ps(a, b);
}

/* acc plus block b's products scaled: one scale for the block, or (Q8_16) one per half. */
QV_AVX2 static inline __m256 qv_block_acc(const qv_job_t *j, const __m256 f[4], const float *x, const float *d, int64_t b,
                                          __m256 acc) {
    if (j->kind == QV_Q8_16) {
        const __m256 lo = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(x)));
        const __m256 hi = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(x + 16)));
        return _mm256_fmadd_ps(_mm256_set1_ps(d[2 * b + 1]), hi, _mm256_fmadd_ps(_mm256_set1_ps(d[2 * b]), lo, acc));
    }
    return _mm256_fmadd_ps(_mm256_set1_ps(d[b]), qv_block_dot(f, x), acc);
}

/* A row's sum from its two block accumulators (even blocks, odd blocks) and, for Q4_1, the
 * minimums' share. One function for one row of x and for several, so that a row's result is
 * the same bits whether it was multiplied alone or with others (a decode step and a verify
 * step of prompt lookup give a token the same logits). */
QV_AVX2 static inline float qv_total(const qv_job_t *j, const float *m, __m256 acc0, __m256 acc1, const float *xsum) {
    float total = qv_hsum(_mm256_add_ps(acc0, acc1));
    if (m != NULL) {
        __m256 bias = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= j->blocks; k += 8) bias = _mm256_fmadd_ps(_mm256_loadu_ps(m + k), _mm256_loadu_ps(xsum + k), bias);
        float rest = 0.0f;
        for (; k < j->blocks; k++) rest += m[k] * xsum[k];
        total += qv_hsum(bias) + rest;
    }
    return total;
}

/* qv_row_scales with the factors multiplied out eight at a time (per_d is 8 or 16, per_m 8):
 * the scalar loop cost more than a short row's products. The same float32 products. */
QV_AVX2 static inline void qv_row_scales_avx2(const qv_job_t *j, int64_t r, float *dbuf, float *mbuf, const float **d,
                                              const float **m) {
    if (j->dfac == NULL) {
        qv_row_scales(j, r, dbuf, mbuf, d, m);
        return;
    }
    const int64_t per_d = j->scales / j->supers;
    const float *ds = j->d + r * j->supers;
    const int8_t *df = j->dfac + r * j->scales;
    for (int64_t s = 0; s < j->supers; s++) {
        const __m256 sd = _mm256_set1_ps(ds[s]);
        for (int64_t k = 0; k < per_d; k += 8) {
            const __m256i f = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(df + s * per_d + k)));
            _mm256_storeu_ps(dbuf + s * per_d + k, _mm256_mul_ps(sd, _mm256_cvtepi32_ps(f)));
        }
    }
    *d = dbuf;
    *m = NULL;
    if (j->m != NULL) {
        const float *ms = j->m + r * j->supers;
        const int8_t *mf = j->mfac + r * j->blocks;
        for (int64_t s = 0; s < j->supers; s++) {
            const __m256i f = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(mf + 8 * s)));
            _mm256_storeu_ps(mbuf + 8 * s, _mm256_mul_ps(_mm256_set1_ps(ms[s]), _mm256_cvtepi32_ps(f)));
        }
        *m = mbuf;
    }
}

QV_AVX2 static void qv_rows_avx2_one(const qv_job_t *j, int64_t r0, int64_t r1, int64_t qb) {
    float dbuf[QV_MAX_ROW_SCALES], mbuf[QV_MAX_ROW_SCALES];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = j->q + r * j->row_bytes;
        const float *d, *m;
        qv_row_scales_avx2(j, r, dbuf, mbuf, &d, &m);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < j->blocks; b += 2) {
            __m256 f[4], g[4];
            qv_unpack(j->kind, q + b * qb, f);
            qv_unpack(j->kind, q + (b + 1) * qb, g);
            acc0 = qv_block_acc(j, f, j->x + b * QV_BLOCK, d, b, acc0);
            acc1 = qv_block_acc(j, g, j->x + (b + 1) * QV_BLOCK, d, b + 1, acc1);
        }
        if (b < j->blocks) {
            __m256 f[4];
            qv_unpack(j->kind, q + b * qb, f);
            acc0 = qv_block_acc(j, f, j->x + b * QV_BLOCK, d, b, acc0);
        }
        j->out[r] = qv_total(j, m, acc0, acc1, j->xsum);
    }
}

QV_AVX2 static void qv_rows_avx2(const void *job, int64_t r0, int64_t r1) {
    const qv_job_t *j = job;
    const int64_t qb = j->kind == QV_Q4_1 ? QV_BLOCK / 2 : QV_BLOCK;
    if (j->n == 1) {
        qv_rows_avx2_one(j, r0, r1, qb);
        return;
    }
    float dbuf[QV_MAX_ROW_SCALES], mbuf[QV_MAX_ROW_SCALES];
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *q = j->q + r * j->row_bytes;
        const float *d, *m;
        qv_row_scales_avx2(j, r, dbuf, mbuf, &d, &m);
        for (int i0 = 0; i0 < j->n; i0 += QV_GROUP) {
            const int g = j->n - i0 < QV_GROUP ? j->n - i0 : QV_GROUP;
            __m256 acc0[QV_GROUP], acc1[QV_GROUP];  /* even and odd blocks, as qv_rows_avx2_one sums them */
            for (int i = 0; i < QV_GROUP; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
            for (int64_t b = 0; b < j->blocks; b++) {
                __m256 f[4];
                qv_unpack(j->kind, q + b * qb, f);
                for (int i = 0; i < g; i++) {
                    const float *x = j->x + (int64_t)(i0 + i) * j->cols + b * QV_BLOCK;
                    if (b & 1)
                        acc1[i] = qv_block_acc(j, f, x, d, b, acc1[i]);
                    else
                        acc0[i] = qv_block_acc(j, f, x, d, b, acc0[i]);
                }
            }
            for (int i = 0; i < g; i++)
                j->out[(int64_t)(i0 + i) * j->rows + r] =
                    qv_total(j, m, acc0[i], acc1[i], j->xsum + (int64_t)(i0 + i) * j->blocks);
        }
    }
}
#endif

/* A group function called with G (rows of x at once) as a constant, so its accumulators stay
 * in registers; every group function takes (j, r, d, m, i0, G, X), X a constant of its own. */
#define QV_BY_GROUP(FN, X)                                                                                             \
    switch (j->n - i0 < QV_GROUP ? j->n - i0 : QV_GROUP) {                                                             \
    case 1: FN(j, r, d, m, i0, 1, X); break;                                                                           \
    case 2: FN(j, r, d, m, i0, 2, X); break;                                                                           \
    case 3: FN(j, r, d, m, i0, 3, X); break;                                                                           \
    default: FN(j, r, d, m, i0, 4, X); break;                                                                          \
    }

/* -- AVX-512 BF16, Q4_1 times bfloat16 rows ---------------------------------------------
 * A bfloat16 engine's activations are bfloat16 already, and a Q4_1 quant (0..15) is
 * exactly a bfloat16, so q . x can run on VDPBF16PS: 32 products an instruction, each
 * exact in float32, summed in float32. Two blocks at a time: their 32 packed bytes split
 * into 64 nibbles (low: q[0..15] of each block, high: q[16..31]), two byte lookups give
 * each nibble's bfloat16 high and low byte, and interleaving those makes the words. x is
 * laid out once per call in the order that interleave leaves the weights in
 * (qv_arrange): per 128-bit lane of the two weight vectors, eight consecutive x of one
 * block. Dword lanes 0-3 and 8-11 then sum block 2p's products, 4-7 and 12-15 block
 * 2p + 1's; one multiply-add scales them by their d, and one more adds the minimums'
 * share, m * sum(x) / 8 in each of a block's eight lanes (the / 8 is exact). Against the
 * float32 build only the summation order differs. Every row of x runs the same sequence
 * of operations, alone or in a group, so a row's result does not depend on its call. */
#ifdef QV_X86
#define QV_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))

/* Where word w of the two weight vectors of a pair comes from: block (0 or 1) and index
 * in the block. Vector v, 128-bit lane l, word i: the nibbles unpacked from lane l hold
 * bytes 16l..16l+15 of [low nibbles of both blocks | high nibbles of both blocks]. */
static void qv_source(int v, int w, int *block, int *k) {
    const int lane = w / 8, i = w % 8;
    const int nibble = 16 * lane + 8 * v + i; /* 0..63 in [lo blk0 | lo blk1 | hi blk0 | hi blk1] */
    *block = (nibble / 16) & 1;
    *k = (nibble % 16) + (nibble >= 32 ? 16 : 0);
}

/* x rows (bfloat16) into that order, an odd last block padded with zeros; the per-block
 * sums of x (for the other builds' minimums) and, per pair, sum / 8 in each dword lane of
 * its block (for this one's). */
static void qv_arrange(const uint16_t *x, int n, int64_t cols, int64_t pairs, uint16_t *xb, float *xsum, float *xs8) {
    const int64_t blocks = cols / QV_BLOCK;
    for (int i = 0; i < n; i++) {
        const uint16_t *row = x + (int64_t)i * cols;
        float *sums = xsum + (int64_t)i * blocks;
        for (int64_t b = 0; b < blocks; b++) {
            float sum = 0.0f;
            for (int k = 0; k < QV_BLOCK; k++) sum += kvt_bf16_to_f32(row[b * QV_BLOCK + k]);
            sums[b] = sum;
        }
        for (int64_t p = 0; p < pairs; p++) {
            uint16_t *dst = xb + ((int64_t)i * pairs + p) * 64;
            for (int v = 0; v < 2; v++)
                for (int w = 0; w < 32; w++) {
                    int blk, k;
                    qv_source(v, w, &blk, &k);
                    const int64_t b = 2 * p + blk;
                    dst[32 * v + w] = b < blocks ? row[b * QV_BLOCK + k] : 0;
                }
            float *s8 = xs8 + ((int64_t)i * pairs + p) * 16;
            for (int lane = 0; lane < 16; lane++) {
                const int64_t b = 2 * p + ((lane / 4) & 1);
                s8[lane] = b < blocks ? sums[b] * 0.125f : 0.0f;
            }
        }
    }
}

/* One weight row times G rows of x, G a constant at every call site so that the
 * accumulators stay in registers (a runtime G kept them on the stack, and every pair
 * waited on a store and a reload). Each x row's operations are the same for any G. */
/* d and m: the row's scales and minimums, or (F, factored) its two float32 per 256 weights,
 * whose factors the loop multiplies out eight at a time, a super-block's, into registers
 * (a buffer written just before was read back at store-forwarding stalls). */
QV_BF16 static inline __attribute__((always_inline)) void qv_bf16_group(const qv_job_t *j, int64_t r, const float *d,
                                                                       const float *m, int i0, const int G,
                                                                       const int F) {
    /* bfloat16 of 0..15, high bytes and low bytes, as vpshufb tables (each 128-bit lane alike) */
    const __m512i hi_bytes = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41));
    const __m512i lo_bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0x00, (char)0x80, 0x00, 0x40, (char)0x80, (char)0xA0,
                                                                  (char)0xC0, (char)0xE0, 0x00, 0x10, 0x20, 0x30, 0x40,
                                                                  0x50, 0x60, 0x70));
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const int64_t qb = QV_BLOCK / 2, whole = j->blocks / 2;
    const uint8_t *q = j->q + r * j->row_bytes;
    const int8_t *df = F ? j->dfac + r * j->blocks : NULL, *mf = F ? j->mfac + r * j->blocks : NULL;
    __m512 sd8 = _mm512_setzero_ps(), sm8 = _mm512_setzero_ps(); /* F: the super-block's 8 scales, 8 minimums */
    __m512 acc0[QV_GROUP], acc1[QV_GROUP]; /* even and odd pairs */
    for (int i = 0; i < G; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < j->pairs; p++) {
        __m256i packed;
        __m512 scale, mins;
        if (F) { /* cols is a multiple of 256: four whole pairs a super-block */
            const int64_t s = p / 4;
            if ((p & 3) == 0) {
                const __m256 fd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(df + 8 * s))));
                const __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(mf + 8 * s))));
                sd8 = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(d[s]), fd));
                sm8 = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_set1_ps(m[s]), fm));
            }
            const __m512i idx = _mm512_add_epi32(halves, _mm512_set1_epi32(2 * (int)(p & 3)));
            packed = _mm256_loadu_si256((const __m256i *)(q + 2 * p * qb));
            scale = _mm512_permutexvar_ps(idx, sd8);
            mins = _mm512_permutexvar_ps(idx, sm8);
        } else {
            double dm[2]; /* d, then m, of blocks 2p and 2p + 1 (0 past the row's end) */
            if (p < whole) {
                packed = _mm256_loadu_si256((const __m256i *)(q + 2 * p * qb));
                memcpy(&dm[0], d + 2 * p, 8);
                memcpy(&dm[1], m + 2 * p, 8);
            } else {
                packed = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q + 2 * p * qb)));
                const float tail[4] = {d[2 * p], 0.0f, m[2 * p], 0.0f};
                memcpy(dm, tail, sizeof tail);
            }
            scale = _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(dm[0])));
            mins = _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(dm[1])));
        }
        const __m256i lo = _mm256_and_si256(packed, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        const __m512i nib = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        const __m512i h = _mm512_shuffle_epi8(hi_bytes, nib), l = _mm512_shuffle_epi8(lo_bytes, nib);
        const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(l, h), w1 = (__m512bh)_mm512_unpackhi_epi8(l, h);
        for (int i = 0; i < G; i++) {
            const int64_t at = (int64_t)(i0 + i) * j->pairs + p;
            const uint16_t *x = j->xb + at * 64;
            __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, (__m512bh)_mm512_loadu_si512(x));
            dot = _mm512_dpbf16_ps(dot, w1, (__m512bh)_mm512_loadu_si512(x + 32));
            const __m512 bias = _mm512_mul_ps(mins, _mm512_loadu_ps(j->xs8 + at * 16));
            if (p & 1) acc1[i] = _mm512_add_ps(_mm512_fmadd_ps(scale, dot, bias), acc1[i]);
            else acc0[i] = _mm512_add_ps(_mm512_fmadd_ps(scale, dot, bias), acc0[i]);
        }
    }
    for (int i = 0; i < G; i++)
        j->out[(int64_t)(i0 + i) * j->rows + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
}

QV_BF16 static void qv_rows_bf16(const void *job, int64_t r0, int64_t r1) {
    const qv_job_t *j = job;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t per = j->dfac != NULL ? j->supers : j->blocks; /* factored: two float32 per 256 weights */
        const float *d = j->d + r * per, *m = j->m + r * per;
        for (int i0 = 0; i0 < j->n; i0 += QV_GROUP) {
            if (j->dfac != NULL) {
                QV_BY_GROUP(qv_bf16_group, 1)
            } else {
                QV_BY_GROUP(qv_bf16_group, 0)
            }
        }
    }
}
#endif

/* -- AVX-512 BF16, the int8 forms (Q8_0, Q8_16) times bfloat16 rows ---------------------
 * An int8 quant is exactly a bfloat16 as well, so these run on VDPBF16PS too: a block's 32
 * quants become one vector of bfloat16 (widened to float32 and narrowed, both exact), in
 * their own order, which is x's, so x needs no arrangement. Lanes 0-7 sum the block's
 * first 16 products, 8-15 the last 16: one scale for all (Q8_0) or one per half (Q8_16,
 * Q6_K's sixteen). Against the float32 build only the summation order differs, and every
 * row of x runs the same operations alone or in a group. */
#ifdef QV_X86
/* A row's sum from its two accumulators and, where there are minimums, their share: the sum
 * over blocks of m times xs (per block, the sum of x, or scale times the sum of its quants). */
__attribute__((target("avx512f"))) static inline float qv512_total(__m512 acc0, __m512 acc1, const float *m,
                                                                   const float *xs, int64_t blocks) {
    float total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    if (m == NULL) return total;
    __m512 bias = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= blocks; k += 16) bias = _mm512_fmadd_ps(_mm512_loadu_ps(m + k), _mm512_loadu_ps(xs + k), bias);
    float rest = 0.0f;
    for (; k < blocks; k++) rest += m[k] * xs[k];
    return total + _mm512_reduce_add_ps(bias) + rest;
}

QV_BF16 static inline __attribute__((always_inline)) void qv_bf16_int8_group(const qv_job_t *j, int64_t r,
                                                                            const float *d, const float *m, int i0,
                                                                            const int G, const int HALVES) {
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int8_t *q = (const int8_t *)(j->q + r * j->row_bytes);
    __m512 acc0[QV_GROUP], acc1[QV_GROUP]; /* even and odd blocks */
    for (int i = 0; i < G; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < j->blocks; b++) {
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * QV_BLOCK))));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * QV_BLOCK + 16))));
        const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
        __m512 scale;
        if (HALVES) {
            double dd;
            memcpy(&dd, d + 2 * b, 8);
            scale = _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(dd)));
        } else {
            scale = _mm512_set1_ps(d[b]);
        }
        for (int i = 0; i < G; i++) {
            const uint16_t *x = j->xh + (int64_t)(i0 + i) * j->cols + b * QV_BLOCK;
            const __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), w, (__m512bh)_mm512_loadu_si512(x));
            if (b & 1) acc1[i] = _mm512_fmadd_ps(scale, dot, acc1[i]);
            else acc0[i] = _mm512_fmadd_ps(scale, dot, acc0[i]);
        }
    }
    for (int i = 0; i < G; i++)
        j->out[(int64_t)(i0 + i) * j->rows + r] =
            qv512_total(acc0[i], acc1[i], m, j->xsum + (int64_t)(i0 + i) * j->blocks, j->blocks);
}

QV_BF16 static void qv_rows_bf16_int8(const void *job, int64_t r0, int64_t r1) {
    const qv_job_t *j = job;
    float dbuf[QV_MAX_ROW_SCALES], mbuf[QV_MAX_ROW_SCALES];
    for (int64_t r = r0; r < r1; r++) {
        const float *d, *m;
        qv_row_scales_avx2(j, r, dbuf, mbuf, &d, &m);
        for (int i0 = 0; i0 < j->n; i0 += QV_GROUP) {
            if (j->kind == QV_Q8_16) {
                QV_BY_GROUP(qv_bf16_int8_group, 1)
            } else {
                QV_BY_GROUP(qv_bf16_int8_group, 0)
            }
        }
    }
}
#endif

/* -- AVX-512 VNNI, x quantized to 8 bits (engine.decode_activations: q8) -------------------
 * As llama.cpp multiplies: each 32 values of a row of x become int8 quants and one float32
 * scale (max |x| / 127, rounded to nearest), and VPDPBUSD sums 64 byte products an
 * instruction in int32, exactly; a block's sum is scaled once, in float32. The weights are
 * the same; x is rounded once more, to 8 bits a block, so products are no longer exact:
 * the setting trades that for a decode step's arithmetic (see DecodeActivations).
 *
 * Two blocks a step, as the bfloat16 builds: Q4_1's nibbles unpack as [low nibbles of both
 * blocks | high nibbles], so dword lanes 0-3 and 8-11 hold block 2p's sums and 4-7, 12-15
 * block 2p + 1's; the int8 forms' 64 bytes are the two blocks in order, lanes 0-7 and
 * 8-15. x's quants are laid out once per call in that order (qv8_quantize), beside each
 * lane's block scale. VPDPBUSD takes unsigned bytes: Q4_1's quants are (0..15); an int8
 * quant is flipped to q + 128, and the lane starts from -128 times its x quants' sum. The
 * minimums' share, m * scale * sum(quants) per block, is added once per row at the end. */
#ifdef QV_X86
#define QV_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

/* Byte t (0..63) of a pair's layout: which block of the pair, and which of its 32 values. */
static inline void qv8_source(qv_kind_t kind, int t, int *blk, int *k) {
    if (kind == QV_Q4_1) {
        *blk = (t / 16) & 1;
        *k = t % 16 + (t >= 32 ? 16 : 0);
    } else {
        *blk = t / 32;
        *k = t % 32;
    }
}

/* The inverse of qv8_source: where value k of the pair's block blk goes. */
static inline int qv8_place(qv_kind_t kind, int blk, int k) {
    if (kind == QV_Q4_1) return 16 * blk + (k < 16 ? k : k + 16);
    return 32 * blk + k;
}

/* x's rows quantized (float32 or, with x_bf16, bfloat16 input) into xq, xs16, xc, xsq. */
static void qv8_quantize(const qv_job_t *j, const void *x, int x_bf16, int8_t *xq, float *xs16, int32_t *xc,
                         float *xsq) {
    int8_t q[QV_BLOCK];
    for (int i = 0; i < j->n; i++) {
        for (int64_t p = 0; p < j->pairs; p++) {
            float scale[2] = {0.0f, 0.0f};
            int8_t *dst = xq + ((int64_t)i * j->pairs + p) * 64;
            memset(dst, 0, 64);
            for (int blk = 0; blk < 2; blk++) {
                const int64_t b = 2 * p + blk;
                if (b >= j->blocks) continue;
                float v[QV_BLOCK], amax = 0.0f;
                for (int k = 0; k < QV_BLOCK; k++) {
                    const int64_t at = (int64_t)i * j->cols + b * QV_BLOCK + k;
                    v[k] = x_bf16 ? kvt_bf16_to_f32(((const uint16_t *)x)[at]) : ((const float *)x)[at];
                    const float a = v[k] < 0 ? -v[k] : v[k];
                    if (a > amax) amax = a;
                }
                const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                int sum = 0;
                for (int k = 0; k < QV_BLOCK; k++) {
                    q[k] = (int8_t)lrintf(v[k] * inv);
                    sum += q[k];
                }
                scale[blk] = d;
                xsq[(int64_t)i * j->blocks + b] = d * (float)sum;
                for (int k = 0; k < QV_BLOCK; k++) dst[qv8_place(j->kind, blk, k)] = q[k];
            }
            float *s16 = xs16 + ((int64_t)i * j->pairs + p) * 16;
            int32_t *c16 = xc ? xc + ((int64_t)i * j->pairs + p) * 16 : NULL;
            for (int lane = 0; lane < 16; lane++) {
                int tb, k;
                qv8_source(j->kind, 4 * lane, &tb, &k);
                s16[lane] = scale[tb];
                if (c16) c16[lane] = -128 * (dst[4 * lane] + dst[4 * lane + 1] + dst[4 * lane + 2] + dst[4 * lane + 3]);
            }
        }
    }
}

/* One weight row times G rows of x (G constant at each call site, as qv_bf16_group). */
QV_VNNI static inline __attribute__((always_inline)) void qv8_group(const qv_job_t *j, int64_t r, const float *d,
                                                                   const float *m, int i0, const int G,
                                                                   const qv_kind_t K) {
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i eighths = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int64_t whole = j->blocks / 2;
    const uint8_t *q = j->q + r * j->row_bytes;
    __m512 acc0[QV_GROUP], acc1[QV_GROUP];
    for (int i = 0; i < G; i++) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < j->pairs; p++) {
        const int tail = p >= whole; /* an odd last block: the pair's second is absent */
        __m512i w;
        __m512 scale;
        if (K == QV_Q4_1) {
            const __m256i packed = tail ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q + 32 * p)))
                                        : _mm256_loadu_si256((const __m256i *)(q + 32 * p));
            w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(packed), _mm256_srli_epi16(packed, 4), 1),
                                 _mm512_set1_epi8(0x0F));
        } else {
            const __m512i raw = tail ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 64 * p)))
                                     : _mm512_loadu_si512((const void *)(q + 64 * p));
            w = _mm512_xor_si512(raw, _mm512_set1_epi8((char)0x80));
        }
        /* the pair's scales straight from d: plain loads, masked only past the row's end (scalars
         * gathered on the stack, or a masked load of scales just multiplied out, stalled every
         * pair on store forwarding) */
        if (K == QV_Q8_16) {
            const __m128 four = tail ? _mm_maskz_loadu_ps(0x3, d + 4 * p) : _mm_loadu_ps(d + 4 * p);
            scale = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(four));
        } else {
            double dd;
            if (tail) {
                const float two[2] = {d[2 * p], 0.0f};
                memcpy(&dd, two, 8);
            } else {
                memcpy(&dd, d + 2 * p, 8);
            }
            scale = _mm512_permutexvar_ps(K == QV_Q4_1 ? halves : eighths, _mm512_castpd_ps(_mm512_set1_pd(dd)));
        }
        for (int i = 0; i < G; i++) {
            const int64_t at = (int64_t)(i0 + i) * j->pairs + p;
            const __m512i xv = _mm512_loadu_si512((const void *)(j->xq + at * 64));
            const __m512i start = K == QV_Q4_1 ? _mm512_setzero_si512() : _mm512_loadu_si512((const void *)(j->xc + at * 16));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w, xv));
            const __m512 s = _mm512_mul_ps(scale, _mm512_loadu_ps(j->xs16 + at * 16));
            if (p & 1) acc1[i] = _mm512_fmadd_ps(s, dot, acc1[i]);
            else acc0[i] = _mm512_fmadd_ps(s, dot, acc0[i]);
        }
    }
    for (int i = 0; i < G; i++)
        j->out[(int64_t)(i0 + i) * j->rows + r] =
            qv512_total(acc0[i], acc1[i], m, j->xsq + (int64_t)(i0 + i) * j->blocks, j->blocks);
}

QV_VNNI static void qv_rows_q8(const void *job, int64_t r0, int64_t r1) {
    const qv_job_t *j = job;
    float dbuf[QV_MAX_ROW_SCALES], mbuf[QV_MAX_ROW_SCALES];
    for (int64_t r = r0; r < r1; r++) {
        const float *d, *m;
        qv_row_scales_avx2(j, r, dbuf, mbuf, &d, &m);
        for (int i0 = 0; i0 < j->n; i0 += QV_GROUP) {
            if (j->kind == QV_Q4_1) {
                QV_BY_GROUP(qv8_group, QV_Q4_1)
            } else if (j->kind == QV_Q8_16) {
                QV_BY_GROUP(qv8_group, QV_Q8_16)
            } else {
                QV_BY_GROUP(qv8_group, QV_Q8_0)
            }
        }
    }
}
#endif

/* -- the team's work and the entry point -------------------------------------------- */
static void qv_work(void *ctx) {
    qv_job_t *j = ctx;
    size_t u;
    while ((u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->n_units) {
        const int64_t r0 = (int64_t)u * j->unit_rows;
        const int64_t r1 = r0 + j->unit_rows < j->rows ? r0 + j->unit_rows : j->rows;
        j->rows_fn(j, r0, r1);
    }
}

static const char *qv_impl_name = NULL;
static void (*qv_rows_best)(const void *, int64_t, int64_t) = NULL;
static int qv_has_bf16 = 0; /* the CPU runs qv_rows_bf16 */
static int qv_has_vnni = 0; /* the CPU runs qv_rows_q8 */

static void qv_pick(void) {
    qv_rows_best = qv_rows_base;
    qv_impl_name = "base";
#ifdef QV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        qv_rows_best = qv_rows_avx2;
        qv_impl_name = "avx2";
    }
    qv_has_vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
                  __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    qv_has_bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
}

int kvt_quant_q8(void) {
    kvt_quant_impl();
    return qv_has_vnni;
}

int kvt_quant_bf16(void) {
    kvt_quant_impl();
    return qv_has_bf16;
}

const char *kvt_quant_impl(void) {
    if (qv_impl_name == NULL) qv_pick();
    return qv_impl_name;
}

/* The 8-bit build's call: x quantized once, then the team runs qv_rows_q8. */
static PyObject *qv8_matvec(int kind, unsigned long long q, unsigned long long d, unsigned long long m,
                            unsigned long long dfac, unsigned long long mfac, int64_t rows, int64_t cols,
                            unsigned long long x, int x_bf16, int n, unsigned long long out, int threads,
                            const char *impl, int64_t row_scales) {
    if (!qv_has_vnni || (impl != NULL && strcmp(impl, "avx512vnni") != 0))
        return PyErr_Format(PyExc_ValueError, "no avx512vnni build on this CPU for 8-bit x");
#ifdef QV_X86
    const int64_t blocks = cols / QV_BLOCK, pairs = (blocks + 1) / 2;
    const int64_t units = (int64_t)QV_UNITS_PER_THREAD * threads;
    const int64_t unit_rows = ((rows + units - 1) / units + QV_UNIT_ALIGN - 1) / QV_UNIT_ALIGN * QV_UNIT_ALIGN;
    const size_t lanes = (size_t)n * pairs * 16;
    char *scratch = malloc(lanes * 4 /* xq */ + lanes * sizeof(float) + lanes * sizeof(int32_t) +
                           (size_t)n * blocks * sizeof(float) + 64);
    if (scratch == NULL) return PyErr_NoMemory();
    int8_t *xq = (int8_t *)scratch;
    float *xs16 = (float *)(scratch + lanes * 4);
    int32_t *xc = (int32_t *)(xs16 + lanes);
    float *xsq = (float *)(xc + lanes);
    qv_job_t job = {
        .kind = (qv_kind_t)kind,
        .q = (const uint8_t *)(uintptr_t)q,
        .d = (const float *)(uintptr_t)d,
        .m = (const float *)(uintptr_t)m,
        .dfac = (const int8_t *)(uintptr_t)dfac,
        .mfac = (const int8_t *)(uintptr_t)mfac,
        .supers = cols / QV_SUPER,
        .xq = xq,
        .xs16 = xs16,
        .xc = kind == QV_Q4_1 ? NULL : xc,
        .xsq = xsq,
        .pairs = pairs,
        .out = (float *)(uintptr_t)out,
        .rows = rows,
        .cols = cols,
        .blocks = blocks,
        .row_bytes = kind == QV_Q4_1 ? cols / 2 : cols,
        .scales = row_scales,
        .n = n,
        .next = 0,
        .unit_rows = unit_rows,
        .n_units = (size_t)((rows + unit_rows - 1) / unit_rows),
        .rows_fn = qv_rows_q8,
    };
    Py_BEGIN_ALLOW_THREADS
    qv8_quantize(&job, (const void *)(uintptr_t)x, x_bf16, xq, xs16, job.xc == NULL ? NULL : xc, xsq);
    kvt_team_run(qv_work, &job, job.n_units > 1 ? threads : 1);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
#else
    return NULL;
#endif
}

PyObject *kvt_py_quant_matvec(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *names[] = {"kind", "q", "d", "m", "rows", "cols", "x", "n", "out", "threads", "impl", "x_bf16",
                            "d_fac", "m_fac", "x_q8", NULL};
    int kind, n, threads = 1, x_bf16 = 0, x_q8 = 0;
    unsigned long long q, d, m, x, out, dfac = 0, mfac = 0;
    long long rows, cols;
    const char *impl = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iKKKLLKiK|izpKKp:quant_matvec", names, &kind, &q, &d, &m, &rows, &cols,
                                     &x, &n, &out, &threads, &impl, &x_bf16, &dfac, &mfac, &x_q8))
        return NULL;
    if (kind != QV_Q4_1 && kind != QV_Q8_0 && kind != QV_Q8_16)
        return PyErr_Format(PyExc_ValueError, "kind must be 0 (Q4_1), 1 (Q8_0) or 2 (Q8_16)");
    if (rows <= 0 || cols <= 0 || cols % QV_BLOCK) return PyErr_Format(PyExc_ValueError, "cols must be a positive multiple of 32");
    if (n <= 0 || n > QV_MAX_X) return PyErr_Format(PyExc_ValueError, "n (rows of x) must be 1..%d", QV_MAX_X);
    if (threads < 1 || threads > 16) return PyErr_Format(PyExc_ValueError, "threads must be 1..16");
    if (!q || !d || !x || !out || (kind == QV_Q4_1 && !m)) return PyErr_Format(PyExc_ValueError, "null address");
    if (kind == QV_Q8_16 && m) return PyErr_Format(PyExc_ValueError, "Q8_16 has no minimums");
    const int64_t row_scales = kind == QV_Q8_16 ? 2 * (cols / QV_BLOCK) : cols / QV_BLOCK;
    if (dfac && (cols % QV_SUPER || row_scales > QV_MAX_ROW_SCALES))
        return PyErr_Format(PyExc_ValueError, "factored scales need cols a multiple of %d and at most %d scales a row",
                            QV_SUPER, QV_MAX_ROW_SCALES);
    if ((mfac && (!dfac || !m)) || (dfac && m && !mfac))
        return PyErr_Format(PyExc_ValueError, "factored minimums need factored scales, and the other way round");
    kvt_quant_impl();
    if (x_q8) return qv8_matvec(kind, q, d, m, dfac, mfac, rows, cols, x, x_bf16, n, out, threads, impl, row_scales);
    void (*rows_fn)(const void *, int64_t, int64_t) = qv_rows_best;
    int on_bf16 = x_bf16 && qv_has_bf16 && impl == NULL; /* VDPBF16PS: the Q4_1 pairs, or the int8 forms */
    if (impl != NULL) {
        if (strcmp(impl, "base") == 0) rows_fn = qv_rows_base;
        else if (strcmp(impl, "avx512bf16") == 0 && qv_has_bf16 && x_bf16) on_bf16 = 1;
        else if (strcmp(impl, qv_impl_name) != 0) return PyErr_Format(PyExc_ValueError, "no %s build on this CPU", impl);
    }
    const int use_bf16 = on_bf16 && kind == QV_Q4_1, use_bf16_int8 = on_bf16 && kind != QV_Q4_1;
    const int64_t blocks = cols / QV_BLOCK, pairs = (blocks + 1) / 2;
    const int64_t units = (int64_t)QV_UNITS_PER_THREAD * threads;
    const int64_t unit_rows = ((rows + units - 1) / units + QV_UNIT_ALIGN - 1) / QV_UNIT_ALIGN * QV_UNIT_ALIGN;
    const size_t n_xsum = m ? (size_t)(n * blocks) : 0;
    const size_t n_wide = x_bf16 && !on_bf16 ? (size_t)(n * cols) : 0; /* another build: x widened to float32 */
    const size_t n_xs8 = use_bf16 ? (size_t)(n * pairs * 16) : 0, n_xb = use_bf16 ? (size_t)(n * pairs * 64) : 0;
    char *scratch = malloc(sizeof(float) * (n_xsum + n_wide + n_xs8) + sizeof(uint16_t) * n_xb + 1);
    if (scratch == NULL) return PyErr_NoMemory();
    float *xsum = n_xsum ? (float *)scratch : NULL;
    float *wide = (float *)scratch + n_xsum, *xs8 = (float *)scratch + n_xsum + n_wide;
    uint16_t *xb = (uint16_t *)((float *)scratch + n_xsum + n_wide + n_xs8);
    qv_job_t job = {
        .kind = (qv_kind_t)kind,
        .q = (const uint8_t *)(uintptr_t)q,
        .d = (const float *)(uintptr_t)d,
        .m = (const float *)(uintptr_t)m,
        .dfac = (const int8_t *)(uintptr_t)dfac,
        .mfac = (const int8_t *)(uintptr_t)mfac,
        .supers = cols / QV_SUPER,
        .x = n_wide ? wide : (const float *)(uintptr_t)x,
        .xsum = xsum,
        .xb = use_bf16 ? xb : NULL,
        .xs8 = use_bf16 ? xs8 : NULL,
        .xh = use_bf16_int8 ? (const uint16_t *)(uintptr_t)x : NULL,
        .pairs = pairs,
        .out = (float *)(uintptr_t)out,
        .rows = rows,
        .cols = cols,
        .blocks = blocks,
        .row_bytes = kind == QV_Q4_1 ? cols / 2 : cols,
        .scales = row_scales,
        .n = n,
        .next = 0,
        .unit_rows = unit_rows,
        .n_units = (size_t)((rows + unit_rows - 1) / unit_rows),
        .rows_fn = rows_fn,
    };
    Py_BEGIN_ALLOW_THREADS
    if (use_bf16) {
#ifdef QV_X86
        qv_arrange((const uint16_t *)(uintptr_t)x, n, cols, pairs, xb, xsum, xs8);
        job.rows_fn = qv_rows_bf16;
#endif
    } else if (use_bf16_int8) {
#ifdef QV_X86
        if (xsum != NULL)
            for (int i = 0; i < n; i++)
                for (int64_t b = 0; b < blocks; b++) {
                    const uint16_t *p = job.xh + (int64_t)i * cols + b * QV_BLOCK;
                    float s = 0.0f;
                    for (int k = 0; k < QV_BLOCK; k++) s += kvt_bf16_to_f32(p[k]);
                    xsum[i * blocks + b] = s;
                }
        job.rows_fn = qv_rows_bf16_int8;
#endif
    } else {
        if (n_wide)
            for (size_t k = 0; k < n_wide; k++) wide[k] = kvt_bf16_to_f32(((const uint16_t *)(uintptr_t)x)[k]);
        if (xsum != NULL)
            for (int i = 0; i < n; i++)
                for (int64_t b = 0; b < blocks; b++) {
                    const float *p = job.x + (int64_t)i * cols + b * QV_BLOCK;
                    float s = 0.0f;
                    for (int k = 0; k < QV_BLOCK; k++) s += p[k];
                    xsum[i * blocks + b] = s;
                }
    }
    kvt_team_run(qv_work, &job, job.n_units > 1 ? threads : 1);
    Py_END_ALLOW_THREADS
    free(scratch);
    Py_RETURN_NONE;
}
