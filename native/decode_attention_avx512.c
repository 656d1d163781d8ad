/* The AVX-512 build of a decode attention unit (decode_attention.h). */
#include <math.h>
#include <string.h>

#include "decode_attention.h"
#include "float_math.h"

#ifdef KVT_X86
/*
 * The AVX-512 unit, by hand: the auto-vectorised body (decode_attention.c) reduces
 * every dot product on its own, through the stack. Here a tile of 16 positions is
 * scored as 16 vector products folded into one vector of 16 scores (attn512_scores),
 * the tile's softmax weights are one vector, and V is accumulated in registers, four
 * heads per V row. nv (head_dim / 16) is a constant in the common instantiations (4 and
 * 8: head_dim 64 and 128), so the accumulators stay in registers and row offsets are
 * immediates. It runs about as fast from L2 as from L3, so it is bound by instructions
 * more than by memory: that is why bfloat16 rows are split rather than widened with
 * vpmovzxwd (see attn512_load) and each V row is loaded once for several heads, both of
 * which measured faster than the plainer forms. From DRAM, bfloat16 gains on float32 by
 * reading half the bytes.
 */
#include <immintrin.h>

#define ATTN512 __attribute__((target("avx512f,fma")))
#define ATTN512_INLINE static inline __attribute__((always_inline)) ATTN512

/*
 * Vector v of a row that starts at element off, as float32; `bf16` is a KVT_* kind (8-bit quants read as they are). For float32 and for
 * bfloat16 rows whose length is not a multiple of 32 (`split` 0), elements
 * [16v, 16v + 16). For other bfloat16 rows (`split` 1), each 64-byte run of 32
 * elements gives two vectors without a shuffle: its even elements (v even: each
 * 32-bit word shifted left 16) and its odd ones (v odd: the high halves, masked).
 * A dot product does not care about the order as long as q is loaded the same way;
 * the V accumulators are put back in order at the end (attn512_unsplit).
 */
ATTN512_INLINE __m512 attn512_load(const char *base, ptrdiff_t off, int v, const int bf16, const int split) {
    if (bf16 == 2) { /* int8 quants (the caller applies the row's scale) */
        const __m128i x = _mm_loadu_si128((const __m128i *)((const int8_t *)base + off + 16 * v));
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
    }
    if (bf16 == KVT_E4M3) /* float8 e4m3 quants, likewise */
        return kvt_e4m3_512((const uint8_t *)base + off + 16 * v);
    if (bf16 == KVT_F16) return kvt_f16_512((const uint16_t *)base + off + 16 * v);
    if (split) {
        const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)base + off + 32 * (v >> 1)));
        return _mm512_castsi512_ps((v & 1) ? _mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u))
                                           : _mm512_slli_epi32(x, 16));
    }
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off + 16 * v));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + off + 16 * v);
}

/* Back to element order: vectors 2c and 2c + 1 hold the even and odd elements of run c. */
ATTN512_INLINE void attn512_unsplit(float *dst, const float *src, int dim) {
    for (int c = 0; c < dim; c += 32)
        for (int i = 0; i < 16; i++) {
            dst[c + 2 * i] = src[c + i];
            dst[c + 2 * i + 1] = src[c + 16 + i];
        }
}

/* The 16-lane partial products of q . K[row] (lane sums still to take). */
/*
 * The scores of one query head against a tile of nt <= 16 rows: lane p is q . K[p]
 * (0 for p >= nt). Each row's dot product is 16 partial sums; the 16 vectors are folded
 * into one as they come (pairs, then quads, then eights, then the tile: 15 shuffle-adds
 * in all), which keeps at most a dozen of them alive at once.
 */
ATTN512_INLINE __m512 attn512_pair(__m512 a, __m512 b) { /* per 128-bit lane: [a b a b], each a sum of two */
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

ATTN512_INLINE __m512 attn512_quad(__m512 a, __m512 b) { /* per 128-bit lane: the sums of rows [4i, 4i + 4) */
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

ATTN512_INLINE __m512 attn512_fold(__m512 a, __m512 b) { /* 128-bit lanes 0, 2 of a, b plus lanes 1, 3 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

ATTN512_INLINE __m512 attn512_row(const char *kv, ptrdiff_t row, const __m512 *qv, const int nv, const int bf16,
                                  const int split) {
    if (split) { /* each 64-byte load feeds two FMAs */
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < nv / 2; c++) {
            const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)kv + row + 32 * c));
            a = _mm512_fmadd_ps(qv[2 * c], _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), a);
            a = _mm512_fmadd_ps(qv[2 * c + 1], _mm512_castsi512_ps(_mm512_and_si512(x, hi)), a);
        }
        return a;
    }
    __m512 a = _mm512_mul_ps(qv[0], attn512_load(kv, row, 0, bf16, 0));
    for (int v = 1; v < nv; v++) a = _mm512_fmadd_ps(qv[v], attn512_load(kv, row, v, bf16, 0), a);
    return a;
}

/* o += w * V[row], V[row] loaded as attn512_load orders it. */
ATTN512_INLINE void attn512_axpy(__m512 *o, __m512 w, const char *kv, ptrdiff_t row, const int nv, const int bf16,
                                 const int split) {
    if (split) {
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
        for (int c = 0; c < nv / 2; c++) {
            const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)kv + row + 32 * c));
            o[2 * c] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), o[2 * c]);
            o[2 * c + 1] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_and_si512(x, hi)), o[2 * c + 1]);
        }
        return;
    }
    for (int v = 0; v < nv; v++) o[v] = _mm512_fmadd_ps(w, attn512_load(kv, row, v, bf16, 0), o[v]);
}

/*
 * acc[h][:] = corr[h] * acc[h][:] + sum over the tile's rows p of w[h][p] * V[p] for
 * `heads` (<= 4, a constant) query heads at once: each V row is loaded once for all
 * of them, and heads * nv independent accumulators hide the FMA latency.
 */
ATTN512_INLINE void attn512_pv(float *acc, const float *w, const float *corr, const char *kv, ptrdiff_t row, int nt,
                               const int heads, const int nv, const int bf16, const int split) {
    __m512 o[4][ATTN_MAX_DIM / 16];
    for (int h = 0; h < heads; h++) {
        const __m512 c = _mm512_set1_ps(corr[h]);
        for (int v = 0; v < nv; v++) o[h][v] = _mm512_mul_ps(_mm512_load_ps(acc + h * nv * 16 + 16 * v), c);
    }
    for (int p = 0; p < nt; p++, row += nv * 16) {
        __m512 x[ATTN_MAX_DIM / 16];
        if (split) {
            const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
            for (int c = 0; c < nv / 2; c++) {
                const __m512i r = _mm512_loadu_si512((const void *)((const uint16_t *)kv + row + 32 * c));
                x[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
                x[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(r, hi));
            }
        } else {
            for (int v = 0; v < nv; v++) x[v] = attn512_load(kv, row, v, bf16, 0);
        }
        for (int h = 0; h < heads; h++) {
            const __m512 wp = _mm512_set1_ps(w[h * ATTN_LANES + p]);
            for (int v = 0; v < nv; v++) o[h][v] = _mm512_fmadd_ps(wp, x[v], o[h][v]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int v = 0; v < nv; v++) _mm512_store_ps(acc + h * nv * 16 + 16 * v, o[h][v]);
}

ATTN512_INLINE __m512 attn512_scores(const char *kv, ptrdiff_t k_off, ptrdiff_t s_pos, int nt, const __m512 *qv,
                                     const int nv, const int bf16, const int split) {
    __m512 quad[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512 pair[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int p = 4 * i + 2 * h;
            const __m512 a = p < nt ? attn512_row(kv, k_off + p * s_pos, qv, nv, bf16, split) : _mm512_setzero_ps();
            const __m512 b = p + 1 < nt ? attn512_row(kv, k_off + (p + 1) * s_pos, qv, nv, bf16, split)
                                        : _mm512_setzero_ps();
            pair[h] = attn512_pair(a, b);
        }
        quad[i] = attn512_quad(pair[0], pair[1]);
    }
    return attn512_fold(attn512_fold(quad[0], quad[1]), attn512_fold(quad[2], quad[3]));
}

ATTN512_INLINE void attn512_body(const attn_job_t *j, const attn_unit_t *u, float *part, const int bf16,
                                 const int split, const int nv_const) {
    const int G = j->group, D = j->dim, B = j->block;
    const int nv = nv_const ? nv_const : D / 16;
    const int len = j->lengths[u->seq];
    const int first = attn_first(j, u->seq);
    const int32_t *ids = j->tables + j->starts[u->seq];
    const ptrdiff_t esize = kvt_kind_bytes(bf16);
    const int q_bf16 = bf16 >= KVT_I8 ? j->bf16 : bf16; /* an 8-bit or float16 pool's q is the model's dtype */
    const int scaled = kvt_kind_scaled(bf16);
    float m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP];
    float q[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(64)));
    float acc[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(64)));
    float w[ATTN_MAX_GROUP * ATTN_LANES] __attribute__((aligned(64)));
    float corr[ATTN_MAX_GROUP];

    const size_t q_row = (size_t)(u->seq * j->kv_heads + u->head) * G * D;
    for (int g = 0; g < G; g++)
        for (int v = 0; v < nv; v++)
            _mm512_store_ps(q + g * D + 16 * v, _mm512_mul_ps(attn512_load(j->q, (ptrdiff_t)q_row + g * D, v, q_bf16, split),
                                                              _mm512_set1_ps(j->scale)));
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);

    for (int b = u->b0; b < u->b1; b++) {
        int p0, n;
        attn_rows(b, B, first, len, &p0, &n);
        const ptrdiff_t k_off = (ptrdiff_t)ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head + (ptrdiff_t)p0 * j->s_pos;
        const ptrdiff_t v_off = k_off + j->s_kv;
        /* The next block is anywhere in the pool: fetch its two tiles whole now, into L2 (as the
         * prefill kernel does): 64 lines at once into L1 queue behind its few miss buffers,
         * and from DRAM that measured slower. */
        if (b + 1 < u->b1) {
            const char *nk = j->kv + ((ptrdiff_t)ids[b + 1] * j->s_block + (ptrdiff_t)u->head * j->s_head) * esize;
            const ptrdiff_t tile = (ptrdiff_t)(B - 1) * j->s_pos * esize + D * esize;
            for (ptrdiff_t o = 0; o < tile; o += 64) {
                _mm_prefetch(nk + o, _MM_HINT_T1);
                _mm_prefetch(nk + j->s_kv * esize + o, _MM_HINT_T1);
            }
        }
        for (int t0 = 0; t0 < n; t0 += ATTN_LANES) {
            const int nt = n - t0 < ATTN_LANES ? n - t0 : ATTN_LANES;
            const __mmask16 live = (__mmask16)((1u << nt) - 1);
            __m512 sc[ATTN_MAX_GROUP], kscale = _mm512_set1_ps(1.0f), vscale = kscale;
            if (scaled) { /* the tile's rows' scales: a score is its row's dot product of quants times K's */
                const float *ks = attn_scales(j, ids[b], u->head, p0 + t0);
                kscale = _mm512_maskz_loadu_ps(live, ks);
                vscale = _mm512_maskz_loadu_ps(live, ks + j->ss_kv);
            }
            for (int g = 0; g < G; g++) { /* all heads' scores first: their reductions overlap */
                __m512 qv[ATTN_MAX_DIM / 16];
                for (int v = 0; v < nv; v++) qv[v] = _mm512_load_ps(q + g * D + 16 * v);
                __m512 raw = attn512_scores(j->kv, k_off + t0 * D, D, nt, qv, nv, bf16, split);
                if (scaled) raw = _mm512_mul_ps(raw, kscale);
                sc[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, raw);
            }
            for (int g = 0; g < G; g++) {
                const __m512 s = sc[g];
                const float mx = _mm512_reduce_max_ps(s);
                float c = 1.0f;
                if (mx > m[g]) {
                    c = kvt_exp(m[g] - mx);
                    m[g] = mx;
                }
                const __m512 e = _mm512_maskz_mov_ps(live, kvt_exp512(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
                l[g] = l[g] * c + _mm512_reduce_add_ps(e);
                /* V's quants are summed under weights times their rows' scales */
                _mm512_store_ps(w + g * ATTN_LANES, scaled ? _mm512_mul_ps(e, vscale) : e);
                corr[g] = c;
            }
            /* V, read once per row for up to four heads at a time */
            for (int g = 0; g < G; g += 4) {
                const int h = G - g < 4 ? G - g : 4;
                const ptrdiff_t row = v_off + t0 * D;
                float *ag = acc + g * D;
                const float *wg = w + g * ATTN_LANES;
                if (h == 4) attn512_pv(ag, wg, corr + g, j->kv, row, nt, 4, nv, bf16, split);
                else if (h == 3) attn512_pv(ag, wg, corr + g, j->kv, row, nt, 3, nv, bf16, split);
                else if (h == 2) attn512_pv(ag, wg, corr + g, j->kv, row, nt, 2, nv, bf16, split);
                else attn512_pv(ag, wg, corr + g, j->kv, row, nt, 1, nv, bf16, split);
            }
        }
    }
    memcpy(part, m, sizeof(float) * (size_t)G);
    memcpy(part + G, l, sizeof(float) * (size_t)G);
    if (split)
        for (int g = 0; g < G; g++) attn512_unsplit(part + 2 * G + g * D, acc + g * D, D);
    else
        memcpy(part + 2 * G, acc, sizeof(float) * (size_t)G * D);
}

ATTN512 void kvt_attn_unit_avx512(const attn_job_t *j, const attn_unit_t *u, float *part) {
    const int nv = j->dim / 16;
    if (j->kind == KVT_E4M3) {
        if (nv == 4) attn512_body(j, u, part, KVT_E4M3, 0, 4);
        else if (nv == 8) attn512_body(j, u, part, KVT_E4M3, 0, 8);
        else attn512_body(j, u, part, KVT_E4M3, 0, 0);
    } else if (j->kind == KVT_F16) {
        if (nv == 4) attn512_body(j, u, part, KVT_F16, 0, 4);
        else if (nv == 8) attn512_body(j, u, part, KVT_F16, 0, 8);
        else attn512_body(j, u, part, KVT_F16, 0, 0);
    } else if (j->kind == KVT_I8) {
        if (nv == 4) attn512_body(j, u, part, 2, 0, 4);
        else if (nv == 8) attn512_body(j, u, part, 2, 0, 8);
        else attn512_body(j, u, part, 2, 0, 0);
    } else if (!j->bf16) {
        if (nv == 4) attn512_body(j, u, part, 0, 0, 4);
        else if (nv == 8) attn512_body(j, u, part, 0, 0, 8);
        else attn512_body(j, u, part, 0, 0, 0);
    } else if (j->dim % 32 == 0) {
        if (nv == 4) attn512_body(j, u, part, 1, 1, 4);
        else if (nv == 8) attn512_body(j, u, part, 1, 1, 8);
        else attn512_body(j, u, part, 1, 1, 0);
    } else {
        attn512_body(j, u, part, 1, 0, 0);
    }
}
#endif
