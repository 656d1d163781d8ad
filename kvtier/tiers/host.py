"""The host tier: one preallocated slab of (pinned, when CUDA exists) CPU memory.

The slab is allocated once at start-up and cut into fixed-size slots handed
out from a free list, so storing a block never calls the allocator and
occupancy can never exceed the configured bytes. Its pages are not touched at
allocation, so resident memory grows only as slots are first written. Without
CUDA it is page-aligned memory (slots are 4096-byte multiples), so O_DIRECT
disk reads go straight into a slot.

Stores are two-phase (:meth:`HostTier.reserve` → fill → :meth:`HostTier.commit`
or :meth:`HostTier.abort`): a reserved slot is invisible to lookups until
committed, so a half-written block can never be served.

The index (key → slot and record) is a native slot index
(:data:`kvtier.tiers.slot_index.SlotIndex`, as the disk tier's mirror): keys and
records in arrays by slot, not a dict of Python objects, and a recency list
over the slots that the LRU policy ranks by (:class:`SlotRecency`). A block
indexed costs bytes the same at a hundred blocks or at millions.

Locking: one small lock guards the index and the free list; payload
copies run outside it. Keeping a slot alive while someone copies out of it is
the manager's job (pins), not this tier's.
"""

from __future__ import annotations

import os
import struct
import threading
from array import array
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvtier.keys import DIGEST_BYTES, KEY_BYTES, BlockDigest, BlockKey
from kvtier.layout import KVLayout
from kvtier.stats import TierStats
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord, TierKind
from kvtier.tiers.slot_index import CONFIRMED, SlotIndex, SlotRecency

SLOT_ALIGN = 4096
_RECORD = struct.Struct(f"<QB{KEY_BYTES}s{DIGEST_BYTES}s")  # store sequence | has parent | parent | digest
_DIGEST_AT = _RECORD.size - DIGEST_BYTES


def align_up(n: int, align: int = SLOT_ALIGN) -> int:
    return (n + align - 1) // align * align


PARALLEL_COPY_MIN = 16  # blocks; below this a second thread costs more than it saves


def _copy_all(work: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in work:
        copy_bytes(dst, src)


def _encode(seq: int, record: BlockRecord) -> bytes:
    parent = record.parent
    if len(record.digest) != DIGEST_BYTES or (parent is not None and len(parent) != KEY_BYTES):
        raise ValueError(f"a block record is a {DIGEST_BYTES}-byte digest and a {KEY_BYTES}-byte parent key")
    return _RECORD.pack(seq, parent is not None, parent or bytes(KEY_BYTES), record.digest)


def _decode(raw: bytes) -> BlockRecord:
    _, has_parent, parent, digest = _RECORD.unpack(raw)
    return BlockRecord(BlockDigest(digest), BlockKey(parent) if has_parent else None)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one block's bytes; CPU to CPU through numpy, anything else through torch (async on CUDA).

    ``np.copyto`` of one block runs at the speed of one big torch copy, while
    a per-block torch ``copy_`` pays its dispatch and thread-pool start on
    every call, which one block's bytes are too few to amortize.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=True)


class HostTier:
    kind = TierKind.HOST

    def __init__(
        self, layout: KVLayout, capacity_bytes: int, *, pin: bool | None = None, shared_file: Path | None = None
    ) -> None:
        """``shared_file``: back the slab by this file (shared memory, ``/dev/shm``), mapped shared, so
        other processes can map the same slots (the cache service's clients copy straight out of them)."""
        self.layout = layout
        self.stats = TierStats()
        self._slot_bytes = align_up(layout.block_bytes)
        num_slots = capacity_bytes // self._slot_bytes
        if num_slots == 0:
            raise ValueError(
                f"host capacity {capacity_bytes} B holds no block of {self._slot_bytes} B; raise host.capacity_bytes"
            )
        if pin is None:
            pin = torch.cuda.is_available()
        self.pinned = pin
        nbytes = num_slots * self._slot_bytes
        if shared_file is not None:
            fd = os.open(shared_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # sparse: pages cost memory only once written
            finally:
                os.close(fd)
            self._slab = torch.from_file(str(shared_file), shared=True, size=nbytes, dtype=torch.uint8)
            if pin:
                torch.cuda.cudart().cudaHostRegister(self._slab.data_ptr(), nbytes, 0)
        elif pin:
            self._slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            # Page-aligned (so the disk tier's O_DIRECT reads land in slots without a bounce
            # copy) and lazily backed: untouched pages cost no memory.
            self._backing = native.alloc_aligned(nbytes)
            self._slab = torch.frombuffer(self._backing, dtype=torch.uint8)
        self._index = SlotIndex(num_slots, _RECORD.size)  # committed blocks only
        self._seq = 0  # reservation order, kept in each record: what entries() sorts by
        self.recency = SlotRecency(self._index)
        self._reserved: dict[BlockKey, tuple[int, bytes]] = {}  # slot and encoded record, until committed
        self._withheld = 0  # slots out of both maps and the free list: see withhold()
        self._free = array("i", range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first; 4 B a slot
        self._lock = threading.Lock()
        self._copier: ThreadPoolExecutor | None = None  # the second copy thread of get_many, made on first use

    # -- sizes ---------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self._index.capacity

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._slab.numel()

    @property
    def used_bytes(self) -> int:
        return (self.capacity_blocks - len(self._free)) * self._slot_bytes

    def __len__(self) -> int:
        return len(self._index)

    def free_blocks(self) -> int:
        return len(self._free)

    # -- lookups -------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def record(self, key: BlockKey) -> BlockRecord | None:
        found = self._index.get(key)
        return None if found is None else _decode(found[1])

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return self._index.keys()

    def confirm(self, key: BlockKey, digest: BlockDigest) -> bool | None:
        return CONFIRMED[self._index.confirm(key, digest, _DIGEST_AT)]

    def offset(self, view: torch.Tensor) -> int:
        """Byte offset in the slab of a slot view this tier handed out (what a mapping client indexes by)."""
        return view.data_ptr() - self._slab.data_ptr()

    def view(self, key: BlockKey) -> torch.Tensor | None:
        """The block's slot itself (uint8, ``block_bytes``): zero-copy, valid while pinned."""
        slot = self._index.find(key)
        return None if slot < 0 else self._slot(slot)

    def _slot(self, slot: int) -> torch.Tensor:
        start = slot * self._slot_bytes
        return self._slab[start : start + self.layout.block_bytes]

    # -- reads ---------------------------------------------------------------
    def get(self, key: BlockKey, out: torch.Tensor) -> bool:
        src = self.view(key)
        if src is None:
            return False
        copy_bytes(out, src)
        self.stats.add(bytes_read=src.numel())
        return True

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """One lock round and one stats update for the batch, and the copies split over two threads.

        A single core does not saturate memory bandwidth: two copy loops (numpy
        releases the GIL while it copies) move more bytes per second than one.
        """
        with self._lock:
            slots = [self._index.find(k) for k in keys]
            if self._copier is None and len(slots) >= PARALLEL_COPY_MIN:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-host-copy")
        bb, sb = self.layout.block_bytes, self._slot_bytes
        work = [(out, self._slab[s * sb : s * sb + bb]) for s, out in zip(slots, outs, strict=True) if s >= 0]
        if len(work) >= PARALLEL_COPY_MIN:
            half = len(work) // 2
            assert self._copier is not None
            other = self._copier.submit(_copy_all, work[:half])
            _copy_all(work[half:])
            other.result()
        else:
            _copy_all(work)
        self.stats.add(bytes_read=len(work) * bb)
        return [s >= 0 for s in slots]

    # -- two-phase store -----------------------------------------------------
    def reserve(self, key: BlockKey, record: BlockRecord) -> torch.Tensor | None:
        """Take a free slot for ``key`` and return it to be filled; None when full or already present."""
        with self._lock:
            if key in self._index or key in self._reserved or not self._free:
                return None
            self._seq += 1
            raw = _encode(self._seq, record)  # raises before a slot is taken
            slot = self._free.pop()
            self._reserved[key] = (slot, raw)
        return self._slot(slot)

    def commit(self, key: BlockKey) -> None:
        """Publish a reserved slot: from now on lookups see the block."""
        with self._lock:
            slot, raw = self._reserved.pop(key)
            self._index.put(key, slot, raw)
        self.stats.add(bytes_written=self.layout.block_bytes)

    def abort(self, key: BlockKey) -> None:
        """Give a reserved slot back unpublished (a failed store is never indexed)."""
        with self._lock:
            reserved = self._reserved.pop(key, None)
            if reserved is not None:
                self._free.append(reserved[0])

    def withhold(self, key: BlockKey) -> int | None:
        """Drop ``key``'s reservation but keep its slot out of the free list; the slot, for :meth:`release`.

        For a reservation whose writer may still be writing (a cache service
        client that stalled past its lease): the key may be reserved again by
        anyone, in another slot, while this one waits until no write of the
        old writer can land in it. Reused at once, a late write would change
        a block someone else committed there.
        """
        with self._lock:
            reserved = self._reserved.pop(key, None)
            if reserved is None:
                return None
            self._withheld += 1
        return reserved[0]

    def release(self, slots: Sequence[int]) -> None:
        """Withheld slots back to the free list: their writer can no longer write."""
        with self._lock:
            self._free.extend(slots)
            self._withheld -= len(slots)

    @property
    def withheld_blocks(self) -> int:
        return self._withheld

    def put(self, key: BlockKey, payload: torch.Tensor, record: BlockRecord) -> bool:
        existing = self.record(key)
        if existing is not None:
            return existing.matches(record.digest)
        dst = self.reserve(key, record)
        if dst is None:
            self.stats.add(rejected_stores=1)
            return False
        try:
            copy_bytes(dst, payload.reshape(-1).view(torch.uint8))
        except (RuntimeError, ValueError):
            self.abort(key)
            self.stats.add(errors=1)
            raise
        self.commit(key)
        return True

    def put_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[torch.Tensor], records: Sequence[BlockRecord]
    ) -> list[bool]:
        return [self.put(k, p, r) for k, p, r in zip(keys, payloads, records, strict=True)]

    # -- removal -------------------------------------------------------------
    def remove(self, key: BlockKey) -> bool:
        with self._lock:
            slot = self._index.pop(key)
            if slot < 0:
                return False
            self._free.append(slot)
        return True

    def remove_many(self, keys: Sequence[BlockKey]) -> int:
        return sum(self.remove(k) for k in keys)

    def entries(self) -> Iterator[tuple[BlockKey, BlockRecord]]:
        """Every committed block, oldest store first: a snapshot taken at the first step."""
        with self._lock:
            _, keys, records = self._index.dump()
        count, size = len(keys) // KEY_BYTES, _RECORD.size
        seqs = np.frombuffer(records, np.uint8).reshape(count, size)[:, :8].copy().view("<u8").ravel()
        for i in np.argsort(seqs, kind="stable").tolist():
            yield BlockKey(keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]), _decode(records[i * size : (i + 1) * size])

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown()
            self._copier = None
