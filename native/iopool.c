/*
 * Batched positional I/O: preadv_batch / pwritev_batch and their *_crc32c_batch forms,
 * many positional reads or writes in one call, spread over a small pthread pool with
 * the GIL released; unaligned requests go through a bounce buffer for O_DIRECT.
 * native/README.md ("Batched I/O", "O_DIRECT") describes the plan.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "aligned.h"
#include "crc32c.h"
#include "iopool.h"
#include "io.h"

/* A piece of one caller buffer ("item"). */
typedef struct {
    int fd;
    char *buf;
    size_t len;
    off_t off;
    size_t item;
    int crc_due; /* set by the thread that finishes the item's last segment */
} seg_t;

/*
 * One request a thread runs start to finish: [off, off + len) of fd, made of segs
 * [seg0, seg0 + nseg), which lie back to back in the file. A plain unit is one segment
 * read or written in place; a bounced unit goes through the thread's bounce slice and
 * may gather several small segments (adjacent slots) into one larger request, which a
 * disk serves faster than many small ones under O_DIRECT.
 */
typedef struct {
    int fd, bounce;
    off_t off;
    size_t len, seg0, nseg;
} unit_t;

typedef struct batch {
    int write;
    seg_t *segs;
    unit_t *units;
    size_t n, next, done; /* units: total, claimed, finished */
    char *bounce;
    size_t slice, align; /* each seat owns bounce[seat * slice : (seat + 1) * slice] */
    unsigned seats;      /* free seats (bit mask): bounds how many threads run this batch */
    int err;             /* the first errno, 0 when none */
    Py_ssize_t *got;     /* bytes moved per item */
    size_t *left;        /* segments not yet finished, per item */
    /* The *_crc32c_batch forms: each item's CRC-32C per crc_bytes run, computed by the thread
     * that finishes its last segment, while the bytes it just moved are still in cache. */
    size_t crc_bytes;
    char **item_buf;
    size_t *item_len, *crc_at; /* crc_at: where the item's CRCs start in crcs */
    uint32_t *crcs;
    struct batch *qnext;
} batch_t;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv; /* broadcast on every change: new batch, freed seat, finished unit */
    batch_t *head, *tail;
    int workers;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0};

/* All of len at off, looping on short counts and EINTR. A read stops early only at end
 * of file (the count says so); an error returns -1 with *err set. */
static ssize_t full_io(int write, int fd, char *p, size_t len, off_t off, int *err) {
    size_t done = 0;
    while (done < len) {
        ssize_t r = write ? pwrite(fd, p + done, len - done, off + (off_t)done)
                          : pread(fd, p + done, len - done, off + (off_t)done);
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (r == 0) {
            if (!write) break;
            *err = EIO;
            return -1;
        }
        done += (size_t)r;
    }
    return (ssize_t)done;
}

/* Read one aligned block for a read-modify-write; past end of file it is zeros. */
static int read_edge(int fd, char *p, size_t align, off_t off, int *err) {
    ssize_t r = full_io(0, fd, p, align, off, err);
    if (r < 0) return -1;
    memset(p + r, 0, align - (size_t)r);
    return 0;
}

static inline size_t clamp_len(ssize_t n, size_t hi) { return n <= 0 ? 0 : (size_t)n > hi ? hi : (size_t)n; }

/*
 * A bounced unit: the aligned range covering it goes through the seat's slice. Reads
 * scatter the wanted bytes out to the segments; writes gather them in, after filling the
 * partial edge blocks from the file (read-modify-write, so neighbouring bytes are kept).
 * Returns the bytes of the unit moved, counted from its start.
 */
static ssize_t run_bounced(batch_t *b, const unit_t *u, char *slice, int *err) {
    size_t a = b->align;
    off_t start = u->off & ~(off_t)(a - 1);
    off_t end = (u->off + (off_t)u->len + (off_t)(a - 1)) & ~(off_t)(a - 1);
    size_t cover = (size_t)(end - start), head = (size_t)(u->off - start);
    const seg_t *seg = b->segs + u->seg0;
    if (!b->write) {
        ssize_t r = full_io(0, u->fd, slice, cover, start, err);
        if (r < 0) return -1;
        size_t avail = clamp_len(r - (ssize_t)head, u->len);
        for (size_t k = 0; k < u->nseg; k++) {
            size_t rel = (size_t)(seg[k].off - u->off);
            memcpy(seg[k].buf, slice + head + rel, clamp_len((ssize_t)avail - (ssize_t)rel, seg[k].len));
        }
        return (ssize_t)avail;
    }
    int tail = head + u->len != cover && (cover > a || head == 0); /* partial, and not the head block */
    if (head != 0 && read_edge(u->fd, slice, a, start, err) < 0) return -1;
    if (tail && read_edge(u->fd, slice + cover - a, a, end - (off_t)a, err) < 0) return -1;
    for (size_t k = 0; k < u->nseg; k++) memcpy(slice + head + (size_t)(seg[k].off - u->off), seg[k].buf, seg[k].len);
    if (full_io(1, u->fd, slice, cover, start, err) < 0) return -1;
    return (ssize_t)u->len;
}

static ssize_t run_unit(batch_t *b, size_t i, int seat, int *err) {
    const unit_t *u = &b->units[i];
    if (u->bounce) return run_bounced(b, u, b->bounce + (size_t)seat * b->slice, err);
    const seg_t *s = &b->segs[u->seg0];
    return full_io(b->write, u->fd, s->buf, s->len, s->off, err);
}

/* With pool.mu held: take the next unit of b and a free seat. */
static size_t claim(batch_t *b, int *seat) {
    int s = __builtin_ctz(b->seats);
    b->seats &= ~(1u << s);
    *seat = s;
    size_t i = b->next++;
    if (b->next == b->n) { /* fully handed out: leave the queue */
        batch_t **pp = &pool.head, *prev = NULL;
        while (*pp != b) {
            prev = *pp;
            pp = &(*pp)->qnext;
        }
        *pp = b->qnext;
        if (pool.tail == b) pool.tail = prev;
    }
    return i;
}

/* Count a unit's bytes per item (or its error); marks the segments whose item is now
 * complete and wants its CRCs, and says whether there is any. */
static int settle(batch_t *b, size_t i, ssize_t got, int err) {
    const unit_t *u = &b->units[i];
    int due = 0;
    if (got < 0 && b->err == 0) b->err = err;
    for (size_t k = 0; k < u->nseg; k++) {
        seg_t *s = &b->segs[u->seg0 + k];
        b->got[s->item] += (Py_ssize_t)clamp_len(got - (ssize_t)(s->off - u->off), s->len);
        s->crc_due = --b->left[s->item] == 0 && b->crcs != NULL && b->err == 0;
        due |= s->crc_due;
    }
    return due;
}

static void crc_item(batch_t *b, size_t item) {
    size_t lb = b->crc_bytes;
    const char *p = b->item_buf[item];
    uint32_t *out = b->crcs + b->crc_at[item];
    for (size_t k = 0; k < b->item_len[item] / lb; k++) out[k] = kvt_crc32c(0, p + k * lb, lb);
}

static void crc_due(batch_t *b, size_t i) {
    const unit_t *u = &b->units[i];
    for (size_t k = 0; k < u->nseg; k++)
        if (b->segs[u->seg0 + k].crc_due) crc_item(b, b->segs[u->seg0 + k].item);
}

/* With pool.mu held (released while working): run the next unit of b. Units of a failed
 * batch are skipped, not run. */
static void work_one(batch_t *b) {
    int seat, err = 0;
    size_t i = claim(b, &seat);
    int skip = b->err != 0;
    pthread_mutex_unlock(&pool.mu);
    ssize_t got = skip ? 0 : run_unit(b, i, seat, &err);
    pthread_mutex_lock(&pool.mu);
    b->seats |= 1u << seat;
    if (settle(b, i, got, err)) {
        pthread_cond_broadcast(&pool.cv); /* the seat is free for someone else meanwhile */
        pthread_mutex_unlock(&pool.mu);
        crc_due(b, i);
        pthread_mutex_lock(&pool.mu);
    }
    b->done++;
    pthread_cond_broadcast(&pool.cv);
}

static void *worker_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&pool.mu);
    for (;;) {
        batch_t *b = pool.head;
        while (b != NULL && b->seats == 0) b = b->qnext;
        if (b == NULL) {
            pthread_cond_wait(&pool.cv, &pool.mu);
            continue;
        }
        work_one(b);
    }
    return NULL;
}

/* With pool.mu held. Workers are detached and live as long as the process. */
static void start_workers(void) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.workers < KVT_THREADS - 1) {
        pthread_t t;
        if (pthread_create(&t, &attr, worker_main, NULL) != 0) break; /* the caller still does the work */
        pool.workers++;
    }
    pthread_attr_destroy(&attr);
}

/* Fork: the child has no workers and no batches in flight, whatever the parent had. */
static void atfork_prepare(void) { pthread_mutex_lock(&pool.mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&pool.mu); }
static void atfork_child(void) {
    pool.head = pool.tail = NULL;
    pool.workers = 0;
    pthread_cond_init(&pool.cv, NULL); /* the parent's waiters do not exist here */
    pthread_mutex_unlock(&pool.mu);    /* locked by this same thread in atfork_prepare */
}

void kvt_iopool_init(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

/* Runs without the GIL. The caller works on its own batch too, and returns only when
 * every unit has finished (its batch lives on its stack). */
static void run_batch(batch_t *b) {
    if (b->n == 1 || __builtin_popcount(b->seats) == 1) {
        int seat = __builtin_ctz(b->seats);
        for (size_t i = 0; i < b->n && b->err == 0; i++) {
            int err = 0;
            ssize_t got = run_unit(b, i, seat, &err);
            if (settle(b, i, got, err)) crc_due(b, i);
        }
        return;
    }
    pthread_mutex_lock(&pool.mu);
    if (pool.workers < KVT_THREADS - 1) start_workers();
    if (pool.tail) pool.tail->qnext = b;
    else pool.head = b;
    pool.tail = b;
    pthread_cond_broadcast(&pool.cv);
    while (b->done < b->n) {
        if (b->next < b->n && b->seats != 0) work_one(b);
        else pthread_cond_wait(&pool.cv, &pool.mu);
    }
    pthread_mutex_unlock(&pool.mu);
}

typedef struct {
    Py_buffer *views;
    size_t nviews;
    PyObject *fds, *bufs, *offs; /* PySequence_Fast results (fds NULL for one int fd) */
    seg_t *segs;
    unit_t *units;
    Py_ssize_t *got;
    size_t *left, *item_len, *crc_at;
    char **item_buf;
    uint32_t *crcs;
} args_t;

static void args_free(args_t *a) {
    for (size_t k = 0; k < a->nviews; k++) PyBuffer_Release(&a->views[k]);
    PyMem_Free(a->views);
    PyMem_Free(a->segs);
    PyMem_Free(a->units);
    PyMem_Free(a->got);
    PyMem_Free(a->left);
    PyMem_Free(a->item_len);
    PyMem_Free(a->crc_at);
    PyMem_Free(a->item_buf);
    PyMem_Free(a->crcs);
    Py_XDECREF(a->fds);
    Py_XDECREF(a->bufs);
    Py_XDECREF(a->offs);
}

static int aligned_to(size_t a, uintptr_t x) { return (x & (a - 1)) == 0; }

/* Segments of one item: pieces of KVT_PIECE when it needs no bounce, else pieces whose
 * aligned cover fits one bounce slice (cut at aligned file offsets). */
static size_t cut(const batch_t *b, int bounce, int fd, char *buf, size_t len, off_t off, size_t item, seg_t *out) {
    size_t n = 0, pos = 0;
    while (pos < len) {
        size_t step = KVT_PIECE;
        if (bounce) {
            off_t at = off + (off_t)pos;
            step = (size_t)((at & ~(off_t)(b->align - 1)) + (off_t)b->slice - at);
        }
        if (step > len - pos) step = len - pos;
        if (out) out[n] = (seg_t){fd, buf + pos, step, off + (off_t)pos, item, 0};
        n++;
        pos += step;
    }
    return n;
}

static int seg_order(const void *x, const void *y) {
    const seg_t *a = x, *b = y;
    if (a->fd != b->fd) return a->fd < b->fd ? -1 : 1;
    return a->off < b->off ? -1 : a->off > b->off;
}

/* Units from segments: plain ones one each; bounced ones (segs[nplain:], sorted here by
 * file and offset) gathered while they are back to back and their cover fits a slice.
 * Two bounced segments of one call must not share a block (tiers' slots never do). */
static size_t make_units(const batch_t *b, seg_t *segs, size_t nplain, size_t nsegs, unit_t *units) {
    size_t n = 0;
    for (size_t k = 0; k < nplain; k++)
        units[n++] = (unit_t){segs[k].fd, 0, segs[k].off, segs[k].len, k, 1};
    qsort(segs + nplain, nsegs - nplain, sizeof(seg_t), seg_order);
    off_t mask = ~(off_t)(b->align - 1);
    for (size_t k = nplain; k < nsegs; k++) {
        unit_t *u = n > 0 ? &units[n - 1] : NULL;
        off_t end = segs[k].off + (off_t)segs[k].len;
        if (u != NULL && u->bounce && u->fd == segs[k].fd && u->off + (off_t)u->len == segs[k].off &&
            (size_t)(((end + (off_t)b->align - 1) & mask) - (u->off & mask)) <= b->slice) {
            u->len += segs[k].len;
            u->nseg++;
        } else {
            units[n++] = (unit_t){segs[k].fd, 1, segs[k].off, segs[k].len, k, 1};
        }
    }
    return n;
}

/* One descriptor for all buffers, or one each. */
static int gather_fds(PyObject *fd_obj, Py_ssize_t count, int *fds, PyObject **seq, const char *name) {
    if (PyLong_Check(fd_obj)) {
        long fd = PyLong_AsLong(fd_obj);
        if (fd == -1 && PyErr_Occurred()) return -1;
        if (fd < 0 || fd > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: bad file descriptor %ld", name, fd);
            return -1;
        }
        for (Py_ssize_t k = 0; k < count; k++) fds[k] = (int)fd;
        return 0;
    }
    *seq = PySequence_Fast(fd_obj, "fd must be an int or a sequence of ints");
    if (*seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(*seq) != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd buffers but %zd file descriptors", name, count,
                     PySequence_Fast_GET_SIZE(*seq));
        return -1;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(*seq, k));
        if (fd == -1 && PyErr_Occurred()) return -1;
        if (fd < 0 || fd > INT32_MAX) {
            PyErr_Format(PyExc_ValueError, "%s: bad file descriptor %ld at %zd", name, fd, k);
            return -1;
        }
        fds[k] = (int)fd;
    }
    return 0;
}

/* Split the bounce buffer into one slice per seat (at most KVT_THREADS). */
static int take_bounce(batch_t *b, Py_buffer *view, PyObject *obj, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) return -1;
    if (!aligned_to(b->align, (uintptr_t)view->buf) || (size_t)view->len < b->align) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: the bounce buffer must be at least %zu B at a %zu-aligned address", name,
                     b->align, b->align);
        return -1;
    }
    size_t slices = (size_t)view->len / b->align;
    if (slices > KVT_THREADS) slices = KVT_THREADS;
    b->bounce = view->buf;
    b->slice = ((size_t)view->len / slices) & ~(b->align - 1);
    b->seats = (1u << slices) - 1;
    return 0;
}

/* Take every buffer and cut the batch into units (b->units, with per-buffer bookkeeping). */
static int gather(args_t *a, batch_t *b, PyObject *fd_obj, PyObject *bufs_obj, PyObject *offs_obj, const char *name) {
    int *fds = NULL, rc = -1;
    off_t *offs = NULL;
    char *bounced = NULL;
    a->bufs = PySequence_Fast(bufs_obj, "buffers must be a sequence of buffer objects");
    if (a->bufs == NULL) return -1;
    a->offs = PySequence_Fast(offs_obj, "offsets must be a sequence of ints");
    if (a->offs == NULL) return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(a->bufs);
    if (PySequence_Fast_GET_SIZE(a->offs) != count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd buffers but %zd offsets", name, count,
                     PySequence_Fast_GET_SIZE(a->offs));
        return -1;
    }
    size_t n1 = (size_t)count + 1;
    a->views = PyMem_Calloc(n1, sizeof(Py_buffer));
    a->got = PyMem_Calloc(n1, sizeof(Py_ssize_t));
    a->left = PyMem_Calloc(n1, sizeof(size_t));
    a->item_len = PyMem_Calloc(n1, sizeof(size_t));
    a->crc_at = PyMem_Calloc(n1, sizeof(size_t));
    a->item_buf = PyMem_Calloc(n1, sizeof(char *));
    fds = PyMem_Calloc(n1, sizeof(int));
    offs = PyMem_Calloc(n1, sizeof(off_t));
    bounced = PyMem_Calloc(n1, 1);
    if (!a->views || !a->got || !a->left || !a->item_len || !a->crc_at || !a->item_buf || !fds || !offs || !bounced) {
        PyErr_NoMemory();
        goto out;
    }
    if (gather_fds(fd_obj, count, fds, &a->fds, name) < 0) goto out;
    size_t nplain = 0, nsegs = 0, ncrcs = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        long long off = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(a->offs, k));
        if (off == -1 && PyErr_Occurred()) goto out;
        if (off < 0) {
            PyErr_Format(PyExc_ValueError, "%s: offset %zd is negative (%lld)", name, k, off);
            goto out;
        }
        offs[k] = (off_t)off;
        int flags = b->write ? PyBUF_SIMPLE : PyBUF_WRITABLE;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(a->bufs, k), &a->views[k], flags) < 0) goto out;
        a->nviews++;
        size_t len = (size_t)a->views[k].len;
        if (b->crc_bytes && len % b->crc_bytes) {
            PyErr_Format(PyExc_ValueError, "%s: buffer %zd holds %zu bytes, not a whole number of %zu-byte layers",
                         name, k, len, b->crc_bytes);
            goto out;
        }
        a->item_buf[k] = a->views[k].buf;
        a->item_len[k] = len;
        a->crc_at[k] = ncrcs;
        ncrcs += b->crc_bytes ? len / b->crc_bytes : 0;
        bounced[k] = b->bounce != NULL && !(aligned_to(b->align, (uintptr_t)a->views[k].buf) &&
                                            aligned_to(b->align, len) && aligned_to(b->align, (uintptr_t)offs[k]));
        a->left[k] = cut(b, bounced[k], fds[k], a->views[k].buf, len, offs[k], (size_t)k, NULL);
        nsegs += a->left[k];
        nplain += bounced[k] ? 0 : a->left[k];
    }
    a->segs = PyMem_Calloc(nsegs + 1, sizeof(seg_t));
    a->units = PyMem_Calloc(nsegs + 1, sizeof(unit_t));
    a->crcs = b->crc_bytes ? PyMem_Calloc(ncrcs + 1, sizeof(uint32_t)) : NULL;
    if (a->segs == NULL || a->units == NULL || (b->crc_bytes && a->crcs == NULL)) {
        PyErr_NoMemory();
        goto out;
    }
    size_t plain = 0, other = nplain; /* plain segments first, bounced ones after */
    for (Py_ssize_t k = 0; k < count; k++) {
        size_t *at = bounced[k] ? &other : &plain;
        *at += cut(b, bounced[k], fds[k], a->views[k].buf, a->item_len[k], offs[k], (size_t)k, a->segs + *at);
    }
    b->segs = a->segs;
    b->units = a->units;
    b->n = make_units(b, a->segs, nplain, nsegs, a->units);
    b->got = a->got;
    b->left = a->left;
    b->item_buf = a->item_buf;
    b->item_len = a->item_len;
    b->crc_at = a->crc_at;
    b->crcs = a->crcs;
    for (Py_ssize_t k = 0; k < count; k++)
        if (b->crcs && a->left[k] == 0) crc_item(b, (size_t)k); /* empty buffers: no layers, nothing to wait for */
    rc = 0;
out:
    PyMem_Free(fds);
    PyMem_Free(offs);
    PyMem_Free(bounced);
    return rc;
}

static PyObject *int_list(const Py_ssize_t *v, size_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t k = 0; list != NULL && k < n; k++) {
        PyObject *x = PyLong_FromSsize_t(v[k]);
        if (x == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)k, x);
    }
    return list;
}

static PyObject *crc_list(const uint32_t *v, size_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t k = 0; list != NULL && k < n; k++) {
        PyObject *x = PyLong_FromUnsignedLong(v[k]);
        if (x == NULL) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)k, x);
    }
    return list;
}

/* Per buffer, the list of its layers' CRCs. */
static PyObject *crc_lists(const args_t *a, size_t count, size_t crc_bytes) {
    PyObject *outer = PyList_New((Py_ssize_t)count);
    for (size_t k = 0; outer != NULL && k < count; k++) {
        PyObject *inner = crc_list(a->crcs + a->crc_at[k], a->item_len[k] / crc_bytes);
        if (inner == NULL) Py_CLEAR(outer);
        else PyList_SET_ITEM(outer, (Py_ssize_t)k, inner);
    }
    return outer;
}

static PyObject *batch_result(const args_t *a, const batch_t *b) {
    size_t count = (size_t)PySequence_Fast_GET_SIZE(a->bufs);
    if (b->write && !b->crc_bytes) {
        Py_ssize_t total = 0;
        for (size_t k = 0; k < count; k++) total += a->got[k];
        return PyLong_FromSsize_t(total);
    }
    if (b->write) return crc_lists(a, count, b->crc_bytes);
    if (!b->crc_bytes) return int_list(a->got, count);
    PyObject *got = int_list(a->got, count), *crcs = got ? crc_lists(a, count, b->crc_bytes) : NULL;
    PyObject *pair = crcs ? PyTuple_Pack(2, got, crcs) : NULL;
    Py_XDECREF(got);
    Py_XDECREF(crcs);
    return pair;
}

/* The four batch entry points: read or write, with or without per-layer CRCs. */
static PyObject *batch_io(int write, int with_crc, PyObject *args, PyObject *kw) {
    static char *plain_kw[] = {"fd", "buffers", "offsets", "bounce", "align", NULL};
    static char *crc_kw[] = {"fd", "buffers", "offsets", "layer_bytes", "bounce", "align", NULL};
    static const char *names[2][2] = {{"preadv_batch", "preadv_crc32c_batch"},
                                      {"pwritev_batch", "pwritev_crc32c_batch"}};
    const char *name = names[write][with_crc];
    PyObject *fd_obj, *bufs_obj, *offs_obj, *bounce_obj = Py_None, *result = NULL;
    Py_ssize_t align = 4096, layer_bytes = 0;
    char fmt[48];
    int ok;
    if (with_crc) {
        PyOS_snprintf(fmt, sizeof(fmt), "OOOn|On:%s", name);
        ok = PyArg_ParseTupleAndKeywords(args, kw, fmt, crc_kw, &fd_obj, &bufs_obj, &offs_obj, &layer_bytes,
                                         &bounce_obj, &align);
    } else {
        PyOS_snprintf(fmt, sizeof(fmt), "OOO|On:%s", name);
        ok = PyArg_ParseTupleAndKeywords(args, kw, fmt, plain_kw, &fd_obj, &bufs_obj, &offs_obj, &bounce_obj, &align);
    }
    if (!ok) return NULL;
    if (!kvt_is_pow2(align))
        return PyErr_Format(PyExc_ValueError, "%s: align must be a power of two, got %zd", name, align);
    if (with_crc && layer_bytes <= 0)
        return PyErr_Format(PyExc_ValueError, "%s: layer_bytes must be positive, got %zd", name, layer_bytes);

    args_t a = {0};
    batch_t b = {0};
    Py_buffer bounce_view = {0};
    b.write = write;
    b.align = (size_t)align;
    b.crc_bytes = (size_t)layer_bytes;
    b.seats = (1u << KVT_THREADS) - 1;
    int have_bounce = bounce_obj != Py_None;
    if (have_bounce && take_bounce(&b, &bounce_view, bounce_obj, name) < 0) {
        have_bounce = 0;
        goto done;
    }
    if (gather(&a, &b, fd_obj, bufs_obj, offs_obj, name) < 0) goto done;
    if (b.n > 0) {
        Py_BEGIN_ALLOW_THREADS run_batch(&b);
        Py_END_ALLOW_THREADS
    }
    if (b.err != 0) {
        errno = b.err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        result = batch_result(&a, &b);
    }
done:
    if (have_bounce) PyBuffer_Release(&bounce_view);
    args_free(&a);
    return result;
}

PyObject *kvt_py_preadv_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(0, 0, args, kw);
}

PyObject *kvt_py_pwritev_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(1, 0, args, kw);
}

PyObject *kvt_py_preadv_crc32c_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(0, 1, args, kw);
}

PyObject *kvt_py_pwritev_crc32c_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(1, 1, args, kw);
}
