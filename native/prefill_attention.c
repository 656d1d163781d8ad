/*
 * paged_prefill_attention: one sequence's new tokens against all of its positions
 * (the cached ones and their own, causally), read in place from a paged KV pool layer.
 *
 * An agent's next turn is a long cached transcript plus a few dozen new tokens: a
 * prefill of T new rows over start + T positions. torch's way is to gather the
 * sequence's K/V out of its blocks into one tensor and call SDPA with a shifted causal
 * mask: the gather copies every cached byte before any arithmetic, and SDPA on these
 * short, wide shapes runs well below the rate the same cores reach in a large matmul.
 * On a cache hit this attention is a large share of the time to first token (see
 * bench/README.md).
 *
 * The kernel works as a small GEMM with the query rows in the vector lanes. A unit is
 * one KV head and a run of new tokens: its R = tokens * group query rows (token-major,
 * then the group's heads), scaled and transposed once into Qt[dim][rows], so that
 *
 *   scores  S[p][r] = sum_d Qt[d][r] * K[p][d]    (K row elements broadcast)
 *   output  O[d][r] = c[r] O[d][r] + sum_p P[p][r] * V[p][d]
 *
 * are both outer-product updates of 24-row x 4-column register tiles (12 of AVX2's 16
 * registers as accumulators, one vector load per 4 FMAs), reading K and V rows where
 * they lie in the pool. The online softmax runs down the columns of S: the running
 * maximum, the sum and the rescaling factor of eight rows are one vector each. A tile
 * is 16 positions of one block; new token t sees positions <= start + t, so only the
 * tiles that reach past start + (the unit's first token) are masked.
 *
 * Every row is computed on its own, in the same order of tiles whatever the units are
 * or however many threads share them, so a result is the same bits on any thread
 * count. It differs from SDPA's by rounding only (float32 throughout).
 *
 * A sliding-window layer (window > 0) sees only positions > its own - window. Tiles
 * below every row's window are skipped; a row whose window starts later than its unit's
 * first row's still meets the tiles in between, wholly masked for it, and those leave
 * its state exactly as it was (weights 0, rescale exp(0) = 1, or nothing seen yet), so
 * a row's result still does not depend on the rows beside it: the same bits however a
 * prompt was cut into chunks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "float_math.h"
#include "kernels.h"
#include "team.h"

#define PF_TILE 16      /* key positions per tile */
#define PF_PANEL 24     /* query rows per register tile: three vectors of 8 */
#define PF_UNIT_ROWS 96 /* query rows per unit, at most: its K/V stream is shared by that many */
#define PF_MAX_GROUP 16
#define PF_MAX_DIM 256
#define PF_MAX_BLOCK 256
#define PF_MAX_THREADS 16

typedef struct {
    int head, t0, t1; /* KV head, new tokens [t0, t1) */
} pf_unit_t;

typedef struct pf_job {
    const char *kv;                         /* the layer's pool */
    ptrdiff_t s_block, s_kv, s_head, s_pos; /* its strides, in elements */
    int bf16;                               /* q and out are bfloat16, else float32 */
    int kind;                               /* KVT_*: the pool's elements; 8-bit ones with a float32 scale per row */
    const float *scales;                    /* the layer's scales (8-bit): block b's at scales + b * ss_block */
    ptrdiff_t ss_block, ss_kv, ss_head;     /* their strides, in floats (a row's is 1) */
    const char *q;                          /* [tokens, kv_heads * group, dim] */
    char *out;                              /* the same shape */
    const int32_t *ids;                     /* the sequence's blocks */
    int start, tokens, kv_heads, group, dim, block;
    int window; /* a sliding-window layer's: positions each row sees back from its own, itself included; 0: all */
    float scale;
    pf_unit_t *units;
    size_t n_units, next; /* next: the next unclaimed unit (atomic) */
    void (*unit_fn)(const struct pf_job *, const pf_unit_t *, float *);
    size_t scratch_floats;
} pf_job_t;

static inline float pf_load(const char *base, ptrdiff_t i, int bf16) {
    return bf16 ? kvt_bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Element i of a pool that is not the model's dtype, as float32: float16, or an 8-bit quant (int8 or
 * float8 e4m3) before its row's scale. */
static inline float pf_wide(const pf_job_t *j, const char *base, ptrdiff_t i) {
    if (j->kind == KVT_F16) return kvt_f16_to_f32(((const uint16_t *)base)[i]);
    const uint8_t x = ((const uint8_t *)base)[i];
    return j->kind == KVT_E4M3 ? kvt_e4m3_to_f32(x) : (float)(int8_t)x;
}


/* An 8-bit pool's K scales of rows [t0, ...) of the sequence's block b, the unit's KV head (V's at + ss_kv). */
static inline const float *pf_scales(const pf_job_t *j, const pf_unit_t *u, int b, int t0) {
    return j->scales + (ptrdiff_t)j->ids[b] * j->ss_block + (ptrdiff_t)u->head * j->ss_head + t0;
}

/* The unit's scratch, in floats from the start of a 64-byte aligned buffer. */
typedef struct {
    int rows, padded;
    float *qt, *ot, *s, *m, *l, *c, *qpos, *kt, *vt;
} pf_scratch_t;

#define PF_PANEL_BF16 32 /* query rows per register tile of the bf16 build: two vectors of 16 */

static size_t pf_padded(int rows, int panel) { return (size_t)(rows + panel - 1) / panel * panel; }

static size_t pf_scratch_floats(int group, int dim) {
    const int rows = PF_UNIT_ROWS / group * group;
    const size_t a = pf_padded(rows, PF_PANEL), b = pf_padded(rows, PF_PANEL_BF16);
    const size_t rp = a > b ? a : b;
    const size_t floats = 2 * (size_t)dim * rp + (size_t)PF_TILE * rp + 4 * rp + 2 * (size_t)PF_TILE * (size_t)dim;
    /* the bf16 build's pairs: Q [dim/2][rp], P [tile/2][rp], V [tile/2][dim], K and V of a partial tile */
    return floats + (size_t)dim / 2 * rp + (size_t)PF_TILE / 2 * rp + (size_t)PF_TILE / 2 * dim + (size_t)PF_TILE * dim;
}

/* Lays the scratch out and fills Qt (scaled, transposed; padding rows 0), O = 0, m = -inf. */
static void pf_begin(const pf_job_t *j, const pf_unit_t *u, float *buf, pf_scratch_t *w, int panel) {
    const int G = j->group, D = j->dim, H = j->kv_heads * G;
    w->rows = (u->t1 - u->t0) * G;
    w->padded = (int)pf_padded(w->rows, panel);
    const int RP = w->padded;
    w->qt = buf;
    w->ot = w->qt + (size_t)D * RP;
    w->s = w->ot + (size_t)D * RP;
    w->m = w->s + (size_t)PF_TILE * RP;
    w->l = w->m + RP;
    w->c = w->l + RP;
    w->qpos = w->c + RP;
    w->kt = w->qpos + RP;
    w->vt = w->kt + (size_t)PF_TILE * D;
    memset(w->qt, 0, sizeof(float) * (size_t)D * RP);
    memset(w->ot, 0, sizeof(float) * (size_t)D * RP);
    for (int r = 0; r < RP; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
        /* padding rows see every position: their scores are 0, never a row of -inf */
        w->qpos[r] = r < w->rows ? (float)(j->start + u->t0 + r / G) : 1e30f;
    }
    for (int r = 0; r < w->rows; r++) {
        const int t = u->t0 + r / G, h = u->head * G + r % G;
        const ptrdiff_t at = ((ptrdiff_t)t * H + h) * D;
        for (int d = 0; d < D; d++) w->qt[(size_t)d * RP + r] = pf_load(j->q, at + d, j->bf16) * j->scale;
    }
}

/* out[t, h] = O[:, r] / l[r] for the unit's real rows. */
static void pf_end(const pf_job_t *j, const pf_unit_t *u, const pf_scratch_t *w) {
    const int G = j->group, D = j->dim, H = j->kv_heads * G, RP = w->padded;
    for (int r = 0; r < w->rows; r++) {
        const int t = u->t0 + r / G, h = u->head * G + r % G;
        const ptrdiff_t at = ((ptrdiff_t)t * H + h) * D;
        const float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f;
        for (int d = 0; d < D; d++) {
            const float x = w->ot[(size_t)d * RP + r] * inv;
            if (j->bf16) ((uint16_t *)j->out)[at + d] = kvt_f32_to_bf16(x);
            else ((float *)j->out)[at + d] = x;
        }
    }
}

/*
 * The K and V rows of positions [p0, p0 + PF_TILE) of block b: the pool itself for a
 * whole float32 tile, else nt rows converted into kt/vt and the rest zero.
 */
static inline void pf_tile(const pf_job_t *j, const pf_unit_t *u, const pf_scratch_t *w, int b, int t0, int nt,
                           const float **k, const float **v) {
    const int D = j->dim;
    const ptrdiff_t k_off = (ptrdiff_t)j->ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head + (ptrdiff_t)t0 * j->s_pos;
    const ptrdiff_t v_off = k_off + j->s_kv;
    if (j->kind >= KVT_I8) { /* quants times their rows' scales (the K/V an 8-bit pool holds), or float16 */
        const float *ks = kvt_kind_scaled(j->kind) ? pf_scales(j, u, b, t0) : NULL;
        for (int p = 0; p < PF_TILE; p++) {
            const float kp = p < nt ? (ks ? ks[p] : 1.0f) : 0.0f, vp = p < nt ? (ks ? ks[j->ss_kv + p] : 1.0f) : 0.0f;
            for (int d = 0; d < D; d++) {
                const ptrdiff_t at = (ptrdiff_t)p * j->s_pos + d;
                w->kt[p * D + d] = p < nt ? pf_wide(j, j->kv, k_off + at) * kp : 0.0f;
                w->vt[p * D + d] = p < nt ? pf_wide(j, j->kv, v_off + at) * vp : 0.0f;
            }
        }
        *k = w->kt;
        *v = w->vt;
        return;
    }
    if (j->kind == KVT_F32 && nt == PF_TILE) {
        *k = (const float *)j->kv + k_off;
        *v = (const float *)j->kv + v_off;
        return;
    }
    for (int p = 0; p < PF_TILE; p++)
        for (int d = 0; d < D; d++) {
            w->kt[p * D + d] = p < nt ? pf_load(j->kv, k_off + (ptrdiff_t)p * j->s_pos + d, j->bf16) : 0.0f;
            w->vt[p * D + d] = p < nt ? pf_load(j->kv, v_off + (ptrdiff_t)p * j->s_pos + d, j->bf16) : 0.0f;
        }
    *k = w->kt;
    *v = w->vt;
}

/* Whether tile [pos0, pos0 + PF_TILE) lies below every row's window (the unit's first row starts the lowest one). */
static inline int pf_below_window(const pf_job_t *j, int pos0, int first) {
    return j->window > 0 && pos0 + PF_TILE - 1 + j->window <= first;
}

/* Whether the tile needs its mask: positions past its end, past the unit's first row, or before some row's window. */
static inline int pf_masked(const pf_job_t *j, const pf_unit_t *u, int pos0, int nt) {
    const int first = j->start + u->t0, last = j->start + u->t1 - 1;
    return nt < PF_TILE || pos0 + PF_TILE - 1 > first || (j->window > 0 && pos0 + j->window <= last);
}

/* -- portable ---------------------------------------------------------------------- */

static void pf_unit_base(const pf_job_t *j, const pf_unit_t *u, float *buf) {
    const int D = j->dim, B = j->block;
    pf_scratch_t w;
    pf_begin(j, u, buf, &w, PF_PANEL);
    const int RP = w.padded;
    const int n_keys = j->start + u->t1;
    const float first = (float)(j->start + u->t0);
    for (int b = 0; b * B < n_keys; b++) {
        const int n = n_keys - b * B < B ? n_keys - b * B : B;
        for (int t0 = 0; t0 < n; t0 += PF_TILE) {
            const int nt = n - t0 < PF_TILE ? n - t0 : PF_TILE;
            const int pos0 = b * B + t0;
            if (pf_below_window(j, pos0, (int)first)) continue;
            const float *k, *v;
            pf_tile(j, u, &w, b, t0, nt, &k, &v);
            for (int p = 0; p < PF_TILE; p++) {
                float *s = w.s + (size_t)p * RP;
                for (int r = 0; r < RP; r++) s[r] = 0.0f;
                for (int d = 0; d < D; d++) {
                    const float kd = k[p * D + d];
                    const float *q = w.qt + (size_t)d * RP;
                    for (int r = 0; r < RP; r++) s[r] += q[r] * kd;
                }
            }
            const int masked = pf_masked(j, u, pos0, nt);
            const float reach = (float)(j->window > 0 ? j->window - 1 : -1); /* window rows see qpos - reach .. */
            for (int r = 0; r < RP; r++) {
                float mx = w.m[r];
                for (int p = 0; p < PF_TILE; p++) {
                    float *s = w.s + (size_t)p * RP + r;
                    const float pos = (float)(pos0 + p);
                    if (masked && (p >= nt || pos > w.qpos[r] || (reach >= 0.0f && pos < w.qpos[r] - reach)))
                        *s = -INFINITY;
                    mx = *s > mx ? *s : mx;
                }
                const float c = mx == -INFINITY ? 0.0f : kvt_exp(w.m[r] - mx); /* nothing seen yet: all stays 0 */
                float sum = 0.0f;
                for (int p = 0; p < PF_TILE; p++) {
                    float *s = w.s + (size_t)p * RP + r;
                    const float e = *s == -INFINITY ? 0.0f : kvt_exp(*s - mx);
                    *s = e;
                    sum += e;
                }
                w.l[r] = w.l[r] * c + sum;
                w.m[r] = mx;
                w.c[r] = c;
            }
            for (int d = 0; d < D; d++) {
                float *o = w.ot + (size_t)d * RP;
                for (int r = 0; r < RP; r++) o[r] *= w.c[r];
                for (int p = 0; p < PF_TILE; p++) {
                    const float vd = v[p * D + d];
                    const float *pr = w.s + (size_t)p * RP;
                    for (int r = 0; r < RP; r++) o[r] += pr[r] * vd;
                }
            }
        }
    }
    pf_end(j, u, &w);
}

/* -- AVX2 + FMA -------------------------------------------------------------------- */
#if defined(__x86_64__) || defined(__i386__)
#define PF_AVX2 __attribute__((target("avx2,fma,f16c")))
#define PF_AVX2_INLINE static inline __attribute__((always_inline)) PF_AVX2

/* S[p0 + i][r0 .. r0 + 24) = Qt[:, r0 ..] . K[p0 + i] for i < 4: 12 accumulators. */
PF_AVX2_INLINE void pf256_scores(const float *qt, int rp, const float *k, int dim, float *s) {
    __m256 a[4][3];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 3; c++) a[i][c] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d++) {
        const float *q = qt + (size_t)d * rp;
        const __m256 q0 = _mm256_load_ps(q), q1 = _mm256_load_ps(q + 8), q2 = _mm256_load_ps(q + 16);
        for (int i = 0; i < 4; i++) {
            const __m256 kd = _mm256_broadcast_ss(k + i * dim + d);
            a[i][0] = _mm256_fmadd_ps(q0, kd, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(q1, kd, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(q2, kd, a[i][2]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 3; c++) _mm256_store_ps(s + (size_t)i * rp + 8 * c, a[i][c]);
}

/* O[d0 + i][r0 ..] = c * O[d0 + i][r0 ..] + sum_p P[p][r0 ..] * V[p][d0 + i] for i < 4. */
PF_AVX2_INLINE void pf256_values(float *ot, int rp, const float *pw, const float *v, int dim, const float *c) {
    __m256 o[4][3];
    const __m256 c0 = _mm256_load_ps(c), c1 = _mm256_load_ps(c + 8), c2 = _mm256_load_ps(c + 16);
    for (int i = 0; i < 4; i++) {
        const float *row = ot + (size_t)i * rp;
        o[i][0] = _mm256_mul_ps(_mm256_load_ps(row), c0);
        o[i][1] = _mm256_mul_ps(_mm256_load_ps(row + 8), c1);
        o[i][2] = _mm256_mul_ps(_mm256_load_ps(row + 16), c2);
    }
    for (int p = 0; p < PF_TILE; p++) {
        const float *pr = pw + (size_t)p * rp;
        const __m256 p0 = _mm256_load_ps(pr), p1 = _mm256_load_ps(pr + 8), p2 = _mm256_load_ps(pr + 16);
        for (int i = 0; i < 4; i++) {
            const __m256 vd = _mm256_broadcast_ss(v + p * dim + i);
            o[i][0] = _mm256_fmadd_ps(p0, vd, o[i][0]);
            o[i][1] = _mm256_fmadd_ps(p1, vd, o[i][1]);
            o[i][2] = _mm256_fmadd_ps(p2, vd, o[i][2]);
        }
    }
    for (int i = 0; i < 4; i++) {
        float *row = ot + (size_t)i * rp;
        _mm256_store_ps(row, o[i][0]);
        _mm256_store_ps(row + 8, o[i][1]);
        _mm256_store_ps(row + 16, o[i][2]);
    }
}

/* The tile's softmax, eight rows at a time: mask, running max, weights into S, sums. */
PF_AVX2_INLINE void pf256_softmax(const pf_scratch_t *w, int pos0, int nt, int masked, int window) {
    const int RP = w->padded;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    /* a window row sees positions >= qpos - (window - 1); without one, every position >= -inf */
    const __m256 reach = _mm256_set1_ps(window > 0 ? (float)(window - 1) : INFINITY);
    for (int r = 0; r < RP; r += 8) {
        const __m256 qpos = _mm256_load_ps(w->qpos + r);
        const __m256 qlo = _mm256_sub_ps(qpos, reach);
        __m256 live[PF_TILE] = {0};
        __m256 mx = _mm256_load_ps(w->m + r);
        for (int p = 0; p < PF_TILE; p++) {
            float *s = w->s + (size_t)p * RP + r;
            __m256 x = _mm256_load_ps(s);
            if (masked) {
                const __m256 pos = _mm256_set1_ps((float)(pos0 + p));
                live[p] = p < nt ? _mm256_and_ps(_mm256_cmp_ps(pos, qpos, _CMP_LE_OQ), _mm256_cmp_ps(pos, qlo, _CMP_GE_OQ))
                                 : _mm256_setzero_ps();
                x = _mm256_blendv_ps(ninf, x, live[p]);
            }
            mx = _mm256_max_ps(mx, x);
            _mm256_store_ps(s, x);
        }
        const __m256 old = _mm256_load_ps(w->m + r);
        const __m256 c = kvt_exp256(_mm256_sub_ps(old, mx));
        __m256 sum = _mm256_setzero_ps();
        for (int p = 0; p < PF_TILE; p++) {
            float *s = w->s + (size_t)p * RP + r;
            __m256 e = kvt_exp256(_mm256_sub_ps(_mm256_load_ps(s), mx));
            if (masked) e = _mm256_and_ps(e, live[p]);
            sum = _mm256_add_ps(sum, e);
            _mm256_store_ps(s, e);
        }
        _mm256_store_ps(w->l + r, _mm256_fmadd_ps(_mm256_load_ps(w->l + r), c, sum));
        _mm256_store_ps(w->m + r, mx);
        _mm256_store_ps(w->c + r, c);
    }
}

/*
 * An 8-bit tile's quants times their rows' scales (the same products pf_tile's scalar loop
 * takes), or a whole bfloat16 tile widened into kt/vt eight elements at a time (a bfloat16 is the
 * top half of a float32: zero-extend, shift), the same bits pf_tile's scalar loop gives;
 * anything else goes through pf_tile. Every unit widens every tile it reads, so this
 * runs as often as the score products do.
 */
/* pf_wide of elements [i, i + 8). */
PF_AVX2_INLINE __m256 pf256_wide(const pf_job_t *j, const char *base, ptrdiff_t i) {
    if (j->kind == KVT_F16) return kvt_f16_256((const uint16_t *)base + i);
    if (j->kind == KVT_E4M3) return kvt_e4m3_256((const uint8_t *)base + i);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)base + i))));
}

PF_AVX2_INLINE void pf256_tile(const pf_job_t *j, const pf_unit_t *u, const pf_scratch_t *w, int b, int t0, int nt,
                               const float **k, const float **v) {
    const int D = j->dim;
    if (j->kind >= KVT_I8 && D % 8 == 0) { /* 8-bit quants times their rows' scales, or float16, eight at a time */
        const ptrdiff_t k_off =
            (ptrdiff_t)j->ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head + (ptrdiff_t)t0 * j->s_pos;
        const float *ks = kvt_kind_scaled(j->kind) ? pf_scales(j, u, b, t0) : NULL;
        for (int p = 0; p < PF_TILE; p++) {
            const __m256 kp = _mm256_set1_ps(p < nt ? (ks ? ks[p] : 1.0f) : 0.0f);
            const __m256 vp = _mm256_set1_ps(p < nt ? (ks ? ks[j->ss_kv + p] : 1.0f) : 0.0f);
            for (int d = 0; d < D; d += 8) {
                const ptrdiff_t at = k_off + (ptrdiff_t)p * j->s_pos + d;
                __m256 kx = _mm256_setzero_ps(), vx = _mm256_setzero_ps();
                if (p < nt) {
                    kx = pf256_wide(j, j->kv, at);
                    vx = pf256_wide(j, j->kv, at + j->s_kv);
                }
                _mm256_storeu_ps(w->kt + p * D + d, _mm256_mul_ps(kx, kp));
                _mm256_storeu_ps(w->vt + p * D + d, _mm256_mul_ps(vx, vp));
            }
        }
        *k = w->kt;
        *v = w->vt;
        return;
    }
    if (j->kind != KVT_BF16 || nt != PF_TILE || D % 8) {
        pf_tile(j, u, w, b, t0, nt, k, v);
        return;
    }
    const ptrdiff_t k_off = (ptrdiff_t)j->ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head + (ptrdiff_t)t0 * j->s_pos;
    const uint16_t *ks = (const uint16_t *)j->kv + k_off, *vs = (const uint16_t *)j->kv + k_off + j->s_kv;
    for (int p = 0; p < PF_TILE; p++)
        for (int d = 0; d < D; d += 8) {
            const ptrdiff_t at = (ptrdiff_t)p * j->s_pos + d;
            const __m128i kh = _mm_loadu_si128((const __m128i *)(ks + at)), vh = _mm_loadu_si128((const __m128i *)(vs + at));
            _mm256_storeu_ps(w->kt + p * D + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(kh), 16)));
            _mm256_storeu_ps(w->vt + p * D + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(vh), 16)));
        }
    *k = w->kt;
    *v = w->vt;
}

PF_AVX2 static void pf_unit_avx2(const pf_job_t *j, const pf_unit_t *u, float *buf) {
    const int D = j->dim, B = j->block;
    pf_scratch_t w;
    pf_begin(j, u, buf, &w, PF_PANEL);
    const int RP = w.padded;
    const int n_keys = j->start + u->t1;
    const int first = j->start + u->t0;
    for (int b = 0; b * B < n_keys; b++) {
        const int n = n_keys - b * B < B ? n_keys - b * B : B;
        if ((b + 1) * B < n_keys) { /* the next block is anywhere in the pool: start fetching it */
            const ptrdiff_t next = (ptrdiff_t)j->ids[b + 1] * j->s_block + (ptrdiff_t)u->head * j->s_head;
            const size_t esize = (size_t)kvt_kind_bytes(j->kind);
            const char *nk = j->kv + next * (ptrdiff_t)esize, *nv = j->kv + (next + j->s_kv) * (ptrdiff_t)esize;
            for (size_t o = 0; o < (size_t)PF_TILE * (size_t)D * esize; o += 64) {
                _mm_prefetch(nk + o, _MM_HINT_T1);
                _mm_prefetch(nv + o, _MM_HINT_T1);
            }
        }
        for (int t0 = 0; t0 < n; t0 += PF_TILE) {
            const int nt = n - t0 < PF_TILE ? n - t0 : PF_TILE;
            const int pos0 = b * B + t0;
            if (pf_below_window(j, pos0, first)) continue;
            const float *k, *v;
            pf256_tile(j, u, &w, b, t0, nt, &k, &v);
            for (int r = 0; r < RP; r += PF_PANEL)
                for (int p = 0; p < PF_TILE; p += 4) pf256_scores(w.qt + r, RP, k + p * D, D, w.s + (size_t)p * RP + r);
            pf256_softmax(&w, pos0, nt, pf_masked(j, u, pos0, nt), j->window);
            for (int r = 0; r < RP; r += PF_PANEL)
                for (int d = 0; d < D; d += 4) pf256_values(w.ot + (size_t)d * RP + r, RP, w.s + r, v + d, D, w.c + r);
        }
    }
    pf_end(j, u, &w);
}

/* -- AVX-512 BF16 ------------------------------------------------------------------ */
/*
 * For a bfloat16 pool: the products take bfloat16 pairs straight from the pool with
 * VDPBF16PS, two multiply-adds per float32 lane (twice AVX2's), and no widening of K.
 * Scores pair up the head dimension: a K row's elements d, d + 1 are adjacent in the
 * pool, one 32-bit broadcast; Q is laid out as the same pairs once per unit (exact for
 * a bf16 model's q scaled by a power of two). Outputs pair up positions: the softmax
 * weights of positions p, p + 1 rounded to bfloat16 (as flash-attention kernels do for
 * this product) against V rows p, p + 1 interleaved once per tile. The softmax and
 * every sum stay float32, and each row is still computed alone, in one order of tiles.
 * An int8 pool (with a bfloat16 model) takes the same path: each tile's quants times
 * their rows' scales, rounded to bfloat16 once into the partial-tile buffers.
 */
#define PF_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))
#define PF_BF16_INLINE static inline __attribute__((always_inline)) PF_BF16

typedef struct {
    uint32_t *qp, *pp, *vp; /* Q [dim/2][RP], P [tile/2][RP], V [tile/2][dim]: bf16 pairs */
    uint16_t *kb, *vb;      /* a partial tile's K and V rows, zero past its end */
} pf_pairs_t;

/* pf_wide of elements [i, i + 16). */
PF_BF16_INLINE __m512 pf512_wide(const pf_job_t *j, const char *base, ptrdiff_t i) {
    if (j->kind == KVT_F16) return kvt_f16_512((const uint16_t *)base + i);
    if (j->kind == KVT_E4M3) return kvt_e4m3_512((const uint8_t *)base + i);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)base + i))));
}

PF_BF16_INLINE __m512 pf512_dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* Two bf16 values per 32-bit lane: lo from a, hi from b (eight... sixteen lanes). */
PF_BF16_INLINE __m512i pf512_pair(__m256i a, __m256i b) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* S[p0 + i][r0 .. r0 + 32) for i < 8: 16 accumulators over dim/2 pairs. */
PF_BF16_INLINE void pf512_scores(const uint32_t *qp, int rp, const uint16_t *k, ptrdiff_t k_stride, int dim,
                                 float *s) {
    __m512 a[8][2];
    for (int i = 0; i < 8; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
    for (int dp = 0; dp < dim / 2; dp++) {
        const uint32_t *q = qp + (size_t)dp * rp;
        const __m512i q0 = _mm512_load_si512(q), q1 = _mm512_load_si512(q + 16);
        for (int i = 0; i < 8; i++) {
            uint32_t kk;
            memcpy(&kk, k + i * k_stride + 2 * dp, 4);
            const __m512i kd = _mm512_set1_epi32((int)kk);
            a[i][0] = pf512_dot(a[i][0], q0, kd);
            a[i][1] = pf512_dot(a[i][1], q1, kd);
        }
    }
    for (int i = 0; i < 8; i++) {
        _mm512_store_ps(s + (size_t)i * rp, a[i][0]);
        _mm512_store_ps(s + (size_t)i * rp + 16, a[i][1]);
    }
}

/* O[d0 + i][r0 .. r0 + 32) = c O + sum_p P[p] V[p][d0 + i] for i < 8, over tile/2 position pairs. */
PF_BF16_INLINE void pf512_values(float *ot, int rp, const uint32_t *pp, const uint32_t *vp, int dim, const float *c) {
    __m512 o[8][2];
    const __m512 c0 = _mm512_load_ps(c), c1 = _mm512_load_ps(c + 16);
    for (int i = 0; i < 8; i++) {
        o[i][0] = _mm512_mul_ps(_mm512_load_ps(ot + (size_t)i * rp), c0);
        o[i][1] = _mm512_mul_ps(_mm512_load_ps(ot + (size_t)i * rp + 16), c1);
    }
    for (int pr = 0; pr < PF_TILE / 2; pr++) {
        const uint32_t *prow = pp + (size_t)pr * rp;
        const __m512i p0 = _mm512_load_si512(prow), p1 = _mm512_load_si512(prow + 16);
        for (int i = 0; i < 8; i++) {
            const __m512i vd = _mm512_set1_epi32((int)vp[(size_t)pr * dim + i]);
            o[i][0] = pf512_dot(o[i][0], p0, vd);
            o[i][1] = pf512_dot(o[i][1], p1, vd);
        }
    }
    for (int i = 0; i < 8; i++) {
        _mm512_store_ps(ot + (size_t)i * rp, o[i][0]);
        _mm512_store_ps(ot + (size_t)i * rp + 16, o[i][1]);
    }
}

/* pf256_softmax, sixteen rows at a time. */
PF_BF16_INLINE void pf512_softmax(const pf_scratch_t *w, int pos0, int nt, int masked, int window) {
    const int RP = w->padded;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 reach = _mm512_set1_ps(window > 0 ? (float)(window - 1) : INFINITY); /* as pf256_softmax */
    for (int r = 0; r < RP; r += 16) {
        const __m512 qpos = _mm512_load_ps(w->qpos + r);
        const __m512 qlo = _mm512_sub_ps(qpos, reach);
        __mmask16 live[PF_TILE];
        __m512 mx = _mm512_load_ps(w->m + r);
        for (int p = 0; p < PF_TILE; p++) {
            float *s = w->s + (size_t)p * RP + r;
            __m512 x = _mm512_load_ps(s);
            if (masked) {
                const __m512 pos = _mm512_set1_ps((float)(pos0 + p));
                live[p] = p < nt ? _mm512_cmp_ps_mask(pos, qpos, _CMP_LE_OQ) & _mm512_cmp_ps_mask(pos, qlo, _CMP_GE_OQ) : 0;
                x = _mm512_mask_mov_ps(ninf, live[p], x);
            }
            mx = _mm512_max_ps(mx, x);
            _mm512_store_ps(s, x);
        }
        const __m512 c = kvt_exp512(_mm512_sub_ps(_mm512_load_ps(w->m + r), mx));
        __m512 sum = _mm512_setzero_ps();
        for (int p = 0; p < PF_TILE; p++) {
            float *s = w->s + (size_t)p * RP + r;
            __m512 e = kvt_exp512(_mm512_sub_ps(_mm512_load_ps(s), mx));
            if (masked) e = _mm512_maskz_mov_ps(live[p], e);
            sum = _mm512_add_ps(sum, e);
            _mm512_store_ps(s, e);
        }
        _mm512_store_ps(w->l + r, _mm512_fmadd_ps(_mm512_load_ps(w->l + r), c, sum));
        _mm512_store_ps(w->m + r, mx);
        _mm512_store_ps(w->c + r, c);
    }
}

PF_BF16 static void pf_unit_bf16(const pf_job_t *j, const pf_unit_t *u, float *buf) {
    const int D = j->dim, B = j->block;
    if (!j->bf16 || D % 16) { /* a float32 pool (q), or a dimension the pairs do not tile */
        pf_unit_avx2(j, u, buf);
        return;
    }
    pf_scratch_t w;
    pf_begin(j, u, buf, &w, PF_PANEL_BF16);
    const int RP = w.padded;
    pf_pairs_t x;
    x.qp = (uint32_t *)(w.vt + (size_t)PF_TILE * D);
    x.pp = x.qp + (size_t)D / 2 * RP;
    x.vp = x.pp + (size_t)PF_TILE / 2 * RP;
    x.kb = (uint16_t *)(x.vp + (size_t)PF_TILE / 2 * D);
    x.vb = x.kb + (size_t)PF_TILE * D;
    for (int dp = 0; dp < D / 2; dp++) /* Qt holds bf16 values times the scale: pairs of its rows */
        for (int r = 0; r < RP; r += 16) {
            const __m256i a = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(w.qt + (size_t)(2 * dp) * RP + r));
            const __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(w.qt + (size_t)(2 * dp + 1) * RP + r));
            _mm512_store_si512(x.qp + (size_t)dp * RP + r, pf512_pair(a, b));
        }
    const int n_keys = j->start + u->t1;
    const int first = j->start + u->t0;
    for (int b = 0; b * B < n_keys; b++) {
        const int n = n_keys - b * B < B ? n_keys - b * B : B;
        for (int t0 = 0; t0 < n; t0 += PF_TILE) {
            const int nt = n - t0 < PF_TILE ? n - t0 : PF_TILE;
            const int pos0 = b * B + t0;
            if (pf_below_window(j, pos0, first)) continue;
            const ptrdiff_t k_off =
                (ptrdiff_t)j->ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head + (ptrdiff_t)t0 * j->s_pos;
            const uint16_t *k = (const uint16_t *)j->kv + k_off, *v = (const uint16_t *)j->kv + k_off + j->s_kv;
            ptrdiff_t stride = j->s_pos;
            if (j->kind >= KVT_I8) { /* quants times their rows' scales, or float16, rounded to bfloat16 as q
                                        * is; rows past nt zero */
                const float *ks = kvt_kind_scaled(j->kind) ? pf_scales(j, u, b, t0) : NULL;
                for (int p = 0; p < PF_TILE; p++) {
                    const __m512 kp = _mm512_set1_ps(p < nt ? (ks ? ks[p] : 1.0f) : 0.0f);
                    const __m512 vp = _mm512_set1_ps(p < nt ? (ks ? ks[j->ss_kv + p] : 1.0f) : 0.0f);
                    for (int d = 0; d < D; d += 16) {
                        const ptrdiff_t at = k_off + (ptrdiff_t)p * j->s_pos + d;
                        __m512 kx = _mm512_setzero_ps(), vx = _mm512_setzero_ps();
                        if (p < nt) {
                            kx = pf512_wide(j, j->kv, at);
                            vx = pf512_wide(j, j->kv, at + j->s_kv);
                        }
                        _mm256_storeu_si256((__m256i *)(x.kb + (size_t)p * D + d),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(kx, kp)));
                        _mm256_storeu_si256((__m256i *)(x.vb + (size_t)p * D + d),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(vx, vp)));
                    }
                }
                k = x.kb;
                v = x.vb;
                stride = D;
            } else if (nt < PF_TILE) { /* copy the live rows, zero the rest: masked below, and 0 * 0 in the sums */
                memset(x.kb, 0, sizeof(uint16_t) * 2 * PF_TILE * (size_t)D);
                for (int p = 0; p < nt; p++) {
                    memcpy(x.kb + (size_t)p * D, k + p * stride, sizeof(uint16_t) * (size_t)D);
                    memcpy(x.vb + (size_t)p * D, v + p * stride, sizeof(uint16_t) * (size_t)D);
                }
                k = x.kb;
                v = x.vb;
                stride = D;
            }
            for (int pr = 0; pr < PF_TILE / 2; pr++) /* V rows 2pr, 2pr + 1 interleaved */
                for (int d = 0; d < D; d += 16) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(v + 2 * pr * stride + d));
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(v + (2 * pr + 1) * stride + d));
                    _mm512_storeu_si512(x.vp + (size_t)pr * D + d, pf512_pair(a, c));
                }
            for (int r = 0; r < RP; r += PF_PANEL_BF16)
                for (int p = 0; p < PF_TILE; p += 8)
                    pf512_scores(x.qp + r, RP, k + p * stride, stride, D, w.s + (size_t)p * RP + r);
            pf512_softmax(&w, pos0, nt, pf_masked(j, u, pos0, nt), j->window);
            for (int pr = 0; pr < PF_TILE / 2; pr++) /* the weights of positions 2pr, 2pr + 1, rounded */
                for (int r = 0; r < RP; r += 16) {
                    const __m256i a = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(w.s + (size_t)(2 * pr) * RP + r));
                    const __m256i c = (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(w.s + (size_t)(2 * pr + 1) * RP + r));
                    _mm512_store_si512(x.pp + (size_t)pr * RP + r, pf512_pair(a, c));
                }
            for (int r = 0; r < RP; r += PF_PANEL_BF16)
                for (int d = 0; d < D; d += 8)
                    pf512_values(w.ot + (size_t)d * RP + r, RP, x.pp + r, x.vp + d, D, w.c + r);
        }
    }
    pf_end(j, u, &w);
}
#endif

/* -- the call ---------------------------------------------------------------------- */

typedef struct {
    const char *name; /* first: kvt_impl_names reads it */
    void (*fn)(const pf_job_t *, const pf_unit_t *, float *);
} pf_impl_t;

/* The builds this CPU runs, best first; probed once (the engine calls once per layer). */
static pf_impl_t pf_impls[3];
static int pf_n_impls = 0;
static pthread_once_t pf_once = PTHREAD_ONCE_INIT;

static void pf_pick(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        pf_impls[pf_n_impls++] = (pf_impl_t){"avx512bf16", pf_unit_bf16};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        pf_impls[pf_n_impls++] = (pf_impl_t){"avx2", pf_unit_avx2};
#endif
    pf_impls[pf_n_impls++] = (pf_impl_t){"base", pf_unit_base};
}

static void pf_work(void *ctx) {
    pf_job_t *j = ctx;
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 64, j->scratch_floats * sizeof(float)) != 0)
        return; /* the others claim its share; the caller reports it if nobody could */
    size_t i;
    while ((i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->n_units) j->unit_fn(j, &j->units[i], buf);
    free(buf);
}

/* Units of up to PF_UNIT_ROWS query rows per KV head, the last tokens first: they see the
 * most positions, and dynamic claiming evens out the rest. Depends on the shapes alone. */
static size_t pf_plan(pf_job_t *j) {
    const int per = PF_UNIT_ROWS / j->group;
    const int chunks = (j->tokens + per - 1) / per;
    size_t n = 0;
    for (int c = chunks - 1; c >= 0; c--)
        for (int h = 0; h < j->kv_heads; h++) {
            if (j->units != NULL) {
                const int t0 = (int)((int64_t)j->tokens * c / chunks), t1 = (int)((int64_t)j->tokens * (c + 1) / chunks);
                j->units[n] = (pf_unit_t){h, t0, t1};
            }
            n++;
        }
    return n;
}

PyObject *kvt_py_paged_prefill_attention(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *names[] = {"kv",     "strides",  "num_blocks", "bf16",     "q",          "out",   "ids",
                            "n_ids",  "start",    "tokens",     "kv_heads", "group",      "head_dim",
                            "block_size", "scale", "threads",   "impl",     "window", "int8_scales", "fp8", "f16", NULL};
    unsigned long long kv, q, out, ids;
    Py_ssize_t sb, skv, sh, sp, num_blocks, n_ids;
    Py_ssize_t int8_scales = -1;
    int bf16, threads, fp8 = 0, f16 = 0;
    const char *impl = NULL;
    pf_job_t j = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K(nnnn)npKKKniiiiiifi|zinpp:paged_prefill_attention", names, &kv, &sb,
                                     &skv, &sh, &sp, &num_blocks, &bf16, &q, &out, &ids, &n_ids, &j.start, &j.tokens,
                                     &j.kv_heads, &j.group, &j.dim, &j.block, &j.scale, &threads, &impl, &j.window,
                                     &int8_scales, &fp8, &f16))
        return NULL;
    pthread_once(&pf_once, pf_pick);
    j.unit_fn = pf_impls[0].fn;
    if (impl != NULL) {
        j.unit_fn = NULL;
        for (int i = 0; i < pf_n_impls; i++)
            if (strcmp(pf_impls[i].name, impl) == 0) j.unit_fn = pf_impls[i].fn;
        if (j.unit_fn == NULL) return PyErr_Format(PyExc_ValueError, "paged_prefill_attention: no %s build on this CPU", impl);
    }
    const char *bad = NULL;
    if (j.start < 0 || j.tokens <= 0) bad = "start >= 0 and tokens > 0";
    else if (j.window < 0) bad = "window >= 0 (0: none)";
    else if (j.kv_heads <= 0 || j.group <= 0 || j.group > PF_MAX_GROUP) bad = "kv_heads > 0 and group 1..16";
    else if (j.dim <= 0 || j.dim > PF_MAX_DIM || j.dim % 4) bad = "head_dim must be a multiple of 4, <= 256";
    else if (j.block <= 0 || j.block > PF_MAX_BLOCK) bad = "block_size must be 1..256";
    else if (sp != j.dim) bad = "a block's rows must be contiguous (position stride == head_dim)";
    else if (threads <= 0 || threads > PF_MAX_THREADS) bad = "threads must be 1..16";
    else if (((int64_t)j.start + j.tokens + j.block - 1) / j.block > n_ids) bad = "fewer blocks than start + tokens need";
    if (bad != NULL) return PyErr_Format(PyExc_ValueError, "paged_prefill_attention: %s", bad);
    j.ids = (const int32_t *)(uintptr_t)ids;
    for (Py_ssize_t b = 0; b < n_ids; b++)
        if (j.ids[b] < 0 || j.ids[b] >= num_blocks)
            return PyErr_Format(PyExc_ValueError, "paged_prefill_attention: a block id is outside the pool");
    j.kv = (const char *)(uintptr_t)kv;
    j.s_block = sb;
    j.s_kv = skv;
    j.s_head = sh;
    j.s_pos = sp;
    j.bf16 = bf16;
    bad = kvt_pool_kind(j.kv, sb, skv, sh, j.dim, bf16, int8_scales, fp8, f16, &j.kind, &j.scales, &j.ss_block,
                        &j.ss_kv, &j.ss_head);
    if (bad != NULL) return PyErr_Format(PyExc_ValueError, "paged_prefill_attention: %s", bad);
    j.q = (const char *)(uintptr_t)q;
    j.out = (char *)(uintptr_t)out;
    j.scratch_floats = pf_scratch_floats(j.group, j.dim);
    j.n_units = pf_plan(&j);
    if ((j.units = PyMem_RawMalloc(j.n_units * sizeof(pf_unit_t))) == NULL) return PyErr_NoMemory();
    pf_plan(&j);
    Py_BEGIN_ALLOW_THREADS kvt_team_run(pf_work, &j, j.n_units > 1 ? threads : 1);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(j.units);
    if (j.next < j.n_units) return PyErr_NoMemory(); /* no thread had scratch: units were left */
    Py_RETURN_NONE;
}

PyObject *kvt_py_paged_prefill_attention_impls(PyObject *mod, PyObject *arg) {
    (void)mod;
    (void)arg;
    pthread_once(&pf_once, pf_pick);
    return kvt_impl_names(pf_impls, sizeof pf_impls[0], pf_n_impls);
}
