/*
 * kvtier._native, the module itself: the method table (every Python signature and
 * docstring), the module's constants and PyInit; the work is in the file named after
 * it (native/README.md has the table):
 *
 *   preadv_batch / pwritev_batch  iopool.c: many positional reads or writes in one call,
 *                                 spread over a small pthread pool, GIL released
 *   alloc_aligned                 aligned.c: a writable buffer at an aligned address
 *                                 (O_DIRECT)
 *   crc32c / crc32c_layers        crc32c.c: CRC-32C (Castagnoli): the SSE4.2 crc32
 *                                 instruction, three streams interleaved, else a
 *                                 slicing-by-8 table
 *   bind_xxh3 / xxh3_128_chain    keychain.c: the chained block keys of kvtier/keys.py,
 *                                 calling the xxhash package's own xxh3-128, GIL released
 *   copy_regions                  copy.c: many same-sized memcpys by address in one
 *                                 call, GIL released (the engine's layer-by-layer KV
 *                                 onboarding)
 *   paged_decode_attention        decode_attention.c (+ _avx512.c, _avx2.c): decode
 *                                 attention read in place from the paged pool
 *   paged_prefill_attention       kvtier_prefill.c: prefill attention over cached
 *                                 positions
 *   quant_matvec                  kvtier_quant.c: decode weight products from GGUF blocks
 *
 * The attention kernels and quant_matvec share the sleeping worker team of team.c.
 *
 * The disk tier's functions and copy_regions are also written in pure Python in
 * kvtier/tiers/native.py (the fallback for a platform without a compiler); tests check
 * the two agree. The key chain falls back to a Python loop in kvtier/keys.py, the
 * attention kernels to torch (kvtier/engine/kernels.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "aligned.h"
#include "crc32c.h"
#include "iopool.h"
#include "kvtier_native.h"

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

static PyMethodDef methods[] = {
    {"quant_matvec", (PyCFunction)(void (*)(void))kvt_py_quant_matvec, METH_VARARGS | METH_KEYWORDS,
     "quant_matvec(kind, q, d, m, rows, cols, x, n, out, threads=1, impl=None) -> None\n\n"
     "out[i, r] = sum_j w[r, j] x[i, j] (float32) for the n rows of x, with w read from repacked GGUF "
     "blocks: kind 0 = Q4_1 (q: rows x cols/2 nibbles, d and m: rows x cols/32 float32), 1 = Q8_0 (q: rows x "
     "cols int8, d: rows x cols/32, m: 0). Every argument but kind, rows, cols, n, threads and impl is an "
     "address (trusted, like copy_regions'); impl picks a build by name ('base' always exists; see QUANT_IMPL)."},
    {"preadv_batch", (PyCFunction)(void (*)(void))kvt_py_preadv_batch, METH_VARARGS | METH_KEYWORDS,
     "preadv_batch(fd, buffers, offsets, bounce=None, align=4096) -> list[int]\n\n"
     "Fill each writable buffer from its file offset (fd: one int or one per buffer), in parallel, "
     "without the GIL. Returns the bytes read per buffer: less than its length only at end of file. "
     "With a bounce buffer, requests whose address, length or offset is not a multiple of align are "
     "read through it (O_DIRECT needs all three aligned). Errors raise OSError with the first errno."},
    {"pwritev_batch", (PyCFunction)(void (*)(void))kvt_py_pwritev_batch, METH_VARARGS | METH_KEYWORDS,
     "pwritev_batch(fd, buffers, offsets, bounce=None, align=4096) -> int\n\n"
     "Write each buffer whole at its file offset, in parallel, without the GIL; returns the bytes "
     "written. Unaligned requests go through the bounce buffer when one is given: the partial blocks "
     "at their edges are read first and written back whole (buffers of one call must not share such "
     "a block). Errors raise OSError with the first errno."},
    {"preadv_crc32c_batch", (PyCFunction)(void (*)(void))kvt_py_preadv_crc32c_batch, METH_VARARGS | METH_KEYWORDS,
     "preadv_crc32c_batch(fd, buffers, offsets, layer_bytes, bounce=None, align=4096)\n"
     "-> tuple[list[int], list[list[int]]]\n\n"
     "preadv_batch, plus each buffer's CRC-32C per layer_bytes run (every buffer a whole number of "
     "layers), computed by the I/O threads while the bytes are still in cache."},
    {"pwritev_crc32c_batch", (PyCFunction)(void (*)(void))kvt_py_pwritev_crc32c_batch, METH_VARARGS | METH_KEYWORDS,
     "pwritev_crc32c_batch(fd, buffers, offsets, layer_bytes, bounce=None, align=4096) -> list[list[int]]\n\n"
     "pwritev_batch, returning each buffer's CRC-32C per layer_bytes run instead of the byte count."},
    {"alloc_aligned", (PyCFunction)(void (*)(void))kvt_py_alloc_aligned, METH_VARARGS | METH_KEYWORDS,
     "alloc_aligned(nbytes, alignment=4096) -> AlignedBuffer\n\nZero-filled writable memory at an aligned address."},
    {"crc32c", (PyCFunction)(void (*)(void))kvt_py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(buffer, seed=0) -> int\n\nCRC-32C of the buffer; seed is a previous result to continue from."},
    {"crc32c_layers", (PyCFunction)(void (*)(void))kvt_py_crc32c_layers, METH_VARARGS | METH_KEYWORDS,
     "crc32c_layers(buffer, layer_bytes) -> list[int]\n\nCRC-32C of each consecutive layer_bytes run."},
    {"_crc32c_portable", (PyCFunction)(void (*)(void))kvt_py_crc32c_portable, METH_VARARGS | METH_KEYWORDS,
     "The table-driven CRC-32C that runs where SSE4.2 does not (tests compare it with crc32c)."},
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
     "group, head_dim, block_size, scale, threads) -> None\n\n"
     "Decode attention read in place from a paged KV pool layer (see kvtier/engine/kernels.py, which wraps it): "
     "out[s, h] = softmax(scale * q[s, h] . K[s, h // group]) V[s, h // group] over the first lengths[s] "
     "positions of sequence s, whose blocks are tables[starts[s]:starts[s + 1]]. kv, q, out, tables, starts and "
     "lengths are addresses (trusted, like copy_regions'); strides are the layer's block, K/V, head and position "
     "strides in elements; bf16 says the pool, q and out are bfloat16 (else float32); tables, starts and lengths "
     "are int32. Block ids and counts are checked against num_blocks and the lengths; the GIL is released."},
    {"_paged_decode_attention_using", (PyCFunction)(void (*)(void))kvt_py_paged_decode_attention_using,
     METH_VARARGS | METH_KEYWORDS, "_paged_decode_attention_using(impl, *args): paged_decode_attention on one named "
     "build (one of paged_decode_attention_impls()), for tests."},
    {"paged_prefill_attention", (PyCFunction)(void (*)(void))kvt_py_paged_prefill_attention,
     METH_VARARGS | METH_KEYWORDS,
     "paged_prefill_attention(kv, strides, num_blocks, bf16, q, out, ids, n_ids, start, tokens, kv_heads, group, "
     "head_dim, block_size, scale, threads, impl=None) -> None\n\n"
     "One sequence's new tokens q [tokens, kv_heads * group, head_dim] against its positions in a paged KV pool "
     "layer, causally: token t sees positions <= start + t, whose K/V are in blocks ids[0:n_ids] (the new tokens' "
     "own already written). Addresses and strides as for paged_decode_attention; ids are int32, checked against "
     "num_blocks; impl picks a build by name (see paged_prefill_attention_impls); the GIL is released."},
    {"paged_prefill_attention_impls", (PyCFunction)kvt_py_paged_prefill_attention_impls, METH_NOARGS,
     "paged_prefill_attention_impls() -> tuple[str, ...]\n\nThe builds of paged_prefill_attention this CPU runs "
     "(avx2, base), best first: the first is the one it uses."},
    {"paged_decode_attention_impls", (PyCFunction)kvt_py_paged_decode_attention_impls, METH_NOARGS,
     "paged_decode_attention_impls() -> tuple[str, ...]\n\nThe builds of paged_decode_attention this CPU runs "
     "(avx512, avx2, base), best first: the first is the one it uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvtier._native", "The disk tier's hot path in C (see native/README.md).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    static int once = 0;
    if (!once) {
        kvt_crc_init();
        kvt_iopool_init();
        once = 1;
    }
    if (PyType_Ready(&kvt_aligned_buffer_type) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&kvt_aligned_buffer_type);
    if (PyModule_AddObject(m, "AlignedBuffer", (PyObject *)&kvt_aligned_buffer_type) < 0 ||
        PyModule_AddIntConstant(m, "THREADS", KVT_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "PIECE_BYTES", (long)KVT_PIECE) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_IMPL", kvt_crc_impl_name()) < 0 ||
        PyModule_AddStringConstant(m, "QUANT_IMPL", kvt_quant_impl()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
