/* What kvtier_native.c and kvtier_quant.c share: one extension module, two sources. */
#ifndef KVTIER_NATIVE_H
#define KVTIER_NATIVE_H

#include <Python.h>

/* The sleeping worker team (kvtier_native.c): work(ctx) on the caller and on up to
 * threads - 1 workers, without the GIL; returns once all of them have left it. */
void kvt_team_run(void (*work)(void *), void *ctx, int threads);

/* Quantized matrix-vector products (kvtier_quant.c). */
PyObject *kvt_py_quant_matvec(PyObject *mod, PyObject *args, PyObject *kw);
const char *kvt_quant_impl(void);

#endif
