/*
 * kvtier._native: the disk tier's hot path.
 *
 *   preadv_batch / pwritev_batch  many positional reads or writes in one call,
 *                                 spread over a small pthread pool, GIL released
 *   alloc_aligned                 a writable buffer at an aligned address (O_DIRECT)
 *   crc32c / crc32c_layers        CRC-32C (Castagnoli): the SSE4.2 crc32 instruction,
 *                                 three streams interleaved, else a slicing-by-8 table
 *   copy_regions                  many same-sized memcpys by address in one call, GIL
 *                                 released (the engine's layer-by-layer KV onboarding)
 *
 * Everything here is also written in pure Python in kvtier/tiers/native.py (the
 * fallback for a platform without a compiler); tests check the two agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#define KVT_X86 1
#include <nmmintrin.h>
#endif

/* Threads that serve one batch: the calling thread plus KVT_THREADS - 1 pool workers
 * (fewer than 32: seats are bits of an unsigned). */
#ifndef KVT_THREADS
#define KVT_THREADS 4
#endif
/* Aligned, unbounced requests are cut into pieces of at most this many bytes so that
 * one large buffer is still read by several threads. */
#ifndef KVT_PIECE
#define KVT_PIECE ((size_t)2 << 20)
#endif
/* crc32c releases the GIL only above this size: re-taking a contended GIL can cost a
 * whole switch interval (5 ms), far more than checksumming a few pages. */
#define KVT_CRC_NOGIL_BYTES ((Py_ssize_t)256 << 10)

/* ------------------------------------------------------------------------- */
/* CRC-32C                                                                    */
/* ------------------------------------------------------------------------- */

#define CRC32C_POLY 0x82f63b78u /* Castagnoli, bit-reflected */

static uint32_t crc_table[8][256]; /* slicing-by-8 */

static void crc_table_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ CRC32C_POLY : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_table[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_table[0][c & 0xff] ^ (c >> 8);
            crc_table[k][n] = c;
        }
    }
}

/* The running (pre-inverted) CRC state over len bytes: the portable path. */
static uint32_t crc_sw(uint32_t crc, const unsigned char *p, size_t len) {
    while (len && ((uintptr_t)p & 7)) {
        crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
        len--;
    }
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        w ^= crc;
        crc = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
              crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
              crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = crc_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    return crc;
}

#ifdef KVT_X86
/*
 * Hardware path (after Mark Adler's crc32c.c): the crc32 instruction has a latency of
 * three cycles and a throughput of one per cycle, so three independent streams over
 * adjacent LONG (or SHORT) byte runs keep it busy; their CRCs are then combined by
 * "shifting" the first one over the length of the others (a GF(2) matrix applied
 * through four 256-entry tables).
 */
#define CRC_LONG 8192
#define CRC_SHORT 256

static uint32_t crc_long[4][256];
static uint32_t crc_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that appends len zero bytes (len a power of two) to a CRC state. */
static void crc_zeros_op(uint32_t *even, size_t len) {
    uint32_t odd[32];
    uint32_t row = 1;
    odd[0] = CRC32C_POLY; /* one zero bit */
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four zero bits */
    do {                   /* the first square gives one zero byte, in even */
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    memcpy(even, odd, sizeof(odd));
}

static void crc_zeros(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    crc_zeros_op(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static inline uint32_t crc_shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static inline uint64_t load64(const unsigned char *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t crc, const unsigned char *p, size_t len) {
    uint64_t c0 = crc, c1, c2;
    while (len && ((uintptr_t)p & 7)) {
        c0 = _mm_crc32_u8((uint32_t)c0, *p++);
        len--;
    }
    while (len >= 3 * CRC_LONG) {
        const unsigned char *end = p + CRC_LONG;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + CRC_LONG));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_LONG));
            p += 8;
        } while (p < end);
        c0 = crc_shift(crc_long, (uint32_t)c0) ^ c1;
        c0 = crc_shift(crc_long, (uint32_t)c0) ^ c2;
        p += 2 * CRC_LONG;
        len -= 3 * CRC_LONG;
    }
    while (len >= 3 * CRC_SHORT) {
        const unsigned char *end = p + CRC_SHORT;
        c1 = c2 = 0;
        do {
            c0 = _mm_crc32_u64(c0, load64(p));
            c1 = _mm_crc32_u64(c1, load64(p + CRC_SHORT));
            c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_SHORT));
            p += 8;
        } while (p < end);
        c0 = crc_shift(crc_short, (uint32_t)c0) ^ c1;
        c0 = crc_shift(crc_short, (uint32_t)c0) ^ c2;
        p += 2 * CRC_SHORT;
        len -= 3 * CRC_SHORT;
    }
    while (len >= 8) {
        c0 = _mm_crc32_u64(c0, load64(p));
        p += 8;
        len -= 8;
    }
    while (len--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    return (uint32_t)c0;
}
#endif /* KVT_X86 */

static uint32_t (*crc_impl)(uint32_t, const unsigned char *, size_t) = crc_sw;
static const char *crc_impl_name = "table";

static void crc_init(void) {
    crc_table_init();
#ifdef KVT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("sse4.2")) {
        crc_zeros(crc_long, CRC_LONG);
        crc_zeros(crc_short, CRC_SHORT);
        crc_impl = crc_hw;
        crc_impl_name = "sse4.2";
    }
#endif
}

static inline uint32_t crc32c_value(uint32_t seed, const void *p, size_t len) {
    return ~crc_impl(~seed, (const unsigned char *)p, len);
}

/* ------------------------------------------------------------------------- */
/* Aligned buffers                                                            */
/* ------------------------------------------------------------------------- */

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

static PyTypeObject AlignedBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier._native.AlignedBuffer",
    .tp_basicsize = sizeof(AlignedBuffer),
    .tp_dealloc = (destructor)aligned_dealloc,
    .tp_repr = (reprfunc)aligned_repr,
    .tp_as_sequence = &aligned_as_sequence,
    .tp_as_buffer = &aligned_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Zero-filled, writable memory at an aligned address (wrap it with memoryview, numpy or torch).",
    .tp_getset = aligned_getset,
};

static int is_pow2(Py_ssize_t n) { return n > 0 && (n & (n - 1)) == 0; }

static PyObject *py_alloc_aligned(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"nbytes", "alignment", NULL};
    Py_ssize_t nbytes, alignment = 4096;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|n:alloc_aligned", kwlist, &nbytes, &alignment)) return NULL;
    if (nbytes <= 0) return PyErr_Format(PyExc_ValueError, "alloc_aligned: nbytes must be positive, got %zd", nbytes);
    if (!is_pow2(alignment))
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
    AlignedBuffer *self = PyObject_New(AlignedBuffer, &AlignedBufferType);
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

/* ------------------------------------------------------------------------- */
/* Batched positional I/O over a thread pool                                  */
/* ------------------------------------------------------------------------- */

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
    for (size_t k = 0; k < b->item_len[item] / lb; k++) out[k] = crc32c_value(0, p + k * lb, lb);
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
    if (!is_pow2(align))
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

static PyObject *py_preadv_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(0, 0, args, kw);
}

static PyObject *py_pwritev_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(1, 0, args, kw);
}

static PyObject *py_preadv_crc32c_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(0, 1, args, kw);
}

static PyObject *py_pwritev_crc32c_batch(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return batch_io(1, 1, args, kw);
}

/* ------------------------------------------------------------------------- */
/* CRC-32C entry points                                                       */
/* ------------------------------------------------------------------------- */

static PyObject *crc_entry(PyObject *args, PyObject *kw, uint32_t (*impl)(uint32_t, const unsigned char *, size_t),
                           const char *fmt) {
    static char *kwlist[] = {"buffer", "seed", NULL};
    Py_buffer view;
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &view, &seed)) return NULL;
    if (seed > 0xffffffffULL) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "crc32c: seed must fit in 32 bits, got %llu", seed);
    }
    uint32_t crc;
    if (view.len >= KVT_CRC_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS crc = ~impl(~(uint32_t)seed, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = ~impl(~(uint32_t)seed, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static uint32_t crc_dispatch(uint32_t crc, const unsigned char *p, size_t len) { return crc_impl(crc, p, len); }

static PyObject *py_crc32c(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return crc_entry(args, kw, crc_dispatch, "y*|K:crc32c");
}

static PyObject *py_crc32c_portable(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return crc_entry(args, kw, crc_sw, "y*|K:_crc32c_portable");
}

static PyObject *py_crc32c_layers(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"buffer", "layer_bytes", NULL};
    Py_buffer view;
    Py_ssize_t lb;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*n:crc32c_layers", kwlist, &view, &lb)) return NULL;
    PyObject *result = NULL;
    uint32_t *crcs = NULL;
    if (lb <= 0 || view.len % lb != 0) {
        PyErr_Format(PyExc_ValueError, "crc32c_layers: %zd bytes are not a whole number of %zd-byte layers", view.len,
                     lb);
        goto done;
    }
    Py_ssize_t n = view.len / lb;
    crcs = PyMem_Malloc((size_t)(n + 1) * sizeof(uint32_t));
    if (crcs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *p = view.buf;
    if (view.len >= KVT_CRC_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n; i++) crcs[i] = crc32c_value(0, p + i * lb, (size_t)lb);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++) crcs[i] = crc32c_value(0, p + i * lb, (size_t)lb);
    }
    result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(crcs[i]);
        if (v == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, v);
    }
done:
    PyMem_Free(crcs);
    PyBuffer_Release(&view);
    return result;
}

/* ------------------------------------------------------------------------- */
/* Module                                                                     */
/* ------------------------------------------------------------------------- */

/* ------------------------------------------------------------------------- */
/* The block-key chain (kvtier/keys.py spells out the bytes)                  */
/* ------------------------------------------------------------------------- */

/* xxh3-128 is not reimplemented here: the xxhash package's own extension exports
   XXH3_128bits_withSeed, and bind_xxh3 looks it up there at import time, so keys
   computed here are those of the xxhash library by construction. */
typedef struct {
    uint64_t low64, high64;
} xxh128_t;
typedef xxh128_t (*xxh3_128_seeded_fn)(const void *, size_t, uint64_t);
static xxh3_128_seeded_fn g_xxh3_128 = NULL;

static PyObject *py_bind_xxh3(PyObject *mod, PyObject *arg) {
    (void)mod;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return PyErr_Format(PyExc_OSError, "bind_xxh3: %s", dlerror());
    void *sym = dlsym(lib, "XXH3_128bits_withSeed");
    if (sym == NULL) return PyErr_Format(PyExc_OSError, "bind_xxh3: %s exports no XXH3_128bits_withSeed", path);
    g_xxh3_128 = (xxh3_128_seeded_fn)sym; /* the library stays loaded: Python holds it too */
    Py_RETURN_NONE;
}

static void put_be64(unsigned char *out, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) out[i] = (unsigned char)(v & 0xff);
}

static PyObject *py_xxh3_128_chain(PyObject *mod, PyObject *args) {
    (void)mod;
    Py_buffer root, body;
    Py_ssize_t block_bytes;
    unsigned long long seed;
    if (g_xxh3_128 == NULL) return PyErr_Format(PyExc_RuntimeError, "xxh3_128_chain: call bind_xxh3 first");
    if (!PyArg_ParseTuple(args, "y*y*nK:xxh3_128_chain", &root, &body, &block_bytes, &seed)) return NULL;
    PyObject *out = NULL;
    if (root.len != 16 || block_bytes <= 0 || body.len % block_bytes) {
        PyErr_Format(PyExc_ValueError, "xxh3_128_chain: root must be 16 bytes and the body whole blocks of %zd",
                     block_bytes);
        goto done;
    }
    Py_ssize_t n = body.len / block_bytes;
    unsigned char *digests = malloc((size_t)(n * 16 + 16 + block_bytes));
    if (digests == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *buf = digests + n * 16; /* prev key || block, rebuilt per block */
    const unsigned char *src = body.buf;
    Py_BEGIN_ALLOW_THREADS
    memcpy(buf, root.buf, 16);
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf + 16, src + i * block_bytes, (size_t)block_bytes);
        xxh128_t h = g_xxh3_128(buf, (size_t)(16 + block_bytes), (uint64_t)seed);
        put_be64(buf, h.high64); /* the canonical digest: high half first, big-endian */
        put_be64(buf + 8, h.low64);
        memcpy(digests + i * 16, buf, 16);
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)digests + i * 16, 16);
        if (key == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, key);
    }
    free(digests);
done:
    PyBuffer_Release(&root);
    PyBuffer_Release(&body);
    return out;
}

/* ------------------------------------------------------------------------- */
/* copy_regions: the engine's layer-wise host -> pool copies                  */
/* ------------------------------------------------------------------------- */

static PyObject *py_copy_regions(PyObject *mod, PyObject *args) {
    (void)mod;
    Py_buffer dst, src;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "y*y*n:copy_regions", &dst, &src, &nbytes)) return NULL;
    PyObject *out = NULL;
    if (dst.len != src.len || dst.len % (Py_ssize_t)sizeof(uint64_t) || nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_regions: two int64 address arrays of one length, nbytes >= 0");
        goto done;
    }
    size_t n = (size_t)dst.len / sizeof(uint64_t);
    const uint64_t *d = dst.buf, *s = src.buf;
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)nbytes);
    Py_END_ALLOW_THREADS
    out = PyLong_FromSize_t(n);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return out;
}

static PyMethodDef methods[] = {
    {"preadv_batch", (PyCFunction)(void (*)(void))py_preadv_batch, METH_VARARGS | METH_KEYWORDS,
     "preadv_batch(fd, buffers, offsets, bounce=None, align=4096) -> list[int]\n\n"
     "Fill each writable buffer from its file offset (fd: one int or one per buffer), in parallel, "
     "without the GIL. Returns the bytes read per buffer: less than its length only at end of file. "
     "With a bounce buffer, requests whose address, length or offset is not a multiple of align are "
     "read through it (O_DIRECT needs all three aligned). Errors raise OSError with the first errno."},
    {"pwritev_batch", (PyCFunction)(void (*)(void))py_pwritev_batch, METH_VARARGS | METH_KEYWORDS,
     "pwritev_batch(fd, buffers, offsets, bounce=None, align=4096) -> int\n\n"
     "Write each buffer whole at its file offset, in parallel, without the GIL; returns the bytes "
     "written. Unaligned requests go through the bounce buffer when one is given: the partial blocks "
     "at their edges are read first and written back whole (buffers of one call must not share such "
     "a block). Errors raise OSError with the first errno."},
    {"preadv_crc32c_batch", (PyCFunction)(void (*)(void))py_preadv_crc32c_batch, METH_VARARGS | METH_KEYWORDS,
     "preadv_crc32c_batch(fd, buffers, offsets, layer_bytes, bounce=None, align=4096)\n"
     "-> tuple[list[int], list[list[int]]]\n\n"
     "preadv_batch, plus each buffer's CRC-32C per layer_bytes run (every buffer a whole number of "
     "layers), computed by the I/O threads while the bytes are still in cache."},
    {"pwritev_crc32c_batch", (PyCFunction)(void (*)(void))py_pwritev_crc32c_batch, METH_VARARGS | METH_KEYWORDS,
     "pwritev_crc32c_batch(fd, buffers, offsets, layer_bytes, bounce=None, align=4096) -> list[list[int]]\n\n"
     "pwritev_batch, returning each buffer's CRC-32C per layer_bytes run instead of the byte count."},
    {"alloc_aligned", (PyCFunction)(void (*)(void))py_alloc_aligned, METH_VARARGS | METH_KEYWORDS,
     "alloc_aligned(nbytes, alignment=4096) -> AlignedBuffer\n\nZero-filled writable memory at an aligned address."},
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(buffer, seed=0) -> int\n\nCRC-32C of the buffer; seed is a previous result to continue from."},
    {"crc32c_layers", (PyCFunction)(void (*)(void))py_crc32c_layers, METH_VARARGS | METH_KEYWORDS,
     "crc32c_layers(buffer, layer_bytes) -> list[int]\n\nCRC-32C of each consecutive layer_bytes run."},
    {"_crc32c_portable", (PyCFunction)(void (*)(void))py_crc32c_portable, METH_VARARGS | METH_KEYWORDS,
     "The table-driven CRC-32C that runs where SSE4.2 does not (tests compare it with crc32c)."},
    {"bind_xxh3", (PyCFunction)py_bind_xxh3, METH_O,
     "bind_xxh3(path) -> None\n\nFind XXH3_128bits_withSeed in the xxhash extension at path."},
    {"xxh3_128_chain", (PyCFunction)py_xxh3_128_chain, METH_VARARGS,
     "xxh3_128_chain(root, body, block_bytes, seed) -> list[bytes]\n\n"
     "Chained keys: key(i) = xxh3_128(key(i-1) || block i of body, seed), key(-1) = root; "
     "the hashing runs without the GIL."},
    {"copy_regions", (PyCFunction)py_copy_regions, METH_VARARGS,
     "copy_regions(dst_addrs, src_addrs, nbytes) -> int\n\n"
     "memcpy(dst_addrs[i], src_addrs[i], nbytes) for each i of two int64 address arrays, without the "
     "GIL; returns how many. The addresses are trusted: the caller owns both sides and keeps them alive."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvtier._native", "The disk tier's hot path in C (see native/README.md).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    static int once = 0;
    if (!once) {
        crc_init();
        pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
        once = 1;
    }
    if (PyType_Ready(&AlignedBufferType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&AlignedBufferType);
    if (PyModule_AddObject(m, "AlignedBuffer", (PyObject *)&AlignedBufferType) < 0 ||
        PyModule_AddIntConstant(m, "THREADS", KVT_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "PIECE_BYTES", (long)KVT_PIECE) < 0 ||
        PyModule_AddStringConstant(m, "CRC32C_IMPL", crc_impl_name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
