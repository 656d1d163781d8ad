/*
 * The block-key chain: xxh3_128_chain runs the loop KeyHasher.keys (kvtier/keys.py)
 * defines, without the GIL, calling the xxhash package's own xxh3-128, which
 * bind_xxh3 finds at import. kvtier/keys.py falls back to a Python loop.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* xxh3-128 is not reimplemented here: the xxhash package's own extension exports
   XXH3_128bits_withSeed, and bind_xxh3 looks it up there at import time, so keys
   computed here are those of the xxhash library by construction. */
typedef struct {
    uint64_t low64, high64;
} xxh128_t;
typedef xxh128_t (*xxh3_128_seeded_fn)(const void *, size_t, uint64_t);
static xxh3_128_seeded_fn g_xxh3_128 = NULL;

PyObject *kvt_py_bind_xxh3(PyObject *mod, PyObject *arg) {
    (void)mod;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "bind_xxh3: %s", dlerror());
    void *sym = dlsym(lib, "XXH3_128bits_withSeed");
    if (sym == NULL) return PyErr_Format(PyExc_OSError, "bind_xxh3: %s exports no XXH3_128bits_withSeed", path);
    g_xxh3_128 = (xxh3_128_seeded_fn)sym; /* the library stays loaded: Python holds it too */
    Py_RETURN_NONE;
}

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) out[i] = (unsigned char)(v & 0xff);
}

PyObject *kvt_py_xxh3_128_chain(PyObject *mod, PyObject *args) {
    (void)mod;
    Py_buffer root, body;
    Py_ssize_t block_bytes;
    unsigned long long seed;
    if (g_xxh3_128 == NULL) return PyErr_Format(PyExc_RuntimeError, "xxh3_128_chain: call bind_xxh3 first");
    if (!PyArg_ParseTuple(args, "y*y*nK:xxh3_128_chain", &root, &body, &block_bytes, &seed)) return NULL;
    PyObject *out = NULL;
    if (root.len != 16 || block_bytes <= 0 || body.len % block_bytes) {
        PyErr_Format(PyExc_ValueError, "xxh3_128_chain: root must be 16 bytes and the body whole blocks of %zd",
                     block_bytes);
        goto done;
    }
    Py_ssize_t n = body.len / block_bytes;
    unsigned char *digests = malloc((size_t)(n * 16 + 16 + block_bytes));
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *buf = digests + n * 16; /* prev key || block, rebuilt per block */
    const unsigned char *src = body.buf;
    Py_BEGIN_ALLOW_THREADS
    memcpy(buf, root.buf, 16);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + 16, src + i * block_bytes, (size_t)block_bytes);
        xxh128_t h = g_xxh3_128(buf, (size_t)(16 + block_bytes), (uint64_t)seed);
        put_be64(buf, h.high64); /* the canonical digest: high half first, big-endian */
        put_be64(buf + 8, h.low64);
        memcpy(digests + i * 16, buf, 16);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)digests + i * 16, 16);
        if (key == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, key);
    }
    free(digests);
done:
    PyBuffer_Release(&root);
    PyBuffer_Release(&body);
    return out;
}
