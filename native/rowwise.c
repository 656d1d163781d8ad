/*
 * rowwise: a decoder layer's element-wise steps, each one pass over its rows.
 *
 * Around its matrix products a Llama layer does small per-row work: the residual add
 * and the RMSNorm after it, RoPE on the new queries and keys and the write of K/V into
 * the paged pool, SwiGLU's silu(gate) * up. In torch each is five to ten operator calls,
 * each a pass over the rows plus a dispatch; on a prefill of a few dozen tokens over a
 * cached prefix (an agent's next turn) and on every decode step those calls, not the
 * arithmetic, are the cost. Here each step is one call:
 *
 *   rms_norm   x += delta (optional), out = w * norm(x); or, as torch's own rms_norm
 *              (per-head Q/K norms), out = norm(x) * w rounded once
 *   rope_kv    q -> q_out and k in place rotated (rotate-half), k and v into their slots
 *   silu_mul   out = silu(gate) * up
 *
 * They round as torch's own float32 / bfloat16 operators do, step by step (a bfloat16
 * tensor's every operator result is rounded to bfloat16), and differ from them only in
 * the summation order of RMSNorm's mean and in exp's last bits (kvtier/engine/rowwise.py
 * keeps the torch formulas the tests compare with). Every row is computed alone, in a
 * fixed order, so a row's result never depends on the other rows of a call or on the
 * thread count: a token's K/V are the same bytes whether its prefill ran in one chunk
 * or several, the law cache reuse rests on.
 *
 * Builds: the same C compiled for AVX-512 (with BW), AVX2 + FMA and the portable
 * baseline, picked once per process; the compiler vectorises the row loops.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "float_math.h"
#include "kernels.h"
#include "team.h"

#if defined(__x86_64__) || defined(__i386__)
#define RW_X86 1
#define RW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define RW_AVX2 __attribute__((target("avx2,fma")))
#endif

#define RW_INLINE static inline __attribute__((always_inline))
#define RW_LANES 16       /* RMSNorm's partial sums: one vector of floats wide */
#define RW_MAX_COLS 16384 /* a row's float32 scratch lives on the stack */
#define RW_ROWS_PER_UNIT 8

/* -- loads and stores: float32, or bfloat16 rounded as torch rounds -------------------- */
RW_INLINE float rw_load(const void *p, int64_t i, const int bf16) {
    return bf16 ? kvt_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The value a tensor of the dtype holds for f: f itself in float32, rounded in bfloat16. */
RW_INLINE float rw_round(float f, const int bf16) { return bf16 ? kvt_bf16_to_f32(kvt_f32_to_bf16(f)) : f; }

RW_INLINE void rw_store(void *p, int64_t i, float f, const int bf16) {
    if (bf16) ((uint16_t *)p)[i] = kvt_f32_to_bf16(f);
    else ((float *)p)[i] = f;
}

/* -- RMSNorm with the residual add before it ------------------------------------------ */
typedef struct {
    char *x;           /* rows x cols, updated in place when delta is given */
    const char *delta; /* rows x cols, or NULL */
    const char *w;     /* cols */
    char *out;         /* rows x cols */
    int64_t rows, cols;
    float eps;
    int bf16;
    int round_once; /* torch.rms_norm's order: the weight applied in float32, one rounding at the end */
} norm_job_t;

/* torch: x = x + delta; xf = x.float(); xf * rsqrt(mean(xf^2) + eps), cast to the dtype;
 * times w. The squares are summed in RW_LANES running sums, then those in order. */
RW_INLINE void norm_row(const norm_job_t *j, int64_t r, const int bf16) {
    const int64_t n = j->cols, esz = bf16 ? 2 : 4;
    char *x = j->x + r * n * esz;
    const char *d = j->delta ? j->delta + r * n * esz : NULL;
    float xs[RW_MAX_COLS];
    for (int64_t c = 0; c < n; c++) xs[c] = rw_load(x, c, bf16);
    if (d) {
        for (int64_t c = 0; c < n; c++) xs[c] = rw_round(xs[c] + rw_load(d, c, bf16), bf16);
        for (int64_t c = 0; c < n; c++) rw_store(x, c, xs[c], bf16);
    }
    float acc[RW_LANES] = {0};
    int64_t c = 0;
    for (; c + RW_LANES <= n; c += RW_LANES)
        for (int k = 0; k < RW_LANES; k++) acc[k] += xs[c + k] * xs[c + k];
    for (int k = 0; c < n; c++, k++) acc[k] += xs[c] * xs[c];
    float ss = 0.0f;
    for (int k = 0; k < RW_LANES; k++) ss += acc[k];
    const float inv = 1.0f / sqrtf(ss / (float)n + j->eps);
    char *out = j->out + r * n * esz;
    if (j->round_once)
        for (c = 0; c < n; c++) rw_store(out, c, xs[c] * inv * rw_load(j->w, c, bf16), bf16);
    else
        for (c = 0; c < n; c++) rw_store(out, c, rw_load(j->w, c, bf16) * rw_round(xs[c] * inv, bf16), bf16);
}

/* -- RoPE and the K/V write --------------------------------------------------------- */
typedef struct {
    char *qkv;             /* rows x row_elems: q heads, then k heads, then v heads */
    int64_t rows, row_elems;
    int q_heads, kv_heads, head_dim;
    const char *cos, *sin; /* [positions, head_dim] in the dtype, rotate-half order */
    const int64_t *pos;    /* rows */
    char *q_out;           /* rows x q_heads x head_dim */
    char *kv;              /* the pool layer; NULL: no write */
    int64_t s_block, s_kv, s_head, s_pos; /* its strides, elements */
    const int64_t *blocks, *offsets;       /* rows: each token's slot */
    int bf16;
    int64_t int8_scales; /* >= 0: an 8-bit pool (strides in bytes), each block's scales this far into its range */
    int fp8;             /* its quants are float8 e4m3, else int8 */
    int f16;             /* a float16 pool (strides in elements): k and v rounded to float16 as torch rounds */
} rope_job_t;

/* torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype. */
RW_INLINE void rope_head(const char *src, char *dst, const char *cs, const char *sn, int dim, const int bf16) {
    const int half = dim / 2;
    float x[512], y[512];
    for (int i = 0; i < dim; i++) x[i] = rw_load(src, i, bf16);
    for (int i = 0; i < half; i++) {
        y[i] = rw_round(rw_round(x[i] * rw_load(cs, i, bf16), bf16) + rw_round(-x[i + half] * rw_load(sn, i, bf16), bf16), bf16);
        y[i + half] = rw_round(rw_round(x[i + half] * rw_load(cs, i + half, bf16), bf16) +
                                   rw_round(x[i] * rw_load(sn, i + half, bf16), bf16),
                               bf16);
    }
    for (int i = 0; i < dim; i++) rw_store(dst, i, y[i], bf16);
}

/* One head's row as 8-bit quants and its scale, as kvtier.layout.quantize_rows rounds them: scale = max|x| / top
 * (127 for int8, 448 for e4m3), quants = x / scale rounded to nearest (ties to even; to an int8, or to an e4m3),
 * each step in float32; a zero row gets scale 0. */
RW_INLINE void rope_quantize(const char *src, uint8_t *dst, float *scale, int dim, const int bf16, const int fp8) {
    float amax = 0.0f;
    for (int i = 0; i < dim; i++) {
        const float a = fabsf(rw_load(src, i, bf16));
        amax = a > amax ? a : amax;
    }
    const float top = fp8 ? 448.0f : 127.0f;
    const float s = amax / top, safe = s > 0.0f ? s : 1.0f;
    for (int i = 0; i < dim; i++) {
        float q = rw_load(src, i, bf16) / safe;
        if (!fp8) q = nearbyintf(q);
        q = q > top ? top : q < -top ? -top : q;
        dst[i] = fp8 ? kvt_f32_to_e4m3(q) : (uint8_t)(int8_t)q;
    }
    *scale = s;
}

RW_INLINE void rope_row(const rope_job_t *j, int64_t r, const int bf16) {
    const int64_t esz = bf16 ? 2 : 4, dim = j->head_dim;
    char *row = j->qkv + r * j->row_elems * esz;
    const char *cs = j->cos + j->pos[r] * dim * esz, *sn = j->sin + j->pos[r] * dim * esz;
    for (int h = 0; h < j->q_heads; h++)
        rope_head(row + h * dim * esz, j->q_out + (r * j->q_heads + h) * dim * esz, cs, sn, (int)dim, bf16);
    char *k = row + (int64_t)j->q_heads * dim * esz;
    const char *v = k + (int64_t)j->kv_heads * dim * esz;
    for (int h = 0; h < j->kv_heads; h++) rope_head(k + h * dim * esz, k + h * dim * esz, cs, sn, (int)dim, bf16);
    if (j->kv == NULL) return;
    if (j->int8_scales >= 0) { /* strides in bytes; scales [K|V][heads][block] after the quants */
        char *base = j->kv + j->blocks[r] * j->s_block;
        uint8_t *slot = (uint8_t *)base + j->offsets[r] * j->s_pos;
        float *scales = (float *)(base + j->int8_scales) + j->offsets[r];
        const int64_t sc_kv = j->s_kv / dim, sc_head = j->s_head / dim;
        for (int h = 0; h < j->kv_heads; h++) {
            rope_quantize(k + h * dim * esz, slot + h * j->s_head, scales + h * sc_head, (int)dim, bf16, j->fp8);
            rope_quantize(v + h * dim * esz, slot + j->s_kv + h * j->s_head, scales + sc_kv + h * sc_head, (int)dim,
                          bf16, j->fp8);
        }
        return;
    }
    if (j->f16) {
        uint16_t *slot = (uint16_t *)j->kv + j->blocks[r] * j->s_block + j->offsets[r] * j->s_pos;
        for (int h = 0; h < j->kv_heads; h++)
            for (int64_t i = 0; i < dim; i++) {
                slot[h * j->s_head + i] = kvt_f32_to_f16(rw_load(k + h * dim * esz, i, bf16));
                slot[j->s_kv + h * j->s_head + i] = kvt_f32_to_f16(rw_load(v + h * dim * esz, i, bf16));
            }
        return;
    }
    char *slot = j->kv + (j->blocks[r] * j->s_block + j->offsets[r] * j->s_pos) * esz;
    for (int h = 0; h < j->kv_heads; h++) {
        memcpy(slot + h * j->s_head * esz, k + h * dim * esz, (size_t)(dim * esz));
        memcpy(slot + (j->s_kv + h * j->s_head) * esz, v + h * dim * esz, (size_t)(dim * esz));
    }
}

/* -- SwiGLU's gate ----------------------------------------------------------------- */
typedef struct {
    const char *gate_up; /* rows x 2 * inter: gate, then up */
    char *out;           /* rows x inter */
    int64_t rows, inter;
    int bf16;
} silu_job_t;

/* torch: silu(gate) rounded to the dtype, times up. sigmoid from exp(-|g|) (kvt_exp takes
 * x <= 0): 1 / (1 + e) for g >= 0, e / (1 + e) below. */
RW_INLINE void silu_row(const silu_job_t *j, int64_t r, const int bf16) {
    const int64_t n = j->inter, esz = bf16 ? 2 : 4;
    const char *g = j->gate_up + r * 2 * n * esz, *u = g + n * esz;
    char *out = j->out + r * n * esz;
    for (int64_t c = 0; c < n; c++) {
        const float x = rw_load(g, c, bf16);
        const float e = kvt_exp(-fabsf(x));
        const float sig = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
        rw_store(out, c, rw_round(x * sig, bf16) * rw_load(u, c, bf16), bf16);
    }
}

/* -- builds: each row function for both dtypes, per ISA ---------------------------- */
typedef void (*rows_fn_t)(const void *job, int64_t r0, int64_t r1);

/* One row function over rows [r0, r1), with the dtype a constant inside each loop. */
#define RW_ROWS(NAME, JOB, ROW, TARGET)                                            \
    TARGET static void NAME(const void *job, int64_t r0, int64_t r1) {             \
        const JOB *j = job;                                                        \
        if (j->bf16)                                                               \
            for (int64_t r = r0; r < r1; r++) ROW(j, r, 1);                        \
        else                                                                       \
            for (int64_t r = r0; r < r1; r++) ROW(j, r, 0);                        \
    }

#define RW_BUILD(SUFFIX, TARGET)                                                   \
    RW_ROWS(norm_rows_##SUFFIX, norm_job_t, norm_row, TARGET)                      \
    RW_ROWS(rope_rows_##SUFFIX, rope_job_t, rope_row, TARGET)                      \
    RW_ROWS(silu_rows_##SUFFIX, silu_job_t, silu_row, TARGET)

RW_BUILD(base, )
#ifdef RW_X86
RW_BUILD(avx2, RW_AVX2)
RW_BUILD(avx512, RW_AVX512)
#endif

typedef struct {
    const char *name; /* first: kvt_impl_names reads it */
    rows_fn_t norm, rope, silu;
} rw_impl_t;

/* The builds this CPU runs, best first; probed once. */
static rw_impl_t rw_impls[3];
static int rw_n_impls = 0;
static pthread_once_t rw_once = PTHREAD_ONCE_INIT;

static void rw_pick(void) {
#ifdef RW_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        rw_impls[rw_n_impls++] = (rw_impl_t){"avx512", norm_rows_avx512, rope_rows_avx512, silu_rows_avx512};
    if (avx2) rw_impls[rw_n_impls++] = (rw_impl_t){"avx2", norm_rows_avx2, rope_rows_avx2, silu_rows_avx2};
#endif
    rw_impls[rw_n_impls++] = (rw_impl_t){"base", norm_rows_base, rope_rows_base, silu_rows_base};
}

static const rw_impl_t *rw_find(const char *name) {
    pthread_once(&rw_once, rw_pick);
    if (name == NULL) return &rw_impls[0];
    for (int i = 0; i < rw_n_impls; i++)
        if (strcmp(rw_impls[i].name, name) == 0) return &rw_impls[i];
    PyErr_Format(PyExc_ValueError, "no %s build of the row kernels on this CPU", name);
    return NULL;
}

/* -- the team's work --------------------------------------------------------------- */
typedef struct {
    rows_fn_t fn;
    const void *job;
    int64_t rows;
    size_t next, n_units;
} rw_run_t;

static void rw_work(void *ctx) {
    rw_run_t *run = ctx;
    size_t u;
    while ((u = __atomic_fetch_add(&run->next, 1, __ATOMIC_RELAXED)) < run->n_units) {
        const int64_t r0 = (int64_t)u * RW_ROWS_PER_UNIT;
        run->fn(run->job, r0, r0 + RW_ROWS_PER_UNIT < run->rows ? r0 + RW_ROWS_PER_UNIT : run->rows);
    }
}

static void rw_run(rows_fn_t fn, const void *job, int64_t rows, int threads) {
    rw_run_t run = {fn, job, rows, 0, (size_t)((rows + RW_ROWS_PER_UNIT - 1) / RW_ROWS_PER_UNIT)};
    Py_BEGIN_ALLOW_THREADS
    kvt_team_run(rw_work, &run, run.n_units > 1 ? threads : 1);
    Py_END_ALLOW_THREADS
}

static int rw_check_threads(int threads) {
    if (threads >= 1 && threads <= 16) return 0;
    PyErr_SetString(PyExc_ValueError, "threads must be 1..16");
    return -1;
}

/* -- entry points ------------------------------------------------------------------ */
PyObject *kvt_py_rms_norm(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *names[] = {"x", "delta", "w", "out", "rows", "cols", "eps", "bf16", "threads", "impl", "round_once", NULL};
    unsigned long long x, delta, w, out;
    long long rows, cols;
    float eps;
    int bf16, threads = 1, round_once = 0;
    const char *impl = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKKKLLfp|iz$p:rms_norm", names, &x, &delta, &w, &out, &rows, &cols,
                                     &eps, &bf16, &threads, &impl, &round_once))
        return NULL;
    if (rw_check_threads(threads) < 0) return NULL;
    if (rows < 0 || cols <= 0 || cols > RW_MAX_COLS) return PyErr_Format(PyExc_ValueError, "cols must be 1..%d", RW_MAX_COLS);
    if (!x || !w || !out) return PyErr_Format(PyExc_ValueError, "null address");
    const rw_impl_t *build = rw_find(impl);
    if (build == NULL) return NULL;
    norm_job_t job = {(char *)(uintptr_t)x, (const char *)(uintptr_t)delta, (const char *)(uintptr_t)w,
                      (char *)(uintptr_t)out, rows, cols, eps, bf16, round_once};
    rw_run(build->norm, &job, rows, threads);
    Py_RETURN_NONE;
}

PyObject *kvt_py_rope_kv(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *names[] = {"qkv", "rows", "row_elems", "q_heads", "kv_heads", "head_dim", "cos", "sin", "positions",
                            "q_out", "kv", "strides", "blocks", "offsets", "bf16", "threads", "impl", "int8_scales",
                            "fp8", "f16", NULL};
    unsigned long long qkv, cs, sn, pos, q_out, kv, blocks, offsets;
    long long rows, row_elems, s_block, s_kv, s_head, s_pos, int8_scales = -1;
    int q_heads, kv_heads, head_dim, bf16, threads = 1, fp8 = 0, f16 = 0;
    const char *impl = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KLLiiiKKKKK(LLLL)KKp|izLpp:rope_kv", names, &qkv, &rows, &row_elems,
                                     &q_heads, &kv_heads, &head_dim, &cs, &sn, &pos, &q_out, &kv, &s_block, &s_kv,
                                     &s_head, &s_pos, &blocks, &offsets, &bf16, &threads, &impl, &int8_scales, &fp8, &f16))
        return NULL;
    if (fp8 && int8_scales < 0) return PyErr_Format(PyExc_ValueError, "fp8 names an 8-bit pool's quants: give its scales");
    if (f16 && int8_scales >= 0) return PyErr_Format(PyExc_ValueError, "a pool is float16 or 8-bit");
    if (int8_scales >= 0 && (int8_scales % 4 || s_block % 4 || s_kv % head_dim || s_head % head_dim || s_pos != head_dim))
        return PyErr_Format(PyExc_ValueError, "an 8-bit pool's strides do not fit its scales");
    if (rw_check_threads(threads) < 0) return NULL;
    if (head_dim <= 0 || head_dim % 2 || head_dim > 512)
        return PyErr_Format(PyExc_ValueError, "head_dim must be even, at most 512");
    if (rows < 0 || q_heads <= 0 || kv_heads <= 0 || row_elems < (long long)(q_heads + 2 * kv_heads) * head_dim)
        return PyErr_Format(PyExc_ValueError, "a row holds q, k and v heads");
    if (!qkv || !cs || !sn || !pos || !q_out || (kv && (!blocks || !offsets)))
        return PyErr_Format(PyExc_ValueError, "null address");
    const rw_impl_t *build = rw_find(impl);
    if (build == NULL) return NULL;
    rope_job_t job = {
        .qkv = (char *)(uintptr_t)qkv,
        .rows = rows,
        .row_elems = row_elems,
        .q_heads = q_heads,
        .kv_heads = kv_heads,
        .head_dim = head_dim,
        .cos = (const char *)(uintptr_t)cs,
        .sin = (const char *)(uintptr_t)sn,
        .pos = (const int64_t *)(uintptr_t)pos,
        .q_out = (char *)(uintptr_t)q_out,
        .kv = (char *)(uintptr_t)kv,
        .s_block = s_block,
        .s_kv = s_kv,
        .s_head = s_head,
        .s_pos = s_pos,
        .blocks = (const int64_t *)(uintptr_t)blocks,
        .offsets = (const int64_t *)(uintptr_t)offsets,
        .bf16 = bf16,
        .int8_scales = int8_scales,
        .fp8 = fp8,
        .f16 = f16,
    };
    rw_run(build->rope, &job, rows, threads);
    Py_RETURN_NONE;
}

PyObject *kvt_py_silu_mul(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *names[] = {"gate_up", "out", "rows", "inter", "bf16", "threads", "impl", NULL};
    unsigned long long gate_up, out;
    long long rows, inter;
    int bf16, threads = 1;
    const char *impl = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KKLLp|iz:silu_mul", names, &gate_up, &out, &rows, &inter, &bf16,
                                     &threads, &impl))
        return NULL;
    if (rw_check_threads(threads) < 0) return NULL;
    if (rows < 0 || inter <= 0) return PyErr_Format(PyExc_ValueError, "inter must be positive");
    if (!gate_up || !out) return PyErr_Format(PyExc_ValueError, "null address");
    const rw_impl_t *build = rw_find(impl);
    if (build == NULL) return NULL;
    silu_job_t job = {(const char *)(uintptr_t)gate_up, (char *)(uintptr_t)out, rows, inter, bf16};
    rw_run(build->silu, &job, rows, threads);
    Py_RETURN_NONE;
}

PyObject *kvt_py_rowwise_impls(PyObject *mod, PyObject *arg) {
    (void)mod;
    (void)arg;
    pthread_once(&rw_once, rw_pick);
    return kvt_impl_names(rw_impls, sizeof rw_impls[0], rw_n_impls);
}
