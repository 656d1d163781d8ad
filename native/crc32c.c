/*
 * CRC-32C (Castagnoli): the SSE4.2 crc32 instruction over three interleaved streams,
 * else a slicing-by-8 table; and the Python entry points crc32c, crc32c_layers and
 * _crc32c_portable. The batched I/O (iopool.c) takes its per-layer CRCs with
 * kvt_crc32c.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "crc32c.h"
#include "io.h"

#if defined(__x86_64__) || defined(__i386__)
#define KVT_X86 1
#include <nmmintrin.h>
#endif

/* crc32c releases the GIL only above this size: re-taking a contended GIL can cost a
 * whole switch interval (5 ms), far more than checksumming a few pages. */
#define KVT_CRC_NOGIL_BYTES ((Py_ssize_t)256 << 10)

/* ------------------------------------------------------------------------- */
/* CRC-32C                                                                    */
/* ------------------------------------------------------------------------- */

#define CRC32C_POLY 0x82f63b78u /* Castagnoli, bit-reflected */

static uint32_t crc_table[8][256]; /* slicing-by-8 */

static void crc_table_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
}

/* The running (pre-inverted) CRC state over len bytes: the portable path. */
static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= crc;
        crc = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
              crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
              crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#ifdef KVT_X86
/*
 * Hardware path (after Mark Adler's crc32c.c): the crc32 instruction has a latency of
 * three cycles and a throughput of one per cycle, so three independent streams over
 * adjacent LONG (or SHORT) byte runs keep it busy; their CRCs are then combined by
 * "shifting" the first one over the length of the others (a GF(2) matrix applied
 * through four 256-entry tables).
 */
#define CRC_LONG 8192
#define CRC_SHORT 256

static uint32_t crc_long[4][256];
static uint32_t crc_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends len zero bytes (len a power of two) to a CRC state. */
static void crc_zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = CRC32C_POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four zero bits */
    do {                   /* the first square gives one zero byte, in even */
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void crc_zeros(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    crc_zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t crc_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c0 = crc, c1, c2;
    while (len && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        len--;
    }
    while (len >= 3 * CRC_LONG) {
        const unsigned char *end = p + CRC_LONG;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + CRC_LONG));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_LONG));
            p += 8;
        } while (p < end);
        c0 = crc_shift(crc_long, (uint32_t)c0) ^ c1;
        c0 = crc_shift(crc_long, (uint32_t)c0) ^ c2;
        p += 2 * CRC_LONG;
        len -= 3 * CRC_LONG;
    }
    while (len >= 3 * CRC_SHORT) {
        const unsigned char *end = p + CRC_SHORT;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + CRC_SHORT));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_SHORT));
            p += 8;
        } while (p < end);
        c0 = crc_shift(crc_short, (uint32_t)c0) ^ c1;
        c0 = crc_shift(crc_short, (uint32_t)c0) ^ c2;
        p += 2 * CRC_SHORT;
        len -= 3 * CRC_SHORT;
    }
    while (len >= 8) {
        c0 = _mm_crc32_u64(c0, load64(p));
        p += 8;
        len -= 8;
    }
    while (len--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}
#endif /* KVT_X86 */

static uint32_t (*crc_impl)(uint32_t, const unsigned char *, size_t) = crc_sw;
static const char *crc_impl_name = "table";

void kvt_crc_init(void) {
    crc_table_init();
#ifdef KVT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_zeros(crc_long, CRC_LONG);
        crc_zeros(crc_short, CRC_SHORT);
        crc_impl = crc_hw;
        crc_impl_name = "sse4.2";
    }
#endif
}

const char *kvt_crc_impl_name(void) { return crc_impl_name; }

uint32_t kvt_crc32c(uint32_t seed, const void *p, size_t len) {
    return ~crc_impl(~seed, (const unsigned char *)p, len);
}

/* ------------------------------------------------------------------------- */
/* CRC-32C entry points                                                       */
/* ------------------------------------------------------------------------- */

static PyObject *crc_entry(PyObject *args, PyObject *kw, uint32_t (*impl)(uint32_t, const unsigned char *, size_t),
                           const char *fmt) {
    static char *kwlist[] = {"buffer", "seed", NULL};
    Py_buffer view;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &view, &seed)) return NULL;
    if (seed > 0xffffffffULL) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "crc32c: seed must fit in 32 bits, got %llu", seed);
    }
    uint32_t crc;
    if (view.len >= KVT_CRC_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS crc = ~impl(~(uint32_t)seed, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = ~impl(~(uint32_t)seed, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static uint32_t crc_dispatch(uint32_t crc, const unsigned char *p, size_t len) { return crc_impl(crc, p, len); }

PyObject *kvt_py_crc32c(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return crc_entry(args, kw, crc_dispatch, "y*|K:crc32c");
}

PyObject *kvt_py_crc32c_portable(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return crc_entry(args, kw, crc_sw, "y*|K:_crc32c_portable");
}

PyObject *kvt_py_crc32c_layers(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"buffer", "layer_bytes", NULL};
    Py_buffer view;
    Py_ssize_t lb;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*n:crc32c_layers", kwlist, &view, &lb)) return NULL;
    PyObject *result = NULL;
    uint32_t *crcs = NULL;
    if (lb <= 0 || view.len % lb != 0) {
        PyErr_Format(PyExc_ValueError, "crc32c_layers: %zd bytes are not a whole number of %zd-byte layers", view.len,
                     lb);
        goto done;
    }
    Py_ssize_t n = view.len / lb;
    crcs = PyMem_Malloc((size_t)(n + 1) * sizeof(uint32_t));
    if (crcs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *p = view.buf;
    if (view.len >= KVT_CRC_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n; i++) crcs[i] = kvt_crc32c(0, p + i * lb, (size_t)lb);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++) crcs[i] = kvt_crc32c(0, p + i * lb, (size_t)lb);
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (v == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, v);
    }
done:
    PyMem_Free(crcs);
    PyBuffer_Release(&view);
    return result;
}
