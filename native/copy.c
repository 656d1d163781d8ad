/*
 * copy_regions: many same-sized memcpys by address in one call, without the GIL (the
 * engine's layer-by-layer KV onboarding). kvtier/tiers/native.py has a Python twin.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "kernels.h"

PyObject *kvt_py_copy_regions(PyObject *mod, PyObject *args) {
    (void)mod;
    Py_buffer dst, src;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "y*y*n:copy_regions", &dst, &src, &nbytes)) return NULL;
    PyObject *out = NULL;
    if (dst.len != src.len || dst.len % (Py_ssize_t)sizeof(uint64_t) || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_regions: two int64 address arrays of one length, nbytes >= 0");
        goto done;
    }
    size_t n = (size_t)dst.len / sizeof(uint64_t);
    const uint64_t *d = dst.buf, *s = src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)nbytes);
    Py_END_ALLOW_THREADS
    out = PyLong_FromSize_t(n);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}
