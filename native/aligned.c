/*
 * Aligned buffers: alloc_aligned returns an AlignedBuffer, zero-filled writable memory
 * at an aligned address, as O_DIRECT wants for its bounce buffers (and the host tier
 * for its slabs); wrap it with memoryview, numpy or torch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "aligned.h"
#include "io.h"

typedef struct {
    PyObject_HEAD
    char *ptr;
    Py_ssize_t len;
    Py_ssize_t alignment;
    int mapped; /* mmap'd (munmap on free) rather than posix_memalign'd */
} AlignedBuffer;

static void aligned_dealloc(AlignedBuffer *self) {
    /* no export can outlive us: every view holds a reference */
    if (self->mapped)
        munmap(self->ptr, (size_t)self->len);
    else
        free(self->ptr);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int aligned_getbuffer(AlignedBuffer *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->ptr, self->len, 0, flags);
}

static Py_ssize_t aligned_length(AlignedBuffer *self) { return self->len; }

static PyObject *aligned_address(AlignedBuffer *self, void *closure) {
    (void)closure;
    return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *aligned_alignment(AlignedBuffer *self, void *closure) {
    (void)closure;
    return PyLong_FromSsize_t(self->alignment);
}

static PyObject *aligned_repr(AlignedBuffer *self) {
    return PyUnicode_FromFormat("<AlignedBuffer %zd B at %p, aligned to %zd>", self->len, self->ptr, self->alignment);
}

static PyBufferProcs aligned_as_buffer = {(getbufferproc)aligned_getbuffer, NULL};
static PySequenceMethods aligned_as_sequence = {.sq_length = (lenfunc)aligned_length};
static PyGetSetDef aligned_getset[] = {
    {"address", (getter)aligned_address, NULL, "Address of the first byte.", NULL},
    {"alignment", (getter)aligned_alignment, NULL, "The alignment asked for, in bytes.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject kvt_aligned_buffer_type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._native_io.AlignedBuffer",
    .tp_basicsize = sizeof(AlignedBuffer),
    .tp_dealloc = (destructor)aligned_dealloc,
    .tp_repr = (reprfunc)aligned_repr,
    .tp_as_sequence = &aligned_as_sequence,
    .tp_as_buffer = &aligned_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Zero-filled, writable memory at an aligned address (wrap it with memoryview, numpy or torch).",
    .tp_getset = aligned_getset,
};

PyObject *kvt_py_alloc_aligned(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"nbytes", "alignment", NULL};
    Py_ssize_t nbytes, alignment = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|n:alloc_aligned", kwlist, &nbytes, &alignment)) return NULL;
    if (nbytes <= 0) return PyErr_Format(PyExc_ValueError, "alloc_aligned: nbytes must be positive, got %zd", nbytes);
    if (!kvt_is_pow2(alignment))
        return PyErr_Format(PyExc_ValueError, "alloc_aligned: alignment must be a power of two, got %zd", alignment);
    void *ptr = NULL;
    int mapped = alignment <= sysconf(_SC_PAGESIZE);
    if (mapped) {
        /* Anonymous pages are page-aligned and zero, and untouched pages cost nothing:
           a multi-GiB host slab only becomes resident as its slots are first written. */
        ptr = mmap(NULL, (size_t)nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (ptr == MAP_FAILED) return PyErr_SetFromErrno(PyExc_MemoryError);
    } else {
        size_t align = (size_t)alignment;
        int rc = posix_memalign(&ptr, align, (size_t)nbytes);
        if (rc != 0) {
            errno = rc;
            return PyErr_SetFromErrno(PyExc_MemoryError);
        }
        memset(ptr, 0, (size_t)nbytes);
    }
    AlignedBuffer *self = PyObject_New(AlignedBuffer, &kvt_aligned_buffer_type);
    if (self == NULL) {
        if (mapped)
            munmap(ptr, (size_t)nbytes);
        else
            free(ptr);
        return NULL;
    }
    self->mapped = mapped;
    self->ptr = ptr;
    self->len = nbytes;
    self->alignment = alignment;
    return (PyObject *)self;
}
