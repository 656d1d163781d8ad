/*
 * kvtier._native_kernels: the engine's and the block keys' compute. The method table
 * (every Python signature and docstring), the module's constants and PyInit; the work
 * is in the file named after it (native/README.md has the table):
 *
 *   bind_xxh3 / xxh3_128_chain    keychain.c: the chained block keys of kvtier/keys.py,
 *                                 calling the xxhash package's own xxh3-128, GIL released
 *   copy_regions                  copy.c: many same-sized memcpys by address in one
 *                                 call, GIL released (the engine's layer-by-layer KV
 *                                 onboarding)
 *   paged_decode_attention        decode_attention.c (+ _avx512.c, _avx2.c): decode
 *                                 attention read in place from the paged pool
 *   paged_prefill_attention       prefill_attention.c: prefill attention over cached
 *                                 positions
 *   quant_matvec                  quant_matvec.c: decode weight products from GGUF blocks
 *   rms_norm / rope_kv / silu_mul rowwise.c: a layer's element-wise steps, one pass each
 *
 * The attention kernels, quant_matvec and the row kernels share the sleeping worker team of team.c.
 * The key chain has a Python loop in kvtier/keys.py, copy_regions a Python loop in
 * kvtier/tiers/native.py, the attention kernels torch (kvtier/engine/kernels.py): the
 * references the tests compare this module with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "float_math.h"
#include "kernels.h"

PyObject *kvt_impl_names(const void *table, size_t entry_bytes, int n) {
    PyObject *names = PyTuple_New(n);
    for (int i = 0; names != NULL && i < n; i++) {
        const char *const *entry = (const char *const *)((const char *)table + (size_t)i * entry_bytes);
        PyObject *name = PyUnicode_FromString(*entry);
        if (name == NULL) Py_CLEAR(names);
        else PyTuple_SET_ITEM(names, i, name);
    }
    return names;
}

const char *kvt_pool_kind(const char *kv, ptrdiff_t s_block, ptrdiff_t s_kv, ptrdiff_t s_head, int dim, int bf16,
                          Py_ssize_t offset, int fp8, int f16, int *kind, const float **scales, ptrdiff_t *ss_block,
                          ptrdiff_t *ss_kv, ptrdiff_t *ss_head) {
    if (offset < 0) {
        *kind = f16 ? KVT_F16 : bf16 ? KVT_BF16 : KVT_F32;
        return fp8 ? "fp8 names an 8-bit pool's quants: it needs its scales offset" : NULL;
    }
    if (f16) return "a pool is float16 or 8-bit";
    *kind = fp8 ? KVT_E4M3 : KVT_I8;
    if (dim <= 0 || offset % 4 || s_block % 4 || s_kv % dim || s_head % dim)
        return "an 8-bit pool's block stride and scales offset must be multiples of 4, its K/V and head strides of "
               "head_dim";
    *scales = (const float *)(kv + offset);
    *ss_block = s_block / 4;
    *ss_kv = s_kv / dim;
    *ss_head = s_head / dim;
    return NULL;
}

static PyMethodDef methods[] = {
    {"quant_matvec", (PyCFunction)(void (*)(void))kvt_py_quant_matvec, METH_VARARGS | METH_KEYWORDS,
     "quant_matvec(kind, q, d, m, rows, cols, x, n, out, threads=1, impl=None, x_bf16=False, d_fac=0, m_fac=0, "
     "x_q8=False) "
     "-> None\n\n"
     "out[i, r] = sum_j w[r, j] x[i, j] (float32) for the n rows of x, with w read from repacked GGUF "
     "blocks: kind 0 = Q4_1 (q: rows x cols/2 nibbles, d and m: rows x cols/32 float32), 1 = Q8_0 (q: rows x "
     "cols int8, d: rows x cols/32, m: 0). Every argument but kind, rows, cols, n, threads, impl and x_bf16 is an "
     "address (trusted, like copy_regions'); x is float32, or bfloat16 with x_bf16 (the products then run on AVX-512 "
     "BF16 where QUANT_BF16 says so, else x is widened); impl picks a build by name ('base' always exists; "
     "'avx512bf16' for bfloat16 rows; see QUANT_IMPL). With d_fac (int8, one per scale) d holds one float32 "
     "per 256 weights and a scale is d[s] * d_fac[k]; likewise m with m_fac (one per 32). x_q8: x quantized to "
     "8 bits per 32 values and multiplied in int8 on AVX-512 VNNI (QUANT_Q8; impl None or 'avx512vnni')."},
    {"bind_xxh3", (PyCFunction)kvt_py_bind_xxh3, METH_O,
     "bind_xxh3(path) -> None\n\nFind XXH3_128bits_withSeed in the xxhash extension at path."},
    {"xxh3_128_chain", (PyCFunction)kvt_py_xxh3_128_chain, METH_VARARGS,
     "xxh3_128_chain(root, body, block_bytes, seed) -> list[bytes]\n\n"
     "Chained keys: key(i) = xxh3_128(key(i-1) || block i of body, seed), key(-1) = root; "
     "the hashing runs without the GIL."},
    {"copy_regions", (PyCFunction)kvt_py_copy_regions, METH_VARARGS,
     "copy_regions(dst_addrs, src_addrs, nbytes) -> int\n\n"
     "memcpy(dst_addrs[i], src_addrs[i], nbytes) for each i of two int64 address arrays, without the "
     "GIL; returns how many. The addresses are trusted: the caller owns both sides and keeps them alive."},
    {"paged_decode_attention", (PyCFunction)(void (*)(void))kvt_py_paged_decode_attention, METH_VARARGS | METH_KEYWORDS,
     "paged_decode_attention(kv, strides, num_blocks, bf16, q, out, tables, starts, lengths, num_seqs, kv_heads, "
     "group, head_dim, block_size, scale, threads, window=0, int8_scales=-1, fp8=False, f16=False) -> None\n\n"
     "Decode attention read in place from a paged KV pool layer (see kvtier/engine/kernels.py, which wraps it): "
     "out[s, h] = softmax(scale * q[s, h] . K[s, h // group]) V[s, h // group] over the first lengths[s] "
     "positions of sequence s, whose blocks are tables[starts[s]:starts[s + 1]]. kv, q, out, tables, starts and "
     "lengths are addresses (trusted, like copy_regions'); strides are the layer's block, K/V, head and position "
     "strides in elements; bf16 says the pool, q and out are bfloat16 (else float32); tables, starts and lengths "
     "are int32. Block ids and counts are checked against num_blocks and the lengths; the GIL is released. "
     "int8_scales >= 0: the pool holds int8 quants (strides in bytes) and each block's layer range has its "
     "scales [K|V][kv_heads][block_size] float32 that many bytes from its start; bf16 then says q and out only; "
     "with fp8 the quants are float8 e4m3 instead. f16: the pool holds float16 (strides in elements), q and out "
     "the dtype bf16 says."},
    {"_paged_decode_attention_using", (PyCFunction)(void (*)(void))kvt_py_paged_decode_attention_using,
     METH_VARARGS | METH_KEYWORDS, "_paged_decode_attention_using(impl, *args): paged_decode_attention on one named "
     "build (one of paged_decode_attention_impls()), for tests."},
    {"paged_prefill_attention", (PyCFunction)(void (*)(void))kvt_py_paged_prefill_attention,
     METH_VARARGS | METH_KEYWORDS,
     "paged_prefill_attention(kv, strides, num_blocks, bf16, q, out, ids, n_ids, start, tokens, kv_heads, group, "
     "head_dim, block_size, scale, threads, impl=None, window=0, int8_scales=-1, fp8=False, f16=False) -> None\n\n"
     "One sequence's new tokens q [tokens, kv_heads * group, head_dim] against its positions in a paged KV pool "
     "layer, causally: token t sees positions <= start + t, whose K/V are in blocks ids[0:n_ids] (the new tokens' "
     "own already written). Addresses and strides as for paged_decode_attention; ids are int32, checked against "
     "num_blocks; impl picks a build by name (see paged_prefill_attention_impls); int8_scales, fp8 and f16 as for "
     "paged_decode_attention; the GIL is released."},
    {"paged_prefill_attention_impls", (PyCFunction)kvt_py_paged_prefill_attention_impls, METH_NOARGS,
     "paged_prefill_attention_impls() -> tuple[str, ...]\n\nThe builds of paged_prefill_attention this CPU runs "
     "(avx2, base), best first: the first is the one it uses."},
    {"paged_decode_attention_impls", (PyCFunction)kvt_py_paged_decode_attention_impls, METH_NOARGS,
     "paged_decode_attention_impls() -> tuple[str, ...]\n\nThe builds of paged_decode_attention this CPU runs "
     "(avx512, avx2, base), best first: the first is the one it uses."},
    {"rms_norm", (PyCFunction)(void (*)(void))kvt_py_rms_norm, METH_VARARGS | METH_KEYWORDS,
     "rms_norm(x, delta, w, out, rows, cols, eps, bf16, threads=1, impl=None) -> None\n\n"
     "For each of rows rows of cols elements: x += delta first when delta is not 0 (in place), then "
     "out = w * (x / sqrt(mean(x^2) + eps)), rounded as torch's float32 / bfloat16 (bf16) operators round. "
     "Addresses of C-contiguous rows (trusted, like copy_regions'); the GIL is released."},
    {"rope_kv", (PyCFunction)(void (*)(void))kvt_py_rope_kv, METH_VARARGS | METH_KEYWORDS,
     "rope_kv(qkv, rows, row_elems, q_heads, kv_heads, head_dim, cos, sin, positions, q_out, kv, strides, blocks, "
     "offsets, bf16, threads=1, impl=None, int8_scales=-1, fp8=False, f16=False) -> None\n\n"
     "Rotate-half RoPE of each row's q heads into q_out ([rows, q_heads, head_dim]) and of its k heads in place, "
     "by the cos / sin rows ([positions, head_dim]) at positions[r] (int64); then, when kv is not 0, the rotated k "
     "and the v heads into pool layer kv at block blocks[r], offset offsets[r] (int64), strides (block, K|V, head, "
     "position) in elements; int8_scales >= 0: an 8-bit pool (strides in bytes), k and v written as "
     "kvtier.layout.quantize_rows writes them (int8, or float8 e4m3 with fp8) with their scales that many bytes "
     "into each block's layer range; f16: a float16 pool, k and v rounded to it as torch rounds. Addresses "
     "trusted; the GIL is released."},
    {"silu_mul", (PyCFunction)(void (*)(void))kvt_py_silu_mul, METH_VARARGS | METH_KEYWORDS,
     "silu_mul(gate_up, out, rows, inter, bf16, threads=1, impl=None) -> None\n\n"
     "out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:], rounded as torch rounds. Addresses trusted; the "
     "GIL is released."},
    {"rowwise_impls", (PyCFunction)kvt_py_rowwise_impls, METH_NOARGS,
     "rowwise_impls() -> tuple[str, ...]\n\nThe builds of the row kernels this CPU runs (avx512, avx2, base), "
     "best first: the first is the one they use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvtier._native_kernels", "The engine's kernels and the block-key chain in C "
    "(see native/README.md).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native_kernels(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "QUANT_IMPL", kvt_quant_impl()) < 0 ||
        PyModule_AddIntConstant(m, "QUANT_BF16", kvt_quant_bf16()) < 0 ||
        PyModule_AddIntConstant(m, "QUANT_MAX_ROW_SCALES", KVT_QUANT_MAX_ROW_SCALES) < 0 ||
        PyModule_AddIntConstant(m, "QUANT_Q8", kvt_quant_q8()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
