/*
 * kvtier._native_io: the disk tier's hot path. The method table (every Python
 * signature and docstring), the module's constants and PyInit; the work is in the file
 * named after it (native/README.md has the table):
 *
 *   preadv_batch / pwritev_batch  iopool.c: many positional reads or writes in one call,
 *   (and their *_crc32c_batch)    spread over a small pthread pool, GIL released
 *   alloc_aligned                 aligned.c: a writable buffer at an aligned address
 *                                 (O_DIRECT)
 *   crc32c / crc32c_layers        crc32c.c: CRC-32C (Castagnoli): the SSE4.2 crc32
 *                                 instruction, three streams interleaved, else a
 *                                 slicing-by-8 table
 *   SlotIndex                     slot_index.c: the disk tier's in-memory index, key ->
 *                                 slot and record in flat arrays, with a recency list
 *
 * kvtier/tiers/native.py holds the same functions in pure Python, the reference the
 * tests compare this module with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "aligned.h"
#include "crc32c.h"
#include "io.h"
#include "iopool.h"

static PyMethodDef methods[] = {
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvtier._native_io", "The disk tier's batched I/O and CRC-32C in C (see native/README.md).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native_io(void) {
    static int once = 0;
    if (!once) {
        kvt_crc_init();
        kvt_iopool_init();
        once = 1;
    }
    if (PyType_Ready(&kvt_aligned_buffer_type) < 0 || PyType_Ready(&kvt_slot_index_type) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&kvt_aligned_buffer_type);
    Py_INCREF(&kvt_slot_index_type);
    if (PyModule_AddObject(m, "AlignedBuffer", (PyObject *)&kvt_aligned_buffer_type) < 0 ||
        PyModule_AddObject(m, "SlotIndex", (PyObject *)&kvt_slot_index_type) < 0 ||
        PyModule_AddIntConstant(m, "THREADS", KVT_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "PIECE_BYTES", (long)KVT_PIECE) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_IMPL", kvt_crc_impl_name()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
