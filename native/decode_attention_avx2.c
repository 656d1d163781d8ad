/* The AVX2 build of a decode attention unit (decode_attention.h). */
#include <math.h>
#include <string.h>

#include "decode_attention.h"
#include "float_math.h"

#ifdef KVT_X86
#include <immintrin.h>

/*
 * The AVX2 unit, by hand, for x86-64 CPUs with AVX2+FMA and no AVX-512 (AMD Zen 1-3,
 * most desktops and laptops). The auto-vectorised body reduced every dot product
 * through the stack and ran far below what the same core's memory delivers. The same
 * plan as the AVX-512 unit (decode_attention_avx512.c), at 8 lanes: a tile of up to 16
 * positions is scored as two vectors of 8, each folded from 8 rows' partial sums by a
 * hadd tree (attn256_scores, q held in registers); its softmax weights are two vectors;
 * and V is accumulated in registers, 16 columns of up to 4 heads at a time (8
 * accumulators: 12 of 3 heads by 32 columns spilled one to the stack, a store-forward
 * stall per row). By hand it is bound by memory again, as decode attention should be:
 * two threads read K/V near the machine's memory bandwidth.
 */
#define ATTN256 __attribute__((target("avx2,fma,f16c")))
#define ATTN256_INLINE static inline __attribute__((always_inline)) ATTN256

/* Elements [off, off + 8) of a row as float32 (bfloat16 widened: its bits are a float's top half). */
ATTN256_INLINE __m256 attn256_load(const char *base, ptrdiff_t off, const int bf16) {
    if (bf16 == 2) { /* int8 quants (the caller applies the row's scale) */
        const __m128i x = _mm_loadl_epi64((const __m128i *)((const int8_t *)base + off));
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    }
    if (bf16 == KVT_E4M3) /* float8 e4m3 quants, likewise */
        return kvt_e4m3_256((const uint8_t *)base + off);
    if (bf16 == KVT_F16) return kvt_f16_256((const uint16_t *)base + off);
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + off);
}

/* The 8 partial sums of q . K[row], q in registers (qv, nv vectors). */
ATTN256_INLINE __m256 attn256_row(const char *kv, ptrdiff_t row, const __m256 *qv, const int nv, const int bf16) {
    __m256 a = _mm256_mul_ps(qv[0], attn256_load(kv, row, bf16));
    for (int v = 1; v < nv; v++) a = _mm256_fmadd_ps(qv[v], attn256_load(kv, row + 8 * v, bf16), a);
    return a;
}

/* Rows p and p + 1 of a tile, hadd-ed: [a0+a1 a2+a3 b0+b1 b2+b3 | a4+a5 a6+a7 b4+b5 b6+b7]. */
ATTN256_INLINE __m256 attn256_pair(const char *kv, ptrdiff_t off, int dim, int p, int nt, const __m256 *qv,
                                   const int nv, const int bf16) {
    const __m256 a = p < nt ? attn256_row(kv, off + p * dim, qv, nv, bf16) : _mm256_setzero_ps();
    const __m256 b = p + 1 < nt ? attn256_row(kv, off + (p + 1) * dim, qv, nv, bf16) : _mm256_setzero_ps();
    return _mm256_hadd_ps(a, b);
}

/*
 * Lane p: q . K[p] for the nt <= 8 rows from off (0 for p >= nt, whose rows are not
 * read). The rows are folded as they come (pairs, then quads, then the two halves), so
 * that q's nv vectors stay in registers next to at most four partial results.
 */
ATTN256_INLINE __m256 attn256_scores(const char *kv, ptrdiff_t off, int dim, int nt, const __m256 *qv, const int nv,
                                     const int bf16) {
    /* hadd of two pairs gives each of four rows' sums over its lanes 0-3 (low half) and 4-7 (high half) */
    const __m256 lo = _mm256_hadd_ps(attn256_pair(kv, off, dim, 0, nt, qv, nv, bf16),
                                     attn256_pair(kv, off, dim, 2, nt, qv, nv, bf16));
    const __m256 hi = _mm256_hadd_ps(attn256_pair(kv, off, dim, 4, nt, qv, nv, bf16),
                                     attn256_pair(kv, off, dim, 6, nt, qv, nv, bf16));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

ATTN256_INLINE float attn256_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

ATTN256_INLINE float attn256_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/*
 * acc[h][:] = corr[h] * acc[h][:] + sum over the tile's nt rows p of w[h][p] * V[p] for
 * `heads` (a constant, <= 4) query heads, 16 columns at a time: heads * 2 accumulators
 * stay in registers while each row's two vectors are loaded once for all the heads.
 */
ATTN256_INLINE void attn256_pv(float *acc, const float *w, const float *corr, const char *kv, ptrdiff_t row, int nt,
                               int dim, const int nv, const int heads, const int bf16) {
    for (int c = 0; c < nv; c += 2) { /* nv is even: head_dim is a multiple of 16 */
        __m256 o[4][2];
        for (int h = 0; h < heads; h++) {
            const __m256 k = _mm256_set1_ps(corr[h]);
            for (int i = 0; i < 2; i++) o[h][i] = _mm256_mul_ps(_mm256_load_ps(acc + h * dim + 8 * (c + i)), k);
        }
        for (int p = 0; p < nt; p++) {
            const __m256 x0 = attn256_load(kv, row + p * dim + 8 * c, bf16);
            const __m256 x1 = attn256_load(kv, row + p * dim + 8 * c + 8, bf16);
            for (int h = 0; h < heads; h++) {
                const __m256 wp = _mm256_broadcast_ss(w + 16 * h + p);
                o[h][0] = _mm256_fmadd_ps(wp, x0, o[h][0]);
                o[h][1] = _mm256_fmadd_ps(wp, x1, o[h][1]);
            }
        }
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < 2; i++) _mm256_store_ps(acc + h * dim + 8 * (c + i), o[h][i]);
    }
}

ATTN256_INLINE void attn256_body(const attn_job_t *j, const attn_unit_t *u, float *part, const int bf16,
                                 const int nv_const) {
    const int G = j->group, D = j->dim, B = j->block;
    const int nv = nv_const ? nv_const : D / 8;
    const int len = j->lengths[u->seq];
    const int first = attn_first(j, u->seq);
    const int32_t *ids = j->tables + j->starts[u->seq];
    const ptrdiff_t esize = kvt_kind_bytes(bf16);
    const int q_bf16 = bf16 >= KVT_I8 ? j->bf16 : bf16; /* an 8-bit or float16 pool's q is the model's dtype */
    const int scaled = kvt_kind_scaled(bf16);
    float m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP], corr[ATTN_MAX_GROUP];
    float q[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(32)));
    float acc[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(32)));
    float w[ATTN_MAX_GROUP * 16] __attribute__((aligned(32))); /* head g's tile weights at w[16 g] */
    __m256 sc[ATTN_MAX_GROUP][2];

    const size_t q_row = (size_t)(u->seq * j->kv_heads + u->head) * G * D;
    const __m256 scale = _mm256_set1_ps(j->scale);
    for (int i = 0; i < G * D; i += 8)
        _mm256_store_ps(q + i, _mm256_mul_ps(attn256_load(j->q, (ptrdiff_t)(q_row + i), q_bf16), scale));
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);

    for (int b = u->b0; b < u->b1; b++) {
        int p0, n;
        attn_rows(b, B, first, len, &p0, &n);
        const ptrdiff_t k_off = (ptrdiff_t)ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head + (ptrdiff_t)p0 * j->s_pos;
        const ptrdiff_t v_off = k_off + j->s_kv;
        /* The next block's two tiles, whole, into L2: why, in the AVX-512 build. */
        if (b + 1 < u->b1) {
            const char *nk = j->kv + ((ptrdiff_t)ids[b + 1] * j->s_block + (ptrdiff_t)u->head * j->s_head) * esize;
            const ptrdiff_t tile = (ptrdiff_t)B * D * esize;
            for (ptrdiff_t o = 0; o < tile; o += 64) {
                _mm_prefetch(nk + o, _MM_HINT_T1);
                _mm_prefetch(nk + j->s_kv * esize + o, _MM_HINT_T1);
            }
        }
        for (int t0 = 0; t0 < n; t0 += 16) {
            const int nt = n - t0 < 16 ? n - t0 : 16;
            const int n0 = nt < 8 ? nt : 8, n1 = nt - n0;
            const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n0), iota));
            const __m256 live1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n1), iota));
            const ptrdiff_t krow = k_off + (ptrdiff_t)t0 * D;
            __m256 ks0 = _mm256_set1_ps(1.0f), ks1 = ks0, vs0 = ks0, vs1 = ks0;
            if (scaled) { /* the tile's rows' scales: a score is its row's dot product of quants times K's */
                const float *ks = attn_scales(j, ids[b], u->head, p0 + t0);
                const __m256i m0 = _mm256_castps_si256(live0), m1 = _mm256_castps_si256(live1);
                ks0 = _mm256_maskload_ps(ks, m0);
                ks1 = _mm256_maskload_ps(ks + 8, m1);
                vs0 = _mm256_maskload_ps(ks + j->ss_kv, m0);
                vs1 = _mm256_maskload_ps(ks + j->ss_kv + 8, m1);
            }
            for (int g = 0; g < G; g++) { /* all heads' scores first: their reductions overlap */
                __m256 qv[ATTN_MAX_DIM / 8];
                for (int v = 0; v < nv; v++) qv[v] = _mm256_load_ps(q + g * D + 8 * v);
                __m256 s0 = attn256_scores(j->kv, krow, D, n0, qv, nv, bf16);
                if (scaled) s0 = _mm256_mul_ps(s0, ks0);
                sc[g][0] = _mm256_blendv_ps(ninf, s0, live0);
                if (n1 > 0) {
                    __m256 s1 = attn256_scores(j->kv, krow + 8 * D, D, n1, qv, nv, bf16);
                    if (scaled) s1 = _mm256_mul_ps(s1, ks1);
                    sc[g][1] = _mm256_blendv_ps(ninf, s1, live1);
                } else {
                    sc[g][1] = ninf;
                }
            }
            for (int g = 0; g < G; g++) {
                const float mx = attn256_hmax(_mm256_max_ps(sc[g][0], sc[g][1]));
                float c = 1.0f;
                if (mx > m[g]) {
                    c = kvt_exp(m[g] - mx);
                    m[g] = mx;
                }
                const __m256 mg = _mm256_set1_ps(m[g]);
                const __m256 e0 = _mm256_and_ps(live0, kvt_exp256(_mm256_sub_ps(sc[g][0], mg)));
                const __m256 e1 = _mm256_and_ps(live1, kvt_exp256(_mm256_sub_ps(sc[g][1], mg)));
                l[g] = l[g] * c + attn256_hsum(_mm256_add_ps(e0, e1));
                /* V's quants are summed under weights times their rows' scales */
                _mm256_store_ps(w + 16 * g, scaled ? _mm256_mul_ps(e0, vs0) : e0);
                _mm256_store_ps(w + 16 * g + 8, scaled ? _mm256_mul_ps(e1, vs1) : e1);
                corr[g] = c;
            }
            const ptrdiff_t vrow = v_off + (ptrdiff_t)t0 * D;
            for (int g = 0; g < G; g += 4) {
                const int h = G - g < 4 ? G - g : 4;
                float *ag = acc + g * D;
                const float *wg = w + 16 * g;
                if (h == 4) attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 4, bf16);
                else if (h == 3) attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 3, bf16);
                else if (h == 2) attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 2, bf16);
                else attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 1, bf16);
            }
        }
    }
    memcpy(part, m, sizeof(float) * (size_t)G);
    memcpy(part + G, l, sizeof(float) * (size_t)G);
    memcpy(part + 2 * G, acc, sizeof(float) * (size_t)G * D);
}

ATTN256 void kvt_attn_unit_avx2(const attn_job_t *j, const attn_unit_t *u, float *part) {
    const int nv = j->dim / 8;
    if (j->kind == KVT_E4M3) {
        if (nv == 8) attn256_body(j, u, part, KVT_E4M3, 8);
        else if (nv == 16) attn256_body(j, u, part, KVT_E4M3, 16);
        else attn256_body(j, u, part, KVT_E4M3, 0);
    } else if (j->kind == KVT_F16) {
        if (nv == 8) attn256_body(j, u, part, KVT_F16, 8);
        else if (nv == 16) attn256_body(j, u, part, KVT_F16, 16);
        else attn256_body(j, u, part, KVT_F16, 0);
    } else if (j->kind == KVT_I8) {
        if (nv == 8) attn256_body(j, u, part, 2, 8);
        else if (nv == 16) attn256_body(j, u, part, 2, 16);
        else attn256_body(j, u, part, 2, 0);
    } else if (j->bf16) {
        if (nv == 8) attn256_body(j, u, part, 1, 8);
        else if (nv == 16) attn256_body(j, u, part, 1, 16);
        else attn256_body(j, u, part, 1, 0);
    } else {
        if (nv == 8) attn256_body(j, u, part, 0, 8);
        else if (nv == 16) attn256_body(j, u, part, 0, 16);
        else attn256_body(j, u, part, 0, 0);
    }
}
#endif
