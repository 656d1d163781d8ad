/*
 * kvtier._native: the disk tier's hot path, the block-key chain and the engine's
 * decode attention (kvtier_quant.c and kvtier_prefill.c add the rest of the module).
 *
 *   preadv_batch / pwritev_batch  many positional reads or writes in one call,
 *                                 spread over a small pthread pool, GIL released
 *   alloc_aligned                 a writable buffer at an aligned address (O_DIRECT)
 *   crc32c / crc32c_layers        CRC-32C (Castagnoli): the SSE4.2 crc32 instruction,
 *                                 three streams interleaved, else a slicing-by-8 table
 *   bind_xxh3 / xxh3_128_chain    the chained block keys of kvtier/keys.py, calling the
 *                                 xxhash package's own xxh3-128, GIL released
 *   copy_regions                  many same-sized memcpys by address in one call, GIL
 *                                 released (the engine's layer-by-layer KV onboarding)
 *   paged_decode_attention        decode attention read in place from the paged pool
 *   kvt_team_run                  the sleeping worker team the kernels share
 *
 * The disk tier's functions and copy_regions are also written in pure Python in
 * kvtier/tiers/native.py (the fallback for a platform without a compiler); tests check
 * the two agree. The key chain falls back to a Python loop in kvtier/keys.py, the
 * attention kernels to torch (kvtier/engine/kernels.py).
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
#include <time.h>
#include <unistd.h>

#include "kvtier_float.h"
#include "kvtier_native.h"

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

/* ------------------------------------------------------------------------- */
/* paged_decode_attention: the engine's decode attention, read in place       */
/* ------------------------------------------------------------------------- */

/*
 * One new token per sequence attends to its cached positions, which lie in the
 * sequence's pool blocks (a layer's pool is [blocks, 2 (K, V), kv_heads, block, dim]).
 * Each (sequence, KV head) pair walks its blocks straight in the pool: the scores of
 * the group's query heads against one block, an online (streaming) softmax over the
 * blocks in float32, and V accumulated under it. Nothing is gathered: at context
 * 2,048 the K/V of one layer are megabytes, so what decode costs is reading them
 * once, not copying them first.
 *
 * Work is cut into units of (sequence, KV head, run of blocks) so that even a single
 * sequence with three KV heads keeps two threads busy; each unit leaves an
 * unnormalised partial (its running max, sum and V accumulator per query head) and
 * the calling thread merges a pair's partials at the end, as flash-decoding does.
 * Units are claimed from a shared counter, so a worker that wakes late just claims
 * fewer of them.
 *
 * A unit runs one of three builds, chosen once with __builtin_cpu_supports: AVX-512
 * intrinsics (attn512_body); AVX2+FMA intrinsics (attn256_body, the same plan at 8
 * lanes); or one portable C body written for the auto-vectoriser (partial sums as wide
 * as a vector, so a dot product needs no reassociation; exp as a polynomial, since
 * libm's expf does not vectorise without -ffast-math), compiled for the base ISA (SSE2
 * on x86-64, NEON on aarch64). Nothing needs -march: the build runs on any x86-64 or
 * aarch64.
 */

#include <math.h>
#include <stddef.h>

#define ATTN_LANES 16
#define ATTN_MAX_GROUP 16
#define ATTN_MAX_DIM 256
#define ATTN_MAX_BLOCK 256
#define ATTN_MAX_THREADS 16
/* A unit covers at least this many blocks: below it, setting up and merging a
 * partial costs more than the blocks it spreads. */
#define ATTN_MIN_UNIT_BLOCKS 8
/* Each sequence is cut into about this many runs of blocks (times the KV heads),
 * enough for dynamic claiming to even out two threads. A sequence's cut depends on
 * its own length alone, never on the thread count nor on the other sequences of the
 * call, so its result is the same bits whoever computes it and whatever it is
 * batched with (prompt lookup verifies drafts as extra rows of a decode step, and
 * must get the logits a step of its own would). */
#define ATTN_TARGET_RUNS 8

typedef struct {
    int seq, head, b0, b1; /* blocks [b0, b1) of the sequence's table */
} attn_unit_t;

typedef struct {
    const char *kv;                         /* the layer's pool */
    ptrdiff_t s_block, s_kv, s_head, s_pos; /* its strides, in elements */
    int bf16;
    const char *q; /* [num_seqs, kv_heads * group, dim], the model dtype */
    char *out;     /* the same shape and dtype */
    const int32_t *tables, *starts, *lengths;
    int num_seqs, kv_heads, group, dim, block;
    float scale;
    attn_unit_t *units;
    float *parts; /* per unit: m[group], l[group], acc[group * dim] */
    size_t n_units, part_floats;
    size_t next; /* the next unclaimed unit (atomic) */
} attn_job_t;

/* Row p of a K or V tile as float32: the pool itself for float32, else converted into buf. */
static inline __attribute__((always_inline)) const float *attn_row(const char *base, ptrdiff_t off, int bf16, int dim,
                                                                   float *buf) {
    if (!bf16) return (const float *)base + off;
    const uint16_t *h = (const uint16_t *)base + off;
    for (int d = 0; d < dim; d++) buf[d] = kvt_bf16_to_f32(h[d]);
    return buf;
}

/* A dot product in `lanes` partial sums (as wide as the variant's vectors), so that it
 * vectorises without reassociating a float sum; dim is a multiple of 16. */
static inline __attribute__((always_inline)) float attn_dot(const float *a, const float *b, int dim, const int lanes) {
    float lane[ATTN_LANES] = {0};
    for (int d = 0; d < dim; d += lanes)
        for (int l = 0; l < lanes; l++) lane[l] += a[d + l] * b[d + l];
    float sum = 0.0f;
    for (int l = 0; l < lanes; l++) sum += lane[l];
    return sum;
}

/*
 * One unit: the group's query heads against blocks [b0, b1) of one sequence and KV
 * head, into part = m[G], l[G], acc[G * D] (acc not yet divided by l).
 */
static inline __attribute__((always_inline)) void attn_unit_body(const attn_job_t *j, const attn_unit_t *u,
                                                                 float *part, const int bf16,
                                                                 const int lanes) {
    const int G = j->group, D = j->dim, B = j->block;
    const int len = j->lengths[u->seq];
    const int32_t *ids = j->tables + j->starts[u->seq];
    /* Local, not in part: the compiler then knows no store to them changes K or V. */
    float m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP], acc[ATTN_MAX_GROUP * ATTN_MAX_DIM];
    float q[ATTN_MAX_GROUP * ATTN_MAX_DIM];
    float s[ATTN_MAX_GROUP][ATTN_MAX_BLOCK + ATTN_LANES];
    float kbuf[ATTN_MAX_DIM], vbuf[ATTN_MAX_DIM];
    const int BP = (B + ATTN_LANES - 1) / ATTN_LANES * ATTN_LANES;

    const size_t q_row = (size_t)(u->seq * j->kv_heads + u->head) * G * D; /* query heads head*G .. head*G+G-1 */
    for (int i = 0; i < G * D; i++)
        q[i] = (bf16 ? kvt_bf16_to_f32(((const uint16_t *)j->q)[q_row + i]) : ((const float *)j->q)[q_row + i]) * j->scale;
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);

    for (int b = u->b0; b < u->b1; b++) {
        const int n = len - b * B < B ? len - b * B : B;
        const ptrdiff_t k_off = (ptrdiff_t)ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head;
        const ptrdiff_t v_off = k_off + j->s_kv;
        if (b + 1 < u->b1) { /* the next block is anywhere in the pool: start fetching it */
            const char *nk = j->kv + ((ptrdiff_t)ids[b + 1] * j->s_block + (ptrdiff_t)u->head * j->s_head) * (bf16 ? 2 : 4);
            __builtin_prefetch(nk);
            __builtin_prefetch(nk + j->s_kv * (bf16 ? 2 : 4));
        }
        for (int p = 0; p < n; p++) {
            const float *k = attn_row(j->kv, k_off + p * j->s_pos, bf16, D, kbuf);
            for (int g = 0; g < G; g++) s[g][p] = attn_dot(q + g * D, k, D, lanes);
        }
        for (int g = 0; g < G; g++) {
            float *sg = s[g];
            for (int p = n; p < BP; p++) sg[p] = -INFINITY;
            float lane[ATTN_LANES];
            for (int i = 0; i < ATTN_LANES; i++) lane[i] = sg[i];
            for (int p = ATTN_LANES; p < BP; p += ATTN_LANES)
                for (int i = 0; i < ATTN_LANES; i++) lane[i] = sg[p + i] > lane[i] ? sg[p + i] : lane[i];
            float mx = m[g];
            for (int i = 0; i < ATTN_LANES; i++) mx = lane[i] > mx ? lane[i] : mx;
            float sum = 0.0f;
            for (int p = 0; p < BP; p++) sg[p] = kvt_exp(sg[p] - mx);
            for (int p = n; p < BP; p++) sg[p] = 0.0f;
            for (int p = 0; p < n; p++) sum += sg[p];
            if (mx > m[g]) {
                const float c = kvt_exp(m[g] - mx);
                float *a = acc + g * D;
                for (int d = 0; d < D; d++) a[d] *= c;
                l[g] *= c;
                m[g] = mx;
            }
            l[g] += sum;
        }
        for (int p = 0; p < n; p++) {
            const float *v = attn_row(j->kv, v_off + p * j->s_pos, bf16, D, vbuf);
            for (int g = 0; g < G; g++) {
                const float w = s[g][p];
                float *a = acc + g * D;
                for (int d = 0; d < D; d++) a[d] += w * v[d];
            }
        }
    }
    memcpy(part, m, sizeof(float) * (size_t)G);
    memcpy(part + G, l, sizeof(float) * (size_t)G);
    memcpy(part + 2 * G, acc, sizeof(float) * (size_t)G * D);
}

#define ATTN_VARIANT(name, attr, lanes)                                                             \
    attr static void name(const attn_job_t *j, const attn_unit_t *u, float *part) {                \
        if (j->bf16) attn_unit_body(j, u, part, 1, lanes);                                          \
        else attn_unit_body(j, u, part, 0, lanes);                                                  \
    }

ATTN_VARIANT(attn_unit_base, , 4)
#ifdef KVT_X86
/*
 * The AVX-512 unit, by hand: the auto-vectorised body above reduces every dot product
 * on its own, through the stack. Here a tile of 16 positions is scored as 16 vector
 * products folded into one vector of 16 scores (attn512_scores), the tile's softmax
 * weights are one vector, and V is accumulated in registers, four heads per V row. nv
 * (head_dim / 16) is a constant in the common instantiations (4 and 8: head_dim 64
 * and 128), so the accumulators stay in registers and row offsets are immediates.
 * It runs about as fast from L2 as from L3, so it is bound by instructions more than
 * by memory: that is why bfloat16 rows are split rather than widened with vpmovzxwd
 * (see attn512_load) and each V row is loaded once for several heads, both of which
 * measured faster than the plainer forms. From DRAM, bfloat16 gains on float32 by
 * reading half the bytes.
 */
#include <immintrin.h>

#define ATTN512 __attribute__((target("avx512f,fma")))
#define ATTN512_INLINE static inline __attribute__((always_inline)) ATTN512

/*
 * Vector v of a row that starts at element off, as float32. For float32 and for
 * bfloat16 rows whose length is not a multiple of 32 (`split` 0), elements
 * [16v, 16v + 16). For other bfloat16 rows (`split` 1), each 64-byte run of 32
 * elements gives two vectors without a shuffle: its even elements (v even: each
 * 32-bit word shifted left 16) and its odd ones (v odd: the high halves, masked).
 * A dot product does not care about the order as long as q is loaded the same way;
 * the V accumulators are put back in order at the end (attn512_unsplit).
 */
ATTN512_INLINE __m512 attn512_load(const char *base, ptrdiff_t off, int v, const int bf16, const int split) {
    if (split) {
        const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)base + off + 32 * (v >> 1)));
        return _mm512_castsi512_ps((v & 1) ? _mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u))
                                           : _mm512_slli_epi32(x, 16));
    }
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off + 16 * v));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + off + 16 * v);
}

/* Back to element order: vectors 2c and 2c + 1 hold the even and odd elements of run c. */
ATTN512_INLINE void attn512_unsplit(float *dst, const float *src, int dim) {
    for (int c = 0; c < dim; c += 32)
        for (int i = 0; i < 16; i++) {
            dst[c + 2 * i] = src[c + i];
            dst[c + 2 * i + 1] = src[c + 16 + i];
        }
}

/* The 16-lane partial products of q . K[row] (lane sums still to take). */
/*
 * The scores of one query head against a tile of nt <= 16 rows: lane p is q . K[p]
 * (0 for p >= nt). Each row's dot product is 16 partial sums; the 16 vectors are folded
 * into one as they come (pairs, then quads, then eights, then the tile: 15 shuffle-adds
 * in all), which keeps at most a dozen of them alive at once.
 */
ATTN512_INLINE __m512 attn512_pair(__m512 a, __m512 b) { /* per 128-bit lane: [a b a b], each a sum of two */
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

ATTN512_INLINE __m512 attn512_quad(__m512 a, __m512 b) { /* per 128-bit lane: the sums of rows [4i, 4i + 4) */
    const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

ATTN512_INLINE __m512 attn512_fold(__m512 a, __m512 b) { /* 128-bit lanes 0, 2 of a, b plus lanes 1, 3 */
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

ATTN512_INLINE __m512 attn512_row(const char *kv, ptrdiff_t row, const __m512 *qv, const int nv, const int bf16,
                                  const int split) {
    if (split) { /* each 64-byte load feeds two FMAs */
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
        __m512 a = _mm512_setzero_ps();
        for (int c = 0; c < nv / 2; c++) {
            const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)kv + row + 32 * c));
            a = _mm512_fmadd_ps(qv[2 * c], _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), a);
            a = _mm512_fmadd_ps(qv[2 * c + 1], _mm512_castsi512_ps(_mm512_and_si512(x, hi)), a);
        }
        return a;
    }
    __m512 a = _mm512_mul_ps(qv[0], attn512_load(kv, row, 0, bf16, 0));
    for (int v = 1; v < nv; v++) a = _mm512_fmadd_ps(qv[v], attn512_load(kv, row, v, bf16, 0), a);
    return a;
}

/* o += w * V[row], V[row] loaded as attn512_load orders it. */
ATTN512_INLINE void attn512_axpy(__m512 *o, __m512 w, const char *kv, ptrdiff_t row, const int nv, const int bf16,
                                 const int split) {
    if (split) {
        const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
        for (int c = 0; c < nv / 2; c++) {
            const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)kv + row + 32 * c));
            o[2 * c] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), o[2 * c]);
            o[2 * c + 1] = _mm512_fmadd_ps(w, _mm512_castsi512_ps(_mm512_and_si512(x, hi)), o[2 * c + 1]);
        }
        return;
    }
    for (int v = 0; v < nv; v++) o[v] = _mm512_fmadd_ps(w, attn512_load(kv, row, v, bf16, 0), o[v]);
}

/*
 * acc[h][:] = corr[h] * acc[h][:] + sum over the tile's rows p of w[h][p] * V[p] for
 * `heads` (<= 4, a constant) query heads at once: each V row is loaded once for all
 * of them, and heads * nv independent accumulators hide the FMA latency.
 */
ATTN512_INLINE void attn512_pv(float *acc, const float *w, const float *corr, const char *kv, ptrdiff_t row, int nt,
                               const int heads, const int nv, const int bf16, const int split) {
    __m512 o[4][ATTN_MAX_DIM / 16];
    for (int h = 0; h < heads; h++) {
        const __m512 c = _mm512_set1_ps(corr[h]);
        for (int v = 0; v < nv; v++) o[h][v] = _mm512_mul_ps(_mm512_load_ps(acc + h * nv * 16 + 16 * v), c);
    }
    for (int p = 0; p < nt; p++, row += nv * 16) {
        __m512 x[ATTN_MAX_DIM / 16];
        if (split) {
            const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
            for (int c = 0; c < nv / 2; c++) {
                const __m512i r = _mm512_loadu_si512((const void *)((const uint16_t *)kv + row + 32 * c));
                x[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(r, 16));
                x[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(r, hi));
            }
        } else {
            for (int v = 0; v < nv; v++) x[v] = attn512_load(kv, row, v, bf16, 0);
        }
        for (int h = 0; h < heads; h++) {
            const __m512 wp = _mm512_set1_ps(w[h * ATTN_LANES + p]);
            for (int v = 0; v < nv; v++) o[h][v] = _mm512_fmadd_ps(wp, x[v], o[h][v]);
        }
    }
    for (int h = 0; h < heads; h++)
        for (int v = 0; v < nv; v++) _mm512_store_ps(acc + h * nv * 16 + 16 * v, o[h][v]);
}

ATTN512_INLINE __m512 attn512_scores(const char *kv, ptrdiff_t k_off, ptrdiff_t s_pos, int nt, const __m512 *qv,
                                     const int nv, const int bf16, const int split) {
    __m512 quad[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512 pair[2];
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const int p = 4 * i + 2 * h;
            const __m512 a = p < nt ? attn512_row(kv, k_off + p * s_pos, qv, nv, bf16, split) : _mm512_setzero_ps();
            const __m512 b = p + 1 < nt ? attn512_row(kv, k_off + (p + 1) * s_pos, qv, nv, bf16, split)
                                        : _mm512_setzero_ps();
            pair[h] = attn512_pair(a, b);
        }
        quad[i] = attn512_quad(pair[0], pair[1]);
    }
    return attn512_fold(attn512_fold(quad[0], quad[1]), attn512_fold(quad[2], quad[3]));
}

/* kvt_exp, 16 at a time (the same polynomial; scalef puts in 2^n). */
ATTN512_INLINE __m512 attn512_exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

ATTN512_INLINE void attn512_body(const attn_job_t *j, const attn_unit_t *u, float *part, const int bf16,
                                 const int split, const int nv_const) {
    const int G = j->group, D = j->dim, B = j->block;
    const int nv = nv_const ? nv_const : D / 16;
    const int len = j->lengths[u->seq];
    const int32_t *ids = j->tables + j->starts[u->seq];
    const ptrdiff_t esize = bf16 ? 2 : 4;
    float m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP];
    float q[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(64)));
    float acc[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(64)));
    float w[ATTN_MAX_GROUP * ATTN_LANES] __attribute__((aligned(64)));
    float corr[ATTN_MAX_GROUP];

    const size_t q_row = (size_t)(u->seq * j->kv_heads + u->head) * G * D;
    for (int g = 0; g < G; g++)
        for (int v = 0; v < nv; v++)
            _mm512_store_ps(q + g * D + 16 * v, _mm512_mul_ps(attn512_load(j->q, (ptrdiff_t)q_row + g * D, v, bf16, split),
                                                              _mm512_set1_ps(j->scale)));
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);

    for (int b = u->b0; b < u->b1; b++) {
        const int n = len - b * B < B ? len - b * B : B;
        const ptrdiff_t k_off = (ptrdiff_t)ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head;
        const ptrdiff_t v_off = k_off + j->s_kv;
        if (b + 1 < u->b1) { /* the next block is anywhere in the pool: fetch its two tiles whole now */
            const char *nk = j->kv + ((ptrdiff_t)ids[b + 1] * j->s_block + (ptrdiff_t)u->head * j->s_head) * esize;
            const ptrdiff_t tile = (ptrdiff_t)(B - 1) * j->s_pos * esize + D * esize;
            for (ptrdiff_t o = 0; o < tile; o += 64) {
                _mm_prefetch(nk + o, _MM_HINT_T0);
                _mm_prefetch(nk + j->s_kv * esize + o, _MM_HINT_T0);
            }
        }
        for (int t0 = 0; t0 < n; t0 += ATTN_LANES) {
            const int nt = n - t0 < ATTN_LANES ? n - t0 : ATTN_LANES;
            const __mmask16 live = (__mmask16)((1u << nt) - 1);
            __m512 sc[ATTN_MAX_GROUP];
            for (int g = 0; g < G; g++) { /* all heads' scores first: their reductions overlap */
                __m512 qv[ATTN_MAX_DIM / 16];
                for (int v = 0; v < nv; v++) qv[v] = _mm512_load_ps(q + g * D + 16 * v);
                sc[g] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                           attn512_scores(j->kv, k_off + t0 * D, D, nt, qv, nv, bf16, split));
            }
            for (int g = 0; g < G; g++) {
                const __m512 s = sc[g];
                const float mx = _mm512_reduce_max_ps(s);
                float c = 1.0f;
                if (mx > m[g]) {
                    c = kvt_exp(m[g] - mx);
                    m[g] = mx;
                }
                const __m512 e = _mm512_maskz_mov_ps(live, attn512_exp(_mm512_sub_ps(s, _mm512_set1_ps(m[g]))));
                l[g] = l[g] * c + _mm512_reduce_add_ps(e);
                _mm512_store_ps(w + g * ATTN_LANES, e);
                corr[g] = c;
            }
            /* V, read once per row for up to four heads at a time */
            for (int g = 0; g < G; g += 4) {
                const int h = G - g < 4 ? G - g : 4;
                const ptrdiff_t row = v_off + t0 * D;
                float *ag = acc + g * D;
                const float *wg = w + g * ATTN_LANES;
                if (h == 4) attn512_pv(ag, wg, corr + g, j->kv, row, nt, 4, nv, bf16, split);
                else if (h == 3) attn512_pv(ag, wg, corr + g, j->kv, row, nt, 3, nv, bf16, split);
                else if (h == 2) attn512_pv(ag, wg, corr + g, j->kv, row, nt, 2, nv, bf16, split);
                else attn512_pv(ag, wg, corr + g, j->kv, row, nt, 1, nv, bf16, split);
            }
        }
    }
    memcpy(part, m, sizeof(float) * (size_t)G);
    memcpy(part + G, l, sizeof(float) * (size_t)G);
    if (split)
        for (int g = 0; g < G; g++) attn512_unsplit(part + 2 * G + g * D, acc + g * D, D);
    else
        memcpy(part + 2 * G, acc, sizeof(float) * (size_t)G * D);
}

ATTN512 static void attn_unit_avx512(const attn_job_t *j, const attn_unit_t *u, float *part) {
    const int nv = j->dim / 16;
    if (!j->bf16) {
        if (nv == 4) attn512_body(j, u, part, 0, 0, 4);
        else if (nv == 8) attn512_body(j, u, part, 0, 0, 8);
        else attn512_body(j, u, part, 0, 0, 0);
    } else if (j->dim % 32 == 0) {
        if (nv == 4) attn512_body(j, u, part, 1, 1, 4);
        else if (nv == 8) attn512_body(j, u, part, 1, 1, 8);
        else attn512_body(j, u, part, 1, 1, 0);
    } else {
        attn512_body(j, u, part, 1, 0, 0);
    }
}

/*
 * The AVX2 unit, by hand, for x86-64 CPUs with AVX2+FMA and no AVX-512 (AMD Zen 1-3,
 * most desktops and laptops). The auto-vectorised body reduced every dot product
 * through the stack and ran far below what the same core's memory delivers.
 * The same plan as the AVX-512 unit, at 8 lanes: a tile of up to 16 positions is
 * scored as two vectors of 8, each folded from 8 rows' partial sums by a hadd tree
 * (attn256_scores, q held in registers); its softmax weights are two vectors; and V is
 * accumulated in registers, 16 columns of up to 4 heads at a time (8 accumulators: 12
 * of 3 heads by 32 columns spilled one to the stack, a store-forward stall per row).
 * By hand it is bound by memory again, as decode attention should be: two threads
 * read K/V near the machine's memory bandwidth.
 */
#define ATTN256 __attribute__((target("avx2,fma")))
#define ATTN256_INLINE static inline __attribute__((always_inline)) ATTN256

/* Elements [off, off + 8) of a row as float32 (bfloat16 widened: its bits are a float's top half). */
ATTN256_INLINE __m256 attn256_load(const char *base, ptrdiff_t off, const int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + off);
}

/* The 8 partial sums of q . K[row], q in registers (qv, nv vectors). */
ATTN256_INLINE __m256 attn256_row(const char *kv, ptrdiff_t row, const __m256 *qv, const int nv, const int bf16) {
    __m256 a = _mm256_mul_ps(qv[0], attn256_load(kv, row, bf16));
    for (int v = 1; v < nv; v++) a = _mm256_fmadd_ps(qv[v], attn256_load(kv, row + 8 * v, bf16), a);
    return a;
}

/* Rows p and p + 1 of a tile, hadd-ed: [a0+a1 a2+a3 b0+b1 b2+b3 | a4+a5 a6+a7 b4+b5 b6+b7]. */
ATTN256_INLINE __m256 attn256_pair(const char *kv, ptrdiff_t off, int dim, int p, int nt, const __m256 *qv,
                                   const int nv, const int bf16) {
    const __m256 a = p < nt ? attn256_row(kv, off + p * dim, qv, nv, bf16) : _mm256_setzero_ps();
    const __m256 b = p + 1 < nt ? attn256_row(kv, off + (p + 1) * dim, qv, nv, bf16) : _mm256_setzero_ps();
    return _mm256_hadd_ps(a, b);
}

/*
 * Lane p: q . K[p] for the nt <= 8 rows from off (0 for p >= nt, whose rows are not
 * read). The rows are folded as they come (pairs, then quads, then the two halves), so
 * that q's nv vectors stay in registers next to at most four partial results.
 */
ATTN256_INLINE __m256 attn256_scores(const char *kv, ptrdiff_t off, int dim, int nt, const __m256 *qv, const int nv,
                                     const int bf16) {
    /* hadd of two pairs gives each of four rows' sums over its lanes 0-3 (low half) and 4-7 (high half) */
    const __m256 lo = _mm256_hadd_ps(attn256_pair(kv, off, dim, 0, nt, qv, nv, bf16),
                                     attn256_pair(kv, off, dim, 2, nt, qv, nv, bf16));
    const __m256 hi = _mm256_hadd_ps(attn256_pair(kv, off, dim, 4, nt, qv, nv, bf16),
                                     attn256_pair(kv, off, dim, 6, nt, qv, nv, bf16));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

ATTN256_INLINE float attn256_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

ATTN256_INLINE float attn256_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/*
 * acc[h][:] = corr[h] * acc[h][:] + sum over the tile's nt rows p of w[h][p] * V[p] for
 * `heads` (a constant, <= 4) query heads, 16 columns at a time: heads * 2 accumulators
 * stay in registers while each row's two vectors are loaded once for all the heads.
 */
ATTN256_INLINE void attn256_pv(float *acc, const float *w, const float *corr, const char *kv, ptrdiff_t row, int nt,
                               int dim, const int nv, const int heads, const int bf16) {
    for (int c = 0; c < nv; c += 2) { /* nv is even: head_dim is a multiple of 16 */
        __m256 o[4][2];
        for (int h = 0; h < heads; h++) {
            const __m256 k = _mm256_set1_ps(corr[h]);
            for (int i = 0; i < 2; i++) o[h][i] = _mm256_mul_ps(_mm256_load_ps(acc + h * dim + 8 * (c + i)), k);
        }
        for (int p = 0; p < nt; p++) {
            const __m256 x0 = attn256_load(kv, row + p * dim + 8 * c, bf16);
            const __m256 x1 = attn256_load(kv, row + p * dim + 8 * c + 8, bf16);
            for (int h = 0; h < heads; h++) {
                const __m256 wp = _mm256_broadcast_ss(w + 16 * h + p);
                o[h][0] = _mm256_fmadd_ps(wp, x0, o[h][0]);
                o[h][1] = _mm256_fmadd_ps(wp, x1, o[h][1]);
            }
        }
        for (int h = 0; h < heads; h++)
            for (int i = 0; i < 2; i++) _mm256_store_ps(acc + h * dim + 8 * (c + i), o[h][i]);
    }
}

ATTN256_INLINE void attn256_body(const attn_job_t *j, const attn_unit_t *u, float *part, const int bf16,
                                 const int nv_const) {
    const int G = j->group, D = j->dim, B = j->block;
    const int nv = nv_const ? nv_const : D / 8;
    const int len = j->lengths[u->seq];
    const int32_t *ids = j->tables + j->starts[u->seq];
    const ptrdiff_t esize = bf16 ? 2 : 4;
    float m[ATTN_MAX_GROUP], l[ATTN_MAX_GROUP], corr[ATTN_MAX_GROUP];
    float q[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(32)));
    float acc[ATTN_MAX_GROUP * ATTN_MAX_DIM] __attribute__((aligned(32)));
    float w[ATTN_MAX_GROUP * 16] __attribute__((aligned(32))); /* head g's tile weights at w[16 g] */
    __m256 sc[ATTN_MAX_GROUP][2];

    const size_t q_row = (size_t)(u->seq * j->kv_heads + u->head) * G * D;
    const __m256 scale = _mm256_set1_ps(j->scale);
    for (int i = 0; i < G * D; i += 8)
        _mm256_store_ps(q + i, _mm256_mul_ps(attn256_load(j->q, (ptrdiff_t)(q_row + i), bf16), scale));
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)G * D);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);

    for (int b = u->b0; b < u->b1; b++) {
        const int n = len - b * B < B ? len - b * B : B;
        const ptrdiff_t k_off = (ptrdiff_t)ids[b] * j->s_block + (ptrdiff_t)u->head * j->s_head;
        const ptrdiff_t v_off = k_off + j->s_kv;
        if (b + 1 < u->b1) { /* the next block is anywhere in the pool: fetch its two tiles whole now */
            const char *nk = j->kv + ((ptrdiff_t)ids[b + 1] * j->s_block + (ptrdiff_t)u->head * j->s_head) * esize;
            const ptrdiff_t tile = (ptrdiff_t)B * D * esize;
            for (ptrdiff_t o = 0; o < tile; o += 64) {
                _mm_prefetch(nk + o, _MM_HINT_T0);
                _mm_prefetch(nk + j->s_kv * esize + o, _MM_HINT_T0);
            }
        }
        for (int t0 = 0; t0 < n; t0 += 16) {
            const int nt = n - t0 < 16 ? n - t0 : 16;
            const int n0 = nt < 8 ? nt : 8, n1 = nt - n0;
            const __m256 live0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n0), iota));
            const __m256 live1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n1), iota));
            const ptrdiff_t krow = k_off + (ptrdiff_t)t0 * D;
            for (int g = 0; g < G; g++) { /* all heads' scores first: their reductions overlap */
                __m256 qv[ATTN_MAX_DIM / 8];
                for (int v = 0; v < nv; v++) qv[v] = _mm256_load_ps(q + g * D + 8 * v);
                sc[g][0] = _mm256_blendv_ps(ninf, attn256_scores(j->kv, krow, D, n0, qv, nv, bf16), live0);
                sc[g][1] = n1 > 0 ? _mm256_blendv_ps(ninf, attn256_scores(j->kv, krow + 8 * D, D, n1, qv, nv, bf16), live1)
                                  : ninf;
            }
            for (int g = 0; g < G; g++) {
                const float mx = attn256_hmax(_mm256_max_ps(sc[g][0], sc[g][1]));
                float c = 1.0f;
                if (mx > m[g]) {
                    c = kvt_exp(m[g] - mx);
                    m[g] = mx;
                }
                const __m256 mg = _mm256_set1_ps(m[g]);
                const __m256 e0 = _mm256_and_ps(live0, kvt_exp256(_mm256_sub_ps(sc[g][0], mg)));
                const __m256 e1 = _mm256_and_ps(live1, kvt_exp256(_mm256_sub_ps(sc[g][1], mg)));
                l[g] = l[g] * c + attn256_hsum(_mm256_add_ps(e0, e1));
                _mm256_store_ps(w + 16 * g, e0);
                _mm256_store_ps(w + 16 * g + 8, e1);
                corr[g] = c;
            }
            const ptrdiff_t vrow = v_off + (ptrdiff_t)t0 * D;
            for (int g = 0; g < G; g += 4) {
                const int h = G - g < 4 ? G - g : 4;
                float *ag = acc + g * D;
                const float *wg = w + 16 * g;
                if (h == 4) attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 4, bf16);
                else if (h == 3) attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 3, bf16);
                else if (h == 2) attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 2, bf16);
                else attn256_pv(ag, wg, corr + g, j->kv, vrow, nt, D, nv, 1, bf16);
            }
        }
    }
    memcpy(part, m, sizeof(float) * (size_t)G);
    memcpy(part + G, l, sizeof(float) * (size_t)G);
    memcpy(part + 2 * G, acc, sizeof(float) * (size_t)G * D);
}

ATTN256 static void attn_unit_avx2(const attn_job_t *j, const attn_unit_t *u, float *part) {
    const int nv = j->dim / 8;
    if (j->bf16) {
        if (nv == 8) attn256_body(j, u, part, 1, 8);
        else if (nv == 16) attn256_body(j, u, part, 1, 16);
        else attn256_body(j, u, part, 1, 0);
    } else {
        if (nv == 8) attn256_body(j, u, part, 0, 8);
        else if (nv == 16) attn256_body(j, u, part, 0, 16);
        else attn256_body(j, u, part, 0, 0);
    }
}
#endif

typedef void (*attn_unit_fn)(const attn_job_t *, const attn_unit_t *, float *);

/* The builds this CPU can run, best first; the first is the one paged_decode_attention uses. */
typedef struct {
    const char *name; /* first: kvt_impl_names reads it */
    attn_unit_fn fn;
} attn_impl_t;
static attn_impl_t attn_impls[3];
static int attn_n_impls = 0;

static void attn_pick(void) {
#ifdef KVT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) attn_impls[attn_n_impls++] = (attn_impl_t){"avx512", attn_unit_avx512};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        attn_impls[attn_n_impls++] = (attn_impl_t){"avx2", attn_unit_avx2};
#endif
    attn_impls[attn_n_impls++] = (attn_impl_t){"base", attn_unit_base};
}

static void attn_claim_all(attn_job_t *j, attn_unit_fn fn) {
    size_t i;
    while ((i = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->n_units)
        fn(j, &j->units[i], j->parts + i * j->part_floats);
}

/* Merge each (sequence, KV head)'s partials (units of one pair are adjacent) into out. */
static void attn_merge(const attn_job_t *j) {
    const int G = j->group, D = j->dim;
    float o[ATTN_MAX_DIM];
    size_t i = 0;
    while (i < j->n_units) {
        size_t e = i + 1;
        while (e < j->n_units && j->units[e].seq == j->units[i].seq && j->units[e].head == j->units[i].head) e++;
        for (int g = 0; g < G; g++) {
            float mx = -INFINITY, total = 0.0f;
            for (size_t k = i; k < e; k++) {
                const float mk = j->parts[k * j->part_floats + g];
                mx = mk > mx ? mk : mx;
            }
            memset(o, 0, sizeof(float) * (size_t)D);
            for (size_t k = i; k < e; k++) {
                const float *part = j->parts + k * j->part_floats;
                const float c = part[G + g] > 0.0f ? kvt_exp(part[g] - mx) : 0.0f; /* 0: a unit with no positions */
                total += c * part[G + g];
                const float *a = part + 2 * G + g * D;
                for (int d = 0; d < D; d++) o[d] += c * a[d];
            }
            const float inv = total > 0.0f ? 1.0f / total : 0.0f;
            const size_t row = ((size_t)(j->units[i].seq * j->kv_heads + j->units[i].head) * G + g) * D;
            for (int d = 0; d < D; d++) {
                if (j->bf16) ((uint16_t *)j->out)[row + d] = kvt_f32_to_bf16(o[d] * inv);
                else ((float *)j->out)[row + d] = o[d] * inv;
            }
        }
        i = e;
    }
}

/*
 * The team: workers that sleep on a condition variable between calls (the engine's
 * matmuls run in between, on the same cores: a worker spinning through them would take
 * a core from them), after watching for the next call for TEAM_WATCH_NS. One task is on offer at a time; a caller that finds another task in flight
 * runs its own alone. A task's work function claims units from a counter of its own
 * until none are left, so a worker that joins late only takes fewer. Decode attention
 * and the quantized matrix-vector products (kvtier_quant.c) share it.
 */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake, idle;
    void (*work)(void *);
    void *ctx;
    unsigned long gen; /* bumped per task, so a worker joins each one once */
    int seats;         /* workers the task still takes */
    int busy;          /* workers inside the task */
    int workers;
} team = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, 0, 0, 0, 0};

/*
 * How long a worker that just finished a task watches for the next before it sleeps.
 * A decode step calls the team ~150 times (four matrices and one attention per layer)
 * with little torch work between calls, no longer than a sleeping worker takes to
 * wake, so without the watch the second thread joined too late to pay for itself.
 * The watch ends long before a prefill's matmuls could miss the core.
 */
#define TEAM_WATCH_NS 200000

static inline void team_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static uint64_t team_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Spins, without the lock, until a task newer than `seen` is posted or the watch ends. */
static void team_watch(unsigned long seen) {
    const uint64_t end = team_now_ns() + TEAM_WATCH_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(&team.gen, __ATOMIC_ACQUIRE) != seen) return;
            team_pause();
        }
        if (team_now_ns() >= end) return;
    }
}

static void *team_worker(void *arg) {
    (void)arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&team.mu);
    for (;;) {
        if (team.gen == seen) { /* just finished one: watch for the next before sleeping */
            pthread_mutex_unlock(&team.mu);
            team_watch(seen);
            pthread_mutex_lock(&team.mu);
        }
        while (team.work == NULL || team.gen == seen || team.seats == 0) pthread_cond_wait(&team.wake, &team.mu);
        void (*work)(void *) = team.work;
        void *ctx = team.ctx;
        seen = team.gen;
        team.seats--;
        team.busy++;
        pthread_mutex_unlock(&team.mu);
        work(ctx);
        pthread_mutex_lock(&team.mu);
        if (--team.busy == 0) pthread_cond_broadcast(&team.idle);
    }
    return NULL;
}

static void team_atfork_prepare(void) { pthread_mutex_lock(&team.mu); }
static void team_atfork_parent(void) { pthread_mutex_unlock(&team.mu); }
static void team_atfork_child(void) { /* the child has no workers and no task */
    team.work = NULL;
    team.seats = team.busy = team.workers = 0;
    pthread_cond_init(&team.wake, NULL);
    pthread_cond_init(&team.idle, NULL);
    pthread_mutex_unlock(&team.mu);
}

static pthread_once_t team_once = PTHREAD_ONCE_INIT;
static void team_init(void) {
    attn_pick();
    pthread_atfork(team_atfork_prepare, team_atfork_parent, team_atfork_child);
}

/* Runs without the GIL: work(ctx) on the caller and on up to threads - 1 workers;
 * returns once all of them have left it. */
void kvt_team_run(void (*work)(void *), void *ctx, int threads) {
    pthread_once(&team_once, team_init);
    int shared = 0;
    if (threads > 1) {
        pthread_mutex_lock(&team.mu);
        if (team.work == NULL) {
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
            while (team.workers < threads - 1) {
                pthread_t t;
                if (pthread_create(&t, &attr, team_worker, NULL) != 0) break; /* the caller still does the work */
                team.workers++;
            }
            pthread_attr_destroy(&attr);
            team.work = work;
            team.ctx = ctx;
            team.seats = threads - 1;
            __atomic_add_fetch(&team.gen, 1, __ATOMIC_RELEASE); /* after the task: a watching worker then finds it whole */
            shared = 1;
            pthread_cond_broadcast(&team.wake);
        }
        pthread_mutex_unlock(&team.mu);
    }
    work(ctx);
    if (shared) {
        pthread_mutex_lock(&team.mu);
        team.work = NULL; /* a worker not yet in stays out: every unit is claimed */
        while (team.busy > 0) pthread_cond_wait(&team.idle, &team.mu);
        pthread_mutex_unlock(&team.mu);
    }
}

typedef struct {
    attn_job_t *job;
    attn_unit_fn fn;
} attn_call_t;

static void attn_work(void *ctx) {
    attn_call_t *c = ctx;
    attn_claim_all(c->job, c->fn);
}

/* Runs without the GIL; returns once every unit is done and merged. */
static void attn_run(attn_job_t *j, attn_unit_fn fn, int threads) {
    attn_call_t call = {j, fn};
    kvt_team_run(attn_work, &call, j->n_units > 1 ? threads : 1);
    attn_merge(j);
}

/* Checks the shapes and the block tables (every id a pool block, enough of them for
 * each length) before anything reads the pool; NULL and a Python error if not. */
static const char *attn_check(const attn_job_t *j, Py_ssize_t num_blocks, int threads) {
    if (j->num_seqs < 0 || j->kv_heads <= 0) return "num_seqs >= 0 and kv_heads > 0";
    if (j->group <= 0 || j->group > ATTN_MAX_GROUP) return "group (query heads per KV head) must be 1..16";
    if (j->dim <= 0 || j->dim > ATTN_MAX_DIM || j->dim % ATTN_LANES) return "head_dim must be a multiple of 16, <= 256";
    if (j->block <= 0 || j->block > ATTN_MAX_BLOCK) return "block_size must be 1..256";
    if (j->s_pos != j->dim) return "a block's rows must be contiguous (position stride == head_dim)";
    if (threads <= 0 || threads > ATTN_MAX_THREADS) return "threads must be 1..16";
    if (j->num_seqs > 0 && j->starts[0] != 0) return "starts[0] must be 0";
    for (int s = 0; s < j->num_seqs; s++) {
        const int32_t len = j->lengths[s], have = j->starts[s + 1] - j->starts[s];
        if (len < 0 || have < 0) return "lengths and block counts must not be negative";
        if (((int64_t)len + j->block - 1) / j->block > have) return "a sequence has fewer blocks than its length needs";
        for (int32_t b = j->starts[s]; b < j->starts[s + 1]; b++)
            if (j->tables[b] < 0 || j->tables[b] >= num_blocks) return "a block id is outside the pool";
    }
    return NULL;
}

/* Units of blocks, (sequence, head) pairs adjacent; with j->units NULL, only counts them. */
static size_t attn_plan_units(attn_job_t *j) {
    size_t n = 0;
    for (int s = 0; s < j->num_seqs; s++) {
        const int nb = (j->lengths[s] + j->block - 1) / j->block;
        int64_t per = (nb + ATTN_TARGET_RUNS - 1) / ATTN_TARGET_RUNS;
        per = per < ATTN_MIN_UNIT_BLOCKS ? ATTN_MIN_UNIT_BLOCKS : per;
        const int cuts = nb == 0 ? 1 : (int)((nb + per - 1) / per);
        for (int h = 0; h < j->kv_heads; h++)
            for (int c = 0; c < cuts; c++) {
                if (j->units != NULL) {
                    attn_unit_t *u = &j->units[n];
                    u->seq = s;
                    u->head = h;
                    u->b0 = (int)((int64_t)nb * c / cuts);
                    u->b1 = (int)((int64_t)nb * (c + 1) / cuts);
                }
                n++;
            }
    }
    return n;
}

static PyObject *attn_entry(PyObject *args, PyObject *kw, const char *impl) {
    static char *kwlist[] = {"kv",     "strides", "num_blocks", "bf16",      "q",          "out",   "tables",
                             "starts", "lengths", "num_seqs",   "kv_heads",  "group",      "head_dim",
                             "block_size", "scale", "threads", NULL};
    unsigned long long kv, q, out, tables, starts, lengths;
    Py_ssize_t sb, skv, sh, sp, num_blocks;
    int bf16, threads;
    attn_job_t j = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K(nnnn)npKKKKKiiiiifi:paged_decode_attention", kwlist, &kv, &sb, &skv,
                                     &sh, &sp, &num_blocks, &bf16, &q, &out, &tables, &starts, &lengths, &j.num_seqs,
                                     &j.kv_heads, &j.group, &j.dim, &j.block, &j.scale, &threads))
        return NULL;
    pthread_once(&team_once, team_init);
    attn_unit_fn fn = attn_impls[0].fn;
    if (impl != NULL) {
        fn = NULL;
        for (int i = 0; i < attn_n_impls; i++)
            if (strcmp(attn_impls[i].name, impl) == 0) fn = attn_impls[i].fn;
        if (fn == NULL) return PyErr_Format(PyExc_ValueError, "paged_decode_attention: this CPU cannot run %s", impl);
    }
    j.kv = (const char *)(uintptr_t)kv;
    j.s_block = sb;
    j.s_kv = skv;
    j.s_head = sh;
    j.s_pos = sp;
    j.bf16 = bf16;
    j.q = (const char *)(uintptr_t)q;
    j.out = (char *)(uintptr_t)out;
    j.tables = (const int32_t *)(uintptr_t)tables;
    j.starts = (const int32_t *)(uintptr_t)starts;
    j.lengths = (const int32_t *)(uintptr_t)lengths;
    const char *bad = attn_check(&j, num_blocks, threads);
    if (bad != NULL) return PyErr_Format(PyExc_ValueError, "paged_decode_attention: %s", bad);
    if (j.num_seqs == 0) Py_RETURN_NONE;
    j.n_units = attn_plan_units(&j);
    j.part_floats = (size_t)j.group * (2 + (size_t)j.dim);
    j.units = PyMem_RawMalloc(j.n_units * sizeof(attn_unit_t));
    j.parts = PyMem_RawMalloc(j.n_units * j.part_floats * sizeof(float));
    if (j.units == NULL || j.parts == NULL) {
        PyMem_RawFree(j.units);
        PyMem_RawFree(j.parts);
        return PyErr_NoMemory();
    }
    attn_plan_units(&j);
    Py_BEGIN_ALLOW_THREADS attn_run(&j, fn, threads);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(j.units);
    PyMem_RawFree(j.parts);
    Py_RETURN_NONE;
}

static PyObject *py_paged_decode_attention(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    return attn_entry(args, kw, NULL);
}

/* _paged_decode_attention_using(impl, *args): one named build, for tests. */
static PyObject *py_paged_decode_attention_using(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    const char *impl;
    if (PyTuple_GET_SIZE(args) < 1 || (impl = PyUnicode_AsUTF8(PyTuple_GET_ITEM(args, 0))) == NULL)
        return PyErr_Format(PyExc_TypeError, "_paged_decode_attention_using(impl: str, *args)");
    PyObject *rest = PyTuple_GetSlice(args, 1, PyTuple_GET_SIZE(args));
    if (rest == NULL) return NULL;
    PyObject *out = attn_entry(rest, kw, impl);
    Py_DECREF(rest);
    return out;
}

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

static PyObject *py_paged_decode_attention_impls(PyObject *mod, PyObject *arg) {
    (void)mod;
    (void)arg;
    pthread_once(&team_once, team_init);
    return kvt_impl_names(attn_impls, sizeof attn_impls[0], attn_n_impls);
}

static PyMethodDef methods[] = {
    {"quant_matvec", (PyCFunction)(void (*)(void))kvt_py_quant_matvec, METH_VARARGS | METH_KEYWORDS,
     "quant_matvec(kind, q, d, m, rows, cols, x, n, out, threads=1, impl=None) -> None\n\n"
     "out[i, r] = sum_j w[r, j] x[i, j] (float32) for the n rows of x, with w read from repacked GGUF "
     "blocks: kind 0 = Q4_1 (q: rows x cols/2 nibbles, d and m: rows x cols/32 float32), 1 = Q8_0 (q: rows x "
     "cols int8, d: rows x cols/32, m: 0). Every argument but kind, rows, cols, n, threads and impl is an "
     "address (trusted, like copy_regions'); impl picks a build by name ('base' always exists; see QUANT_IMPL)."},
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
    {"paged_decode_attention", (PyCFunction)(void (*)(void))py_paged_decode_attention, METH_VARARGS | METH_KEYWORDS,
     "paged_decode_attention(kv, strides, num_blocks, bf16, q, out, tables, starts, lengths, num_seqs, kv_heads, "
     "group, head_dim, block_size, scale, threads) -> None\n\n"
     "Decode attention read in place from a paged KV pool layer (see kvtier/engine/kernels.py, which wraps it): "
     "out[s, h] = softmax(scale * q[s, h] . K[s, h // group]) V[s, h // group] over the first lengths[s] "
     "positions of sequence s, whose blocks are tables[starts[s]:starts[s + 1]]. kv, q, out, tables, starts and "
     "lengths are addresses (trusted, like copy_regions'); strides are the layer's block, K/V, head and position "
     "strides in elements; bf16 says the pool, q and out are bfloat16 (else float32); tables, starts and lengths "
     "are int32. Block ids and counts are checked against num_blocks and the lengths; the GIL is released."},
    {"_paged_decode_attention_using", (PyCFunction)(void (*)(void))py_paged_decode_attention_using,
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
    {"paged_decode_attention_impls", (PyCFunction)py_paged_decode_attention_impls, METH_NOARGS,
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
        PyModule_AddStringConstant(m, "CRC32C_IMPL", crc_impl_name) < 0 ||
        PyModule_AddStringConstant(m, "QUANT_IMPL", kvt_quant_impl()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
