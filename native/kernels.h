/* The Python entry points of kvtier._native_kernels (kernels_module.c puts them in its
 * method table), grouped by the file that defines each: the engine's and the keys'
 * compute. What the kernels share below Python (the thread team, the decode attention
 * job, the bfloat16 helpers) is in team.h, decode_attention.h and float_math.h. */
#ifndef KVTIER_KERNELS_H
#define KVTIER_KERNELS_H

#include <Python.h>
#include <stddef.h>

/* The block-key chain (keychain.c). */
PyObject *kvt_py_bind_xxh3(PyObject *mod, PyObject *arg);
PyObject *kvt_py_xxh3_128_chain(PyObject *mod, PyObject *args);

/* Region copies (copy.c). */
PyObject *kvt_py_copy_regions(PyObject *mod, PyObject *args);

/* Decode attention (decode_attention.c). */
PyObject *kvt_py_paged_decode_attention(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_paged_decode_attention_using(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_paged_decode_attention_impls(PyObject *mod, PyObject *arg);

/* Prefill attention over cached positions (prefill_attention.c). */
PyObject *kvt_py_paged_prefill_attention(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_paged_prefill_attention_impls(PyObject *mod, PyObject *arg);

/* Quantized matrix-vector products (quant_matvec.c). */
PyObject *kvt_py_quant_matvec(PyObject *mod, PyObject *args, PyObject *kw);
/* Scales a factored row may have (quant_matvec multiplies them out on the worker's stack). */
#define KVT_QUANT_MAX_ROW_SCALES 8192
const char *kvt_quant_impl(void);
int kvt_quant_bf16(void); /* whether Q4_1 times bfloat16 rows runs on AVX-512 BF16 here */
int kvt_quant_q8(void);   /* whether x quantized to 8 bits runs on AVX-512 VNNI here */

/* A decoder layer's element-wise steps: RMSNorm, RoPE + the K/V write, SwiGLU's gate (rowwise.c). */
PyObject *kvt_py_rms_norm(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_rope_kv(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_silu_mul(PyObject *mod, PyObject *args, PyObject *kw);
PyObject *kvt_py_rowwise_impls(PyObject *mod, PyObject *arg);

/* What the attention kernels' keywords say a pool holds, as a KVT_* kind (float_math.h): with
 * offset >= 0 (the bytes from a block's layer range to its scales [K|V][kv_heads][block] float32)
 * 8-bit quants, e4m3 ones with fp8, and *scales and their strides in floats from the pool's strides
 * in bytes; else float16 with f16, else the model's bfloat16 (bf16) or float32. NULL, or why the
 * keywords or strides do not fit (kernels_module.c). */
const char *kvt_pool_kind(const char *kv, ptrdiff_t s_block, ptrdiff_t s_kv, ptrdiff_t s_head, int dim, int bf16,
                          Py_ssize_t offset, int fp8, int f16, int *kind, const float **scales, ptrdiff_t *ss_block,
                          ptrdiff_t *ss_kv, ptrdiff_t *ss_head);

/* The names of a table of builds, as a tuple of str; every entry of the table
 * (entry_bytes apart) starts with its name, a const char * (kernels_module.c). */
PyObject *kvt_impl_names(const void *table, size_t entry_bytes, int n);

#endif
