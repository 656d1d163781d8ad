/* The Python entry points of kvtier._native, one extension module built from every .c
 * file in native/: module.c puts them in its method table (with their signatures and
 * docstrings), and the file named above each group defines it. What the files share
 * below Python (the CRC, the thread team, the decode attention job) is declared in the
 * header of the file that owns it. */
#ifndef KVTIER_NATIVE_H
#define KVTIER_NATIVE_H

#include <Python.h>

/* Batched positional I/O (iopool.c). */
PyObject *kvt_py_preadv_batch(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_pwritev_batch(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_preadv_crc32c_batch(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_pwritev_crc32c_batch(PyObject *mod, PyObject *args, PyObject *kw);

/* Aligned buffers (aligned.c). */
PyObject *kvt_py_alloc_aligned(PyObject *mod, PyObject *args, PyObject *kw);

/* CRC-32C (crc32c.c). */
PyObject *kvt_py_crc32c(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_crc32c_portable(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_crc32c_layers(PyObject *mod, PyObject *args, PyObject *kw);

/* The block-key chain (keychain.c). */
PyObject *kvt_py_bind_xxh3(PyObject *mod, PyObject *arg);
PyObject *kvt_py_xxh3_128_chain(PyObject *mod, PyObject *args);

/* Region copies (copy.c). */
PyObject *kvt_py_copy_regions(PyObject *mod, PyObject *args);

/* Decode attention (decode_attention.c). */
PyObject *kvt_py_paged_decode_attention(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_paged_decode_attention_using(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_paged_decode_attention_impls(PyObject *mod, PyObject *arg);

/* Quantized matrix-vector products (kvtier_quant.c). */
PyObject *kvt_py_quant_matvec(PyObject *mod, PyObject *args, PyObject *kw);
const char *kvt_quant_impl(void);

/* Prefill attention over cached positions (kvtier_prefill.c). */
PyObject *kvt_py_paged_prefill_attention(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_paged_prefill_attention_impls(PyObject *mod, PyObject *arg);

/* The names of a table of builds, as a tuple of str; every entry of the table
 * (entry_bytes apart) starts with its name, a const char * (module.c). */
PyObject *kvt_impl_names(const void *table, size_t entry_bytes, int n);

#endif
