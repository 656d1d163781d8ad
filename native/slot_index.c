/*
 * SlotIndex: the disk tier's in-memory index, by slot, in flat arrays.
 *
 * The disk tier answers every lookup from memory and must hold one entry per
 * indexed block, so its per-block cost is what a node with a terabyte of NVMe
 * pays millions of times. As Python objects (a dict slot, the key, an entry,
 * a record, a digest, the parent key, an OrderedDict node) a block cost over
 * 500 bytes and a start-up made ten million objects one at a time. Here a
 * block is its 16-byte key, its record's bytes as the LMDB index stores them,
 * two links of a recency list and a flag, each in an array by slot, plus a
 * uint32 in an open-addressing table from key to slot: about 100 bytes for a
 * one-layer record, and a start-up that copies the records in and builds the
 * table in one pass.
 *
 * The arrays are sized by capacity but come from calloc, so the pages of
 * slots never used are never touched (nor resident).
 *
 * The table: linear probing over a power of two at least 1.5x the capacity,
 * each entry slot + 1 (0: empty), deletion by backward shift (no tombstones).
 * Block keys are keyed hashes, uniform already; the probe start mixes their
 * two halves anyway.
 *
 * The recency list: a circular doubly linked list over slots with a sentinel
 * node at index `capacity`, for the LRU policy to rank by
 * (kvtier/policy/lru.py), which would otherwise hold every key again as an
 * object of its own. The policy decides who is on it: `enter` links a block
 * at the most recent end, `touch` moves a linked one there, `leave` unlinks
 * one; the index only unlinks a block it drops, so the list never names a
 * slot the index does not hold.
 *
 * Every method runs with the GIL held and calls no Python code while it
 * changes anything, so each is atomic to other Python threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "io.h"

#define KEY 16

typedef struct {
    PyObject_HEAD
    Py_ssize_t cap;
    Py_ssize_t rec;
    Py_ssize_t count;   /* blocks indexed */
    Py_ssize_t linked;  /* of them, on the recency list */
    uint64_t mask;
    uint32_t *table;
    uint8_t *keys;
    uint8_t *recs;
    int32_t *prev;
    int32_t *next;
    uint8_t *used; /* per slot: FREE, INDEXED or LINKED (indexed and on the recency list) */
} SlotIndex;

enum { FREE = 0, INDEXED = 1, LINKED = 2 };

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint64_t home(const SlotIndex *s, const uint8_t *key) {
    uint64_t h = (load64(key) ^ load64(key + 8)) * 0x9E3779B97F4A7C15ull;
    return (h >> 17) & s->mask;
}

/* The table position holding `key`, or -1. */
static int64_t probe(const SlotIndex *s, const uint8_t *key) {
    for (uint64_t i = home(s, key);; i = (i + 1) & s->mask) {
        uint32_t v = s->table[i];
        if (v == 0) return -1;
        if (memcmp(s->keys + (size_t)(v - 1) * KEY, key, KEY) == 0) return (int64_t)i;
    }
}

static void table_add(SlotIndex *s, int32_t slot) {
    uint64_t i = home(s, s->keys + (size_t)slot * KEY);
    while (s->table[i] != 0) i = (i + 1) & s->mask;
    s->table[i] = (uint32_t)slot + 1;
}

/* Empty table position `i`, shifting back the entries after it that probed past it. */
static void table_del(SlotIndex *s, uint64_t i) {
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & s->mask;
        uint32_t v = s->table[j];
        if (v == 0) break;
        uint64_t k = home(s, s->keys + (size_t)(v - 1) * KEY);
        /* v may move to i only if its home is not cyclically inside (i, j]. */
        int inside = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!inside) {
            s->table[i] = v;
            i = j;
        }
    }
    s->table[i] = 0;
}

static inline void unlink_slot(SlotIndex *s, int32_t slot) {
    s->next[s->prev[slot]] = s->next[slot];
    s->prev[s->next[slot]] = s->prev[slot];
    s->used[slot] = INDEXED;
    s->linked--;
}

static inline void link_newest(SlotIndex *s, int32_t slot) {
    int32_t sent = (int32_t)s->cap, last = s->prev[sent];
    s->prev[slot] = last;
    s->next[slot] = sent;
    s->next[last] = slot;
    s->prev[sent] = slot;
    s->used[slot] = LINKED;
    s->linked++;
}

static const uint8_t *key_arg(PyObject *obj, const char *what) {
    if (!PyBytes_Check(obj) || PyBytes_GET_SIZE(obj) != KEY) {
        PyErr_Format(PyExc_TypeError, "%s: a key is %d bytes", what, KEY);
        return NULL;
    }
    return (const uint8_t *)PyBytes_AS_STRING(obj);
}

static int slot_arg(const SlotIndex *s, PyObject *obj, Py_ssize_t *slot) {
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v >= s->cap) {
        PyErr_Format(PyExc_IndexError, "slot %zd outside 0..%zd", v, s->cap - 1);
        return -1;
    }
    *slot = v;
    return 0;
}

static void drop(SlotIndex *s, uint64_t pos, int32_t slot) {
    table_del(s, pos);
    if (s->used[slot] == LINKED) unlink_slot(s, slot);
    s->used[slot] = FREE;
    s->count--;
}

/* The slot of `key`, or -1 (with an exception set when the argument is no key). */
static int32_t slot_of(SlotIndex *s, PyObject *key, const char *what) {
    const uint8_t *k = key_arg(key, what);
    if (k == NULL) return -2;
    int64_t pos = probe(s, k);
    return pos < 0 ? -1 : (int32_t)s->table[pos] - 1;
}

/* -- the type ------------------------------------------------------------------------------------------------- */

static int si_init(SlotIndex *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"capacity", "record_bytes", NULL};
    Py_ssize_t cap, rec;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nn", names, &cap, &rec)) return -1;
    if (cap <= 0 || cap >= INT32_MAX || rec <= 0) {
        PyErr_SetString(PyExc_ValueError, "SlotIndex: capacity in 1..2^31-2 and record_bytes > 0");
        return -1;
    }
    if (s->table != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SlotIndex initialised twice");
        return -1;
    }
    uint64_t size = 16;
    while (size < (uint64_t)cap + (uint64_t)cap / 2) size <<= 1;
    s->cap = cap;
    s->rec = rec;
    s->count = 0;
    s->linked = 0;
    s->mask = size - 1;
    s->table = calloc(size, sizeof(uint32_t));
    s->keys = calloc((size_t)cap, KEY);
    s->recs = calloc((size_t)cap, (size_t)rec);
    s->prev = calloc((size_t)cap + 1, sizeof(int32_t));
    s->next = calloc((size_t)cap + 1, sizeof(int32_t));
    s->used = calloc((size_t)cap, 1);
    if (!s->table || !s->keys || !s->recs || !s->prev || !s->next || !s->used) {
        PyErr_NoMemory();
        return -1;
    }
    s->prev[cap] = s->next[cap] = (int32_t)cap;
    return 0;
}

static void si_dealloc(SlotIndex *s) {
    free(s->table);
    free(s->keys);
    free(s->recs);
    free(s->prev);
    free(s->next);
    free(s->used);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static Py_ssize_t si_len(SlotIndex *s) { return s->count; }

static int si_contains(SlotIndex *s, PyObject *key) {
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != KEY) return 0;
    return probe(s, (const uint8_t *)PyBytes_AS_STRING(key)) >= 0;
}

static PyObject *si_find(SlotIndex *s, PyObject *key) {
    const uint8_t *k = key_arg(key, "find");
    if (k == NULL) return NULL;
    int64_t pos = probe(s, k);
    return PyLong_FromLong(pos < 0 ? -1 : (long)s->table[pos] - 1);
}

static PyObject *si_get(SlotIndex *s, PyObject *key) {
    const uint8_t *k = key_arg(key, "get");
    if (k == NULL) return NULL;
    int64_t pos = probe(s, k);
    if (pos < 0) Py_RETURN_NONE;
    Py_ssize_t slot = (Py_ssize_t)s->table[pos] - 1;
    return Py_BuildValue("(ny#)", slot, (const char *)s->recs + slot * s->rec, s->rec);
}

/* confirm(key, evidence, at) -> int: -1 when key is absent, else whether the record holds evidence's bytes
 * at offset at (1) or not (0): a lookup confirms a block without a Python object made for its record. */
static PyObject *si_confirm(SlotIndex *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "confirm(key, evidence, at)");
        return NULL;
    }
    const uint8_t *k = key_arg(args[0], "confirm");
    if (k == NULL) return NULL;
    if (!PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "confirm: evidence is bytes");
        return NULL;
    }
    Py_ssize_t at = PyLong_AsSsize_t(args[2]);
    if (at == -1 && PyErr_Occurred()) return NULL;
    if (at < 0 || at > s->rec) {
        PyErr_Format(PyExc_ValueError, "confirm: offset %zd outside a %zd-byte record", at, s->rec);
        return NULL;
    }
    int64_t pos = probe(s, k);
    if (pos < 0) return PyLong_FromLong(-1);
    Py_ssize_t n = PyBytes_GET_SIZE(args[1]);
    const uint8_t *rec = s->recs + ((Py_ssize_t)s->table[pos] - 1) * s->rec;
    return PyLong_FromLong(n == s->rec - at && memcmp(rec + at, PyBytes_AS_STRING(args[1]), (size_t)n) == 0);
}

static PyObject *si_record(SlotIndex *s, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(s, arg, &slot) < 0) return NULL;
    if (!s->used[slot]) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)s->recs + slot * s->rec, s->rec);
}

static PyObject *si_key(SlotIndex *s, PyObject *arg) {
    Py_ssize_t slot;
    if (slot_arg(s, arg, &slot) < 0) return NULL;
    if (!s->used[slot]) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize((const char *)s->keys + slot * KEY, KEY);
}

static PyObject *si_put(SlotIndex *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put(key, slot, record)");
        return NULL;
    }
    const uint8_t *k = key_arg(args[0], "put");
    Py_ssize_t slot;
    if (k == NULL || slot_arg(s, args[1], &slot) < 0) return NULL;
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) != s->rec) {
        PyErr_Format(PyExc_ValueError, "put: a record is %zd bytes", s->rec);
        return NULL;
    }
    int64_t pos = probe(s, k);
    long old = pos < 0 ? -1 : (long)s->table[pos] - 1;
    if (s->used[slot] && old != slot) {
        PyErr_Format(PyExc_ValueError, "put: slot %zd holds another key", slot);
        return NULL;
    }
    if (old >= 0) drop(s, (uint64_t)pos, (int32_t)old);
    memcpy(s->keys + slot * KEY, k, KEY);
    memcpy(s->recs + slot * s->rec, PyBytes_AS_STRING(args[2]), (size_t)s->rec);
    table_add(s, (int32_t)slot);
    s->used[slot] = INDEXED;
    s->count++;
    return PyLong_FromLong(old == slot ? -1 : old);
}

static PyObject *si_pop(SlotIndex *s, PyObject *key) {
    const uint8_t *k = key_arg(key, "pop");
    if (k == NULL) return NULL;
    int64_t pos = probe(s, k);
    if (pos < 0) return PyLong_FromLong(-1);
    int32_t slot = (int32_t)s->table[pos] - 1;
    drop(s, (uint64_t)pos, slot);
    return PyLong_FromLong(slot);
}

static PyObject *si_enter(SlotIndex *s, PyObject *key) {
    int32_t slot = slot_of(s, key, "enter");
    if (slot == -2) return NULL;
    if (slot < 0) Py_RETURN_FALSE;
    if (s->used[slot] == LINKED) unlink_slot(s, slot);
    link_newest(s, slot);
    Py_RETURN_TRUE;
}

static PyObject *si_touch(SlotIndex *s, PyObject *key) {
    int32_t slot = slot_of(s, key, "touch");
    if (slot == -2) return NULL;
    if (slot < 0 || s->used[slot] != LINKED) Py_RETURN_FALSE;
    unlink_slot(s, slot);
    link_newest(s, slot);
    Py_RETURN_TRUE;
}

static PyObject *si_leave(SlotIndex *s, PyObject *key) {
    int32_t slot = slot_of(s, key, "leave");
    if (slot == -2) return NULL;
    if (slot < 0 || s->used[slot] != LINKED) Py_RETURN_FALSE;
    unlink_slot(s, slot);
    Py_RETURN_TRUE;
}

static PyObject *si_is_linked(SlotIndex *s, PyObject *key) {
    int32_t slot = slot_of(s, key, "is_linked");
    if (slot == -2) return NULL;
    return PyBool_FromLong(slot >= 0 && s->used[slot] == LINKED);
}

static PyObject *si_linked(SlotIndex *s, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(s->linked); }

/* Keys from the least recent end: up to `n` after skipping `skip` (a snapshot, taken without calling Python). */
static PyObject *si_oldest(SlotIndex *s, PyObject *args) {
    Py_ssize_t n, skip = 0;
    if (!PyArg_ParseTuple(args, "n|n", &n, &skip)) return NULL;
    if (n < 0) n = 0;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    int32_t sent = (int32_t)s->cap;
    for (int32_t cur = s->next[sent]; cur != sent && n > 0; cur = s->next[cur]) {
        if (skip > 0) {
            skip--;
            continue;
        }
        PyObject *k = PyBytes_FromStringAndSize((const char *)s->keys + (size_t)cur * KEY, KEY);
        if (k == NULL || PyList_Append(out, k) < 0) {
            Py_XDECREF(k);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(k);
        n--;
    }
    return out;
}

static int buffer_of(PyObject *obj, Py_buffer *view, Py_ssize_t unit, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % unit != 0) {
        PyErr_Format(PyExc_ValueError, "load: %s is not a whole number of %zd-byte items", what, unit);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/*
 * load(keys, records, order) -> list[int]: fill an empty index from the records as the LMDB index holds them
 * (record i's slot is the little-endian uint32 its first four bytes), each on the recency list, oldest first in `order` (int64
 * positions; records it leaves out are not loaded). Returns the positions whose slot lies past the capacity,
 * for the caller to delete. Two records naming one slot, or one key twice, raise ValueError: an index with
 * them is damaged.
 */
static PyObject *si_load(SlotIndex *s, PyObject *args) {
    PyObject *okeys, *orecs, *oorder;
    if (!PyArg_ParseTuple(args, "OOO", &okeys, &orecs, &oorder)) return NULL;
    if (s->count != 0) {
        PyErr_SetString(PyExc_RuntimeError, "load: the index is not empty");
        return NULL;
    }
    Py_buffer kb, rb, ob;
    if (buffer_of(okeys, &kb, KEY, "keys") < 0) return NULL;
    if (buffer_of(orecs, &rb, s->rec, "records") < 0) {
        PyBuffer_Release(&kb);
        return NULL;
    }
    if (buffer_of(oorder, &ob, 8, "order") < 0) {
        PyBuffer_Release(&kb);
        PyBuffer_Release(&rb);
        return NULL;
    }
    PyObject *stale = PyList_New(0);
    Py_ssize_t n = kb.len / KEY;
    const char *err = NULL;
    Py_ssize_t bad = -1;
    if (stale == NULL) goto done;
    if (rb.len / s->rec != n || s->rec < 4) {
        err = "keys and records differ in number";
        goto done;
    }
    const int64_t *order = ob.buf;
    const uint8_t *keys = kb.buf, *recs = rb.buf;
    for (Py_ssize_t i = 0; i < ob.len / 8; i++) {
        int64_t at = order[i];
        if (at < 0 || at >= n) {
            err = "an order position outside the records";
            goto done;
        }
        uint32_t slot;
        memcpy(&slot, recs + at * s->rec, 4);
        if ((Py_ssize_t)slot >= s->cap) {
            PyObject *p = PyLong_FromLongLong(at);
            if (p == NULL || PyList_Append(stale, p) < 0) {
                Py_XDECREF(p);
                Py_CLEAR(stale);
                goto done;
            }
            Py_DECREF(p);
            continue;
        }
        if (s->used[slot]) {
            err = "two records name slot";
            bad = slot;
            goto done;
        }
        if (probe(s, keys + at * KEY) >= 0) {
            err = "two records have one key";
            goto done;
        }
        memcpy(s->keys + (size_t)slot * KEY, keys + at * KEY, KEY);
        memcpy(s->recs + (size_t)slot * s->rec, recs + at * s->rec, (size_t)s->rec);
        table_add(s, (int32_t)slot);
        link_newest(s, (int32_t)slot);
        s->count++;
    }
done:
    PyBuffer_Release(&kb);
    PyBuffer_Release(&rb);
    PyBuffer_Release(&ob);
    if (err != NULL) {
        Py_XDECREF(stale);
        if (bad >= 0)
            PyErr_Format(PyExc_ValueError, "%s %zd", err, bad);
        else
            PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    return stale;
}

/* dump() -> (slots, keys, records): every entry in slot order, as packed bytes (slots as uint32). */
static PyObject *si_dump(SlotIndex *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *slots = PyBytes_FromStringAndSize(NULL, s->count * 4);
    PyObject *keys = PyBytes_FromStringAndSize(NULL, s->count * KEY);
    PyObject *recs = PyBytes_FromStringAndSize(NULL, s->count * s->rec);
    if (!slots || !keys || !recs) {
        Py_XDECREF(slots);
        Py_XDECREF(keys);
        Py_XDECREF(recs);
        return NULL;
    }
    char *sp = PyBytes_AS_STRING(slots), *kp = PyBytes_AS_STRING(keys), *rp = PyBytes_AS_STRING(recs);
    for (Py_ssize_t slot = 0, j = 0; slot < s->cap && j < s->count; slot++) {
        if (!s->used[slot]) continue;
        uint32_t v = (uint32_t)slot;
        memcpy(sp + j * 4, &v, 4);
        memcpy(kp + j * KEY, s->keys + slot * KEY, KEY);
        memcpy(rp + j * s->rec, s->recs + slot * s->rec, (size_t)s->rec);
        j++;
    }
    return Py_BuildValue("(NNN)", slots, keys, recs);
}

/* slots() -> bytes: the slots in use as uint32, ascending. */
static PyObject *si_slots(SlotIndex *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, s->count * 4);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t slot = 0, j = 0; slot < s->cap && j < s->count; slot++) {
        if (!s->used[slot]) continue;
        uint32_t v = (uint32_t)slot;
        memcpy(p + j++ * 4, &v, 4);
    }
    return out;
}

/* keys() -> list[bytes]: every key indexed, in slot order (what a snapshot of a tier lists). */
static PyObject *si_keys(SlotIndex *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(s->count);
    if (out == NULL) return NULL;
    for (Py_ssize_t slot = 0, j = 0; slot < s->cap && j < s->count; slot++) {
        if (!s->used[slot]) continue;
        PyObject *key = PyBytes_FromStringAndSize((const char *)s->keys + slot * KEY, KEY);
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j++, key);
    }
    return out;
}

/* recency() -> bytes: the linked slots as uint32, least recent first (what `oldest` walks). */
static PyObject *si_recency(SlotIndex *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, s->linked * 4);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
    int32_t sent = (int32_t)s->cap;
    Py_ssize_t j = 0;
    for (int32_t cur = s->next[sent]; cur != sent && j < s->linked; cur = s->next[cur], j++) {
        uint32_t v = (uint32_t)cur;
        memcpy(p + j * 4, &v, 4);
    }
    return out;
}

static PyObject *si_capacity(SlotIndex *s, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(s->cap); }
static PyObject *si_record_bytes(SlotIndex *s, void *Py_UNUSED(c)) { return PyLong_FromSsize_t(s->rec); }

static PyObject *si_table_bytes(SlotIndex *s, void *Py_UNUSED(c)) {
    /* What the index allocated (calloc'd: the pages of slots never used are not resident). */
    size_t per_slot = KEY + (size_t)s->rec + 2 * sizeof(int32_t) + 1;
    return PyLong_FromSize_t((s->mask + 1) * sizeof(uint32_t) + (size_t)s->cap * per_slot + 2 * sizeof(int32_t));
}

static PyMethodDef si_methods[] = {
    {"find", (PyCFunction)si_find, METH_O, "find(key) -> int: the key's slot, or -1."},
    {"get", (PyCFunction)si_get, METH_O, "get(key) -> (slot, record) | None."},
    {"confirm", (PyCFunction)(void (*)(void))si_confirm, METH_FASTCALL,
     "confirm(key, evidence, at) -> int: -1 when key is absent; 1 when its record ends with evidence's bytes "
     "from offset at, else 0."},
    {"record", (PyCFunction)si_record, METH_O, "record(slot) -> bytes | None: the record of the block in slot."},
    {"key", (PyCFunction)si_key, METH_O, "key(slot) -> bytes | None: the key of the block in slot."},
    {"put", (PyCFunction)(void (*)(void))si_put, METH_FASTCALL,
     "put(key, slot, record) -> int: index key at slot (off the recency list). "
     "Returns the slot the key had before (now unindexed, for the caller to free), or -1. "
     "A slot holding another key raises ValueError."},
    {"pop", (PyCFunction)si_pop, METH_O, "pop(key) -> int: unindex key; its slot, or -1 when absent."},
    {"enter", (PyCFunction)si_enter, METH_O,
     "enter(key) -> bool: link an indexed key at the most recent end of the recency list (moving it if linked)."},
    {"touch", (PyCFunction)si_touch, METH_O, "touch(key) -> bool: move a linked key to the most recent end."},
    {"leave", (PyCFunction)si_leave, METH_O, "leave(key) -> bool: unlink key from the recency list (it stays indexed)."},
    {"is_linked", (PyCFunction)si_is_linked, METH_O, "is_linked(key) -> bool: whether key is on the recency list."},
    {"oldest", (PyCFunction)si_oldest, METH_VARARGS,
     "oldest(n, skip=0) -> list[bytes]: up to n keys from the least recent end, after skipping skip."},
    {"load", (PyCFunction)si_load, METH_VARARGS,
     "load(keys, records, order) -> list[int]: fill an empty index in bulk (see slot_index.c)."},
    {"dump", (PyCFunction)si_dump, METH_NOARGS, "dump() -> (slots, keys, records): every entry, in slot order."},
    {"slots", (PyCFunction)si_slots, METH_NOARGS, "slots() -> bytes: the slots in use, uint32, ascending."},
    {"keys", (PyCFunction)si_keys, METH_NOARGS, "keys() -> list[bytes]: every key indexed, in slot order."},
    {"recency", (PyCFunction)si_recency, METH_NOARGS, "recency() -> bytes: uint32 slots, least recent first."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef si_getset[] = {
    {"capacity", (getter)si_capacity, NULL, "slots", NULL},
    {"linked", (getter)si_linked, NULL, "keys on the recency list", NULL},
    {"record_bytes", (getter)si_record_bytes, NULL, "bytes of one record", NULL},
    {"allocated_bytes", (getter)si_table_bytes, NULL, "bytes allocated (virtual; untouched pages cost none)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods si_sequence = {
    .sq_length = (lenfunc)si_len,
    .sq_contains = (objobjproc)si_contains,
};

PyTypeObject kvt_slot_index_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier._native_io.SlotIndex",
    .tp_basicsize = sizeof(SlotIndex),
    .tp_dealloc = (destructor)si_dealloc,
    .tp_as_sequence = &si_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SlotIndex(capacity, record_bytes): key -> slot and record, and a recency list (see slot_index.c).",
    .tp_methods = si_methods,
    .tp_getset = si_getset,
    .tp_init = (initproc)si_init,
    .tp_new = PyType_GenericNew,
};
