/* ------------------------------------------------------------------------- */
/* paged_decode_attention: the engine's decode attention, read in place       */
/* ------------------------------------------------------------------------- */

/*
 * One new token per sequence attends to its cached positions, which lie in the
 * sequence's pool blocks (a layer's pool is [blocks, 2 (K, V), kv_heads, block, dim]).
 * Each (sequence, KV head) pair walks its blocks straight in the pool: the scores of
 * the group's query heads against one block, an online (streaming) softmax over the
 * blocks in float32, and V accumulated under it. Nothing is gathered: at context
 * 2,048 the K/V of one layer are megabytes, so what decode costs is reading them
 * once, not copying them first.
 *
 * Work is cut into units of (sequence, KV head, run of blocks) so that even a single
 * sequence with three KV heads keeps two threads busy; each unit leaves an
 * unnormalised partial (its running max, sum and V accumulator per query head) and
 * the calling thread merges a pair's partials at the end, as flash-decoding does.
 * Units are claimed from a shared counter, so a worker that wakes late just claims
 * fewer of them.
 *
 * A sliding-window layer passes its window: a sequence's units then start at the block
 * holding its window's first position, and that block is read from that row on.
 *
 * A unit runs one of three builds, chosen once with __builtin_cpu_supports: AVX-512
 * intrinsics (attn512_body, decode_attention_avx512.c); AVX2+FMA intrinsics
 * (attn256_body, decode_attention_avx2.c: the same plan at 8 lanes); or one portable C
 * body written for the auto-vectoriser (below: partial sums as wide as a vector, so a
 * dot product needs no reassociation; exp as a polynomial, since
 * libm's expf does not vectorise without -ffast-math), compiled for the base ISA (SSE2
 * on x86-64, NEON on aarch64). Nothing needs -march: the build runs on any x86-64 or
 * aarch64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "decode_attention.h"
#include "float_math.h"
#include "kernels.h"
#include "team.h"

#define ATTN_MAX_THREADS 16
/* A unit covers at least this many blocks: below it, setting up and merging a
 * partial costs more than the blocks it spreads. */
#define ATTN_MIN_UNIT_BLOCKS 8
/* Each sequence is cut into about this many runs of blocks (times the KV heads),
 * enough for dynamic claiming to even out two threads. A sequence's cut depends on
 * its own length alone, never on the thread count nor on the other sequences of the
 * call, so its result is the same bits whoever computes it and whatever it is
 * batched with (prompt lookup verifies drafts as extra rows of a decode step, and
 * must get the logits a step of its own would). */
#define ATTN_TARGET_RUNS 8

/* Row p of a K or V tile as float32: the pool itself for float32, else converted into buf
 * (8-bit quants as they are: the caller applies the row's scale). kv: a KVT_* kind. */
static inline __attribute__((always_inline)) const float *attn_row(const char *base, ptrdiff_t off, int kv, int dim,
                                                                   float *buf) {
    if (kv == 2) {
        const int8_t *x = (const int8_t *)base + off;
        for (int d = 0; d < dim; d++) buf[d] = (float)x[d];
        return buf;
    }
    if (kv == KVT_E4M3) {
        const uint8_t *x = (const uint8_t *)base + off;
        for (int d = 0; d < dim; d++) buf[d] = kvt_e4m3_to_f32(x[d]);
        return buf;
    }
    if (kv == KVT_F16) {
        const uint16_t *x = (const uint16_t *)base + off;
        for (int d = 0; d < dim; d++) buf[d] = kvt_f16_to_f32(x[d]);
        return buf;
    }
    if (!kv) return (const float *)base + off;
    const uint16_t *h = (const uint16_t *)base + off;
    for (int d = 0; d < dim; d++) buf[d] = kvt_bf16_to_f32(h[d]);
    return buf;
}

/* A dot product in `lanes` partial sums (as wide as the variant's vectors), so that it
 * vectorises without reassociating a float sum; dim is a multiple of 16. */
static inline __attribute__((always_inline)) float attn_dot(const float *a, const float *b, int dim, const int lanes) {
    float lane[ATTN_LANES] = {0};
    for (int d = 0; d < dim; d += lanes)
        for (int l = 0; l < lanes; l++) lane[l] += a[d + l] * b[d + l];
    float sum = 0.0f;
    for (int l = 0; l < lanes; l++) sum += lane[l];
    return sum;
}

/*
 * One unit: the group's query heads against blocks [b0, b1) of one sequence and KV
 * head, into part = m[G], l[G], acc[G * D] (acc not yet divided by l).
 */
static inline __attribute__((always_inline)) void attn_unit_body(const attn_job_t *j, const attn_unit_t *u,
                                                                 float *part, const int bf16, const int kv,
                                                                 const int lanes) {
    const int G = j->group, D = j->dim, B = j->block;
    const int len = j->lengths[u->seq];
    const int first = attn_first(j, u->seq);
    const int32_t *ids = j->tables + j->starts[u->seq];
    /* Local, not in part: the compiler then knows no store to them changes K or V. */
    float m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP], acc[ATTN_MAX_GROUP * ATTN_MAX_DIM];
    float q[ATTN_MAX_GROUP * ATTN_MAX_DIM];
    float s[ATTN_MAX_GROUP][ATTN_MAX_BLOCK + ATTN_LANES];
    float kbuf[ATTN_MAX_DIM], vbuf[ATTN_MAX_DIM];
    const int BP = (B + ATTN_LANES - 1) / ATTN_LANES * ATTN_LANES;

    const size_t q_row = (size_t)(u->seq * j->kv_heads + u->head) * G * D; /* query heads head*G .. head*G+G-1 */
    for (int i = 0; i < G * D; i++)
        q[i] = (bf16 ? kvt_bf16_to_f32(((const uint16_t *)j->q)[q_row + i]) : ((const float *)j->q)[q_row + i]) * j->scale;
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
        const int esize = kvt_kind_bytes(kv);
        if (b + 1 < u->b1) { /* the next block is anywhere in the pool: start fetching it */
            const char *nk = j->kv + ((ptrdiff_t)ids[b + 1] * j->s_block + (ptrdiff_t)u->head * j->s_head) * esize;
            __builtin_prefetch(nk);
            __builtin_prefetch(nk + j->s_kv * esize);
        }
        const float *ks = kvt_kind_scaled(kv) ? attn_scales(j, ids[b], u->head, p0) : NULL, *vs = ks ? ks + j->ss_kv : NULL;
        for (int p = 0; p < n; p++) {
            const float *k = attn_row(j->kv, k_off + p * j->s_pos, kv, D, kbuf);
            for (int g = 0; g < G; g++) s[g][p] = ks ? attn_dot(q + g * D, k, D, lanes) * ks[p] : attn_dot(q + g * D, k, D, lanes);
        }
        for (int g = 0; g < G; g++) {
            float *sg = s[g];
            for (int p = n; p < BP; p++) sg[p] = -INFINITY;
            float lane[ATTN_LANES];
            for (int i = 0; i < ATTN_LANES; i++) lane[i] = sg[i];
            for (int p = ATTN_LANES; p < BP; p += ATTN_LANES)
                for (int i = 0; i < ATTN_LANES; i++) lane[i] = sg[p + i] > lane[i] ? sg[p + i] : lane[i];
            float mx = m[g];
            for (int i = 0; i < ATTN_LANES; i++) mx = lane[i] > mx ? lane[i] : mx;
            float sum = 0.0f;
            for (int p = 0; p < BP; p++) sg[p] = kvt_exp(sg[p] - mx);
            for (int p = n; p < BP; p++) sg[p] = 0.0f;
            for (int p = 0; p < n; p++) sum += sg[p];
            if (mx > m[g]) {
                const float c = kvt_exp(m[g] - mx);
                float *a = acc + g * D;
                for (int d = 0; d < D; d++) a[d] *= c;
                l[g] *= c;
                m[g] = mx;
            }
            l[g] += sum;
        }
        for (int p = 0; p < n; p++) {
            const float *v = attn_row(j->kv, v_off + p * j->s_pos, kv, D, vbuf);
            for (int g = 0; g < G; g++) {
                const float w = vs ? s[g][p] * vs[p] : s[g][p];
                float *a = acc + g * D;
                for (int d = 0; d < D; d++) a[d] += w * v[d];
            }
        }
    }
    memcpy(part, m, sizeof(float) * (size_t)G);
    memcpy(part + G, l, sizeof(float) * (size_t)G);
    memcpy(part + 2 * G, acc, sizeof(float) * (size_t)G * D);
}

#define ATTN_VARIANT(name, attr, lanes)                                                             \
    attr static void name(const attn_job_t *j, const attn_unit_t *u, float *part) {                \
        if (j->kind == KVT_E4M3) attn_unit_body(j, u, part, j->bf16, KVT_E4M3, lanes);              \
        else if (j->kind == KVT_I8) attn_unit_body(j, u, part, j->bf16, KVT_I8, lanes);             \
        else if (j->kind == KVT_F16) attn_unit_body(j, u, part, j->bf16, KVT_F16, lanes);           \
        else if (j->kind == KVT_BF16) attn_unit_body(j, u, part, 1, KVT_BF16, lanes);               \
        else attn_unit_body(j, u, part, 0, 0, lanes);                                               \
    }

ATTN_VARIANT(attn_unit_base, , 4)

typedef void (*attn_unit_fn)(const attn_job_t *, const attn_unit_t *, float *);

/* The builds this CPU can run, best first; the first is the one paged_decode_attention uses. */
typedef struct {
    const char *name; /* first: kvt_impl_names reads it */
    attn_unit_fn fn;
} attn_impl_t;
static attn_impl_t attn_impls[3];
static int attn_n_impls = 0;

static void attn_pick(void) {
#ifdef KVT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) attn_impls[attn_n_impls++] = (attn_impl_t){"avx512", kvt_attn_unit_avx512};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        attn_impls[attn_n_impls++] = (attn_impl_t){"avx2", kvt_attn_unit_avx2};
#endif
    attn_impls[attn_n_impls++] = (attn_impl_t){"base", attn_unit_base};
}

static pthread_once_t attn_once = PTHREAD_ONCE_INIT;

static void attn_claim_all(attn_job_t *j, attn_unit_fn fn) {
    size_t i;
    while ((i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->n_units)
        fn(j, &j->units[i], j->parts + i * j->part_floats);
}

/* Merge each (sequence, KV head)'s partials (units of one pair are adjacent) into out. */
static void attn_merge(const attn_job_t *j) {
    const int G = j->group, D = j->dim;
    float o[ATTN_MAX_DIM];
    size_t i = 0;
    while (i < j->n_units) {
        size_t e = i + 1;
        while (e < j->n_units && j->units[e].seq == j->units[i].seq && j->units[e].head == j->units[i].head) e++;
        for (int g = 0; g < G; g++) {
            float mx = -INFINITY, total = 0.0f;
            for (size_t k = i; k < e; k++) {
                const float mk = j->parts[k * j->part_floats + g];
                mx = mk > mx ? mk : mx;
            }
            memset(o, 0, sizeof(float) * (size_t)D);
            for (size_t k = i; k < e; k++) {
                const float *part = j->parts + k * j->part_floats;
                const float c = part[G + g] > 0.0f ? kvt_exp(part[g] - mx) : 0.0f; /* 0: a unit with no positions */
                total += c * part[G + g];
                const float *a = part + 2 * G + g * D;
                for (int d = 0; d < D; d++) o[d] += c * a[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            const size_t row = ((size_t)(j->units[i].seq * j->kv_heads + j->units[i].head) * G + g) * D;
            for (int d = 0; d < D; d++) {
                if (j->bf16) ((uint16_t *)j->out)[row + d] = kvt_f32_to_bf16(o[d] * inv);
                else ((float *)j->out)[row + d] = o[d] * inv;
            }
        }
        i = e;
    }
}

typedef struct {
    attn_job_t *job;
    attn_unit_fn fn;
} attn_call_t;

static void attn_work(void *ctx) {
    attn_call_t *c = ctx;
    attn_claim_all(c->job, c->fn);
}

/* Runs without the GIL; returns once every unit is done and merged. */
static void attn_run(attn_job_t *j, attn_unit_fn fn, int threads) {
    attn_call_t call = {j, fn};
    kvt_team_run(attn_work, &call, j->n_units > 1 ? threads : 1);
    attn_merge(j);
}

/* Checks the shapes and the block tables (every id a pool block, enough of them for
 * each length) before anything reads the pool; NULL and a Python error if not. */
static const char *attn_check(const attn_job_t *j, Py_ssize_t num_blocks, int threads) {
    if (j->num_seqs < 0 || j->kv_heads <= 0) return "num_seqs >= 0 and kv_heads > 0";
    if (j->group <= 0 || j->group > ATTN_MAX_GROUP) return "group (query heads per KV head) must be 1..16";
    if (j->dim <= 0 || j->dim > ATTN_MAX_DIM || j->dim % ATTN_LANES) return "head_dim must be a multiple of 16, <= 256";
    if (j->block <= 0 || j->block > ATTN_MAX_BLOCK) return "block_size must be 1..256";
    if (j->s_pos != j->dim) return "a block's rows must be contiguous (position stride == head_dim)";
    if (threads <= 0 || threads > ATTN_MAX_THREADS) return "threads must be 1..16";
    if (j->window < 0) return "window must be >= 0 (0: none)";
    if (j->num_seqs > 0 && j->starts[0] != 0) return "starts[0] must be 0";
    for (int s = 0; s < j->num_seqs; s++) {
        const int32_t len = j->lengths[s], have = j->starts[s + 1] - j->starts[s];
        if (len < 0 || have < 0) return "lengths and block counts must not be negative";
        if (((int64_t)len + j->block - 1) / j->block > have) return "a sequence has fewer blocks than its length needs";
        for (int32_t b = j->starts[s]; b < j->starts[s + 1]; b++)
            if (j->tables[b] < 0 || j->tables[b] >= num_blocks) return "a block id is outside the pool";
    }
    return NULL;
}

/* Units of blocks, (sequence, head) pairs adjacent; with j->units NULL, only counts them. */
static size_t attn_plan_units(attn_job_t *j) {
    size_t n = 0;
    for (int s = 0; s < j->num_seqs; s++) {
        const int fb = attn_first(j, s) / j->block, nb = (j->lengths[s] + j->block - 1) / j->block - fb;
        int64_t per = (nb + ATTN_TARGET_RUNS - 1) / ATTN_TARGET_RUNS;
        per = per < ATTN_MIN_UNIT_BLOCKS ? ATTN_MIN_UNIT_BLOCKS : per;
        const int cuts = nb == 0 ? 1 : (int)((nb + per - 1) / per);
        for (int h = 0; h < j->kv_heads; h++)
            for (int c = 0; c < cuts; c++) {
                if (j->units != NULL) {
                    attn_unit_t *u = &j->units[n];
                    u->seq = s;
                    u->head = h;
                    u->b0 = fb + (int)((int64_t)nb * c / cuts);
                    u->b1 = fb + (int)((int64_t)nb * (c + 1) / cuts);
                }
                n++;
            }
    }
    return n;
}

static PyObject *attn_entry(PyObject *args, PyObject *kw, const char *impl) {
    static char *kwlist[] = {"kv",     "strides", "num_blocks", "bf16",      "q",          "out",   "tables",
                             "starts", "lengths", "num_seqs",   "kv_heads",  "group",      "head_dim",
                             "block_size", "scale", "threads", "window", "int8_scales", "fp8", "f16", NULL};
    unsigned long long kv, q, out, tables, starts, lengths;
    Py_ssize_t sb, skv, sh, sp, num_blocks;
    Py_ssize_t int8_scales = -1;
    int bf16, threads, fp8 = 0, f16 = 0;
    attn_job_t j = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K(nnnn)npKKKKKiiiiifi|$inpp:paged_decode_attention", kwlist, &kv, &sb, &skv,
                                     &sh, &sp, &num_blocks, &bf16, &q, &out, &tables, &starts, &lengths, &j.num_seqs,
                                     &j.kv_heads, &j.group, &j.dim, &j.block, &j.scale, &threads, &j.window,
                                     &int8_scales, &fp8, &f16))
        return NULL;
    pthread_once(&attn_once, attn_pick);
    attn_unit_fn fn = attn_impls[0].fn;
    if (impl != NULL) {
        fn = NULL;
        for (int i = 0; i < attn_n_impls; i++)
            if (strcmp(attn_impls[i].name, impl) == 0) fn = attn_impls[i].fn;
        if (fn == NULL) return PyErr_Format(PyExc_ValueError, "paged_decode_attention: this CPU cannot run %s", impl);
    }
    j.kv = (const char *)(uintptr_t)kv;
    j.s_block = sb;
    j.s_kv = skv;
    j.s_head = sh;
    j.s_pos = sp;
    j.bf16 = bf16;
    const char *bad_kind = kvt_pool_kind(j.kv, sb, skv, sh, j.dim, bf16, int8_scales, fp8, f16, &j.kind, &j.scales,
                                         &j.ss_block, &j.ss_kv, &j.ss_head);
    if (bad_kind != NULL) return PyErr_Format(PyExc_ValueError, "paged_decode_attention: %s", bad_kind);
    j.q = (const char *)(uintptr_t)q;
    j.out = (char *)(uintptr_t)out;
    j.tables = (const int32_t *)(uintptr_t)tables;
    j.starts = (const int32_t *)(uintptr_t)starts;
    j.lengths = (const int32_t *)(uintptr_t)lengths;
    const char *bad = attn_check(&j, num_blocks, threads);
    if (bad != NULL) return PyErr_Format(PyExc_ValueError, "paged_decode_attention: %s", bad);
    if (j.num_seqs == 0) Py_RETURN_NONE;
    j.n_units = attn_plan_units(&j);
    j.part_floats = (size_t)j.group * (2 + (size_t)j.dim);
    j.units = PyMem_RawMalloc(j.n_units * sizeof(attn_unit_t));
    j.parts = PyMem_RawMalloc(j.n_units * j.part_floats * sizeof(float));
    if (j.units == NULL || j.parts == NULL) {
        PyMem_RawFree(j.units);
        PyMem_RawFree(j.parts);
        return PyErr_NoMemory();
    }
    attn_plan_units(&j);
    Py_BEGIN_ALLOW_THREADS attn_run(&j, fn, threads);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(j.units);
    PyMem_RawFree(j.parts);
    Py_RETURN_NONE;
}

PyObject *kvt_py_paged_decode_attention(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return attn_entry(args, kw, NULL);
}

/* _paged_decode_attention_using(impl, *args): one named build, for tests. */
PyObject *kvt_py_paged_decode_attention_using(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    const char *impl;
    if (PyTuple_GET_SIZE(args) < 1 || (impl = PyUnicode_AsUTF8(PyTuple_GET_ITEM(args, 0))) == NULL)
        return PyErr_Format(PyExc_TypeError, "_paged_decode_attention_using(impl: str, *args)");
    PyObject *rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
    if (rest == NULL) return NULL;
    PyObject *out = attn_entry(rest, kw, impl);
    Py_DECREF(rest);
    return out;
}

PyObject *kvt_py_paged_decode_attention_impls(PyObject *mod, PyObject *arg) {
    (void)mod;
    (void)arg;
    pthread_once(&attn_once, attn_pick);
    return kvt_impl_names(attn_impls, sizeof attn_impls[0], attn_n_impls);
}
