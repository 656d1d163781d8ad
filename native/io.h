/* The Python entry points of kvtier._native_io (io_module.c puts them in its method
 * table), grouped by the file that defines each: the disk tier's hot path. */
#ifndef KVTIER_IO_H
#define KVTIER_IO_H

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

/* The disk tier's in-memory index by slot (slot_index.c). */
extern PyTypeObject kvt_slot_index_type;

#endif
