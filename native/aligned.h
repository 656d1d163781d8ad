/* Aligned buffers (aligned.c): the AlignedBuffer type the module exports, and the
 * power-of-two check the batched I/O (iopool.c) shares for its align argument. */
#ifndef KVTIER_ALIGNED_H
#define KVTIER_ALIGNED_H

#include <Python.h>

extern PyTypeObject kvt_aligned_buffer_type;

static inline int kvt_is_pow2(Py_ssize_t n) { return n > 0 && (n & (n - 1)) == 0; }

#endif
