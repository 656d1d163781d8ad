/* What kvtier_native.c, kvtier_quant.c and kvtier_prefill.c share: one extension module. */
#ifndef KVTIER_NATIVE_H
#define KVTIER_NATIVE_H

#include <Python.h>

/* The sleeping worker team (kvtier_native.c): work(ctx) on the caller and on up to
 * threads - 1 workers, without the GIL; returns once all of them have left it. */
void kvt_team_run(void (*work)(void *), void *ctx, int threads);

/* The names of a table of builds, as a tuple of str; every entry of the table
 * (entry_bytes apart) starts with its name, a const char *. */
PyObject *kvt_impl_names(const void *table, size_t entry_bytes, int n);

/* Quantized matrix-vector products (kvtier_quant.c). */
PyObject *kvt_py_quant_matvec(PyObject *mod, PyObject *args, PyObject *kw);
const char *kvt_quant_impl(void);

/* Prefill attention over cached positions (kvtier_prefill.c). */
PyObject *kvt_py_paged_prefill_attention(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_paged_prefill_attention_impls(PyObject *mod, PyObject *arg);

#endif
