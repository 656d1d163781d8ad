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

Locking: one small lock guards the key→slot map and the free list; payload
copies run outside it. Keeping a slot alive while someone copies out of it is
the manager's job (pins), not this tier's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.stats import TierStats
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord, TierKind

SLOT_ALIGN = 4096


def align_up(n: int, align: int = SLOT_ALIGN) -> int:
    return (n + align - 1) // align * align


PARALLEL_COPY_MIN = 16  # blocks; below this a second thread costs more than it saves


def _copy_all(work: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in work:
        copy_bytes(dst, src)


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
        self._records: list[BlockRecord | None] = [None] * num_slots
        self._slot_of: dict[BlockKey, int] = {}  # committed blocks, insertion (store) order
        self._reserved: dict[BlockKey, int] = {}
        self._withheld = 0  # slots out of both maps and the free list: see withhold()
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lock = threading.Lock()
        self._copier: ThreadPoolExecutor | None = None  # the second copy thread of get_many, made on first use

    # -- sizes ---------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return len(self._records)

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
        return len(self._slot_of)

    def free_blocks(self) -> int:
        return len(self._free)

    # -- lookups -------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._slot_of

    def record(self, key: BlockKey) -> BlockRecord | None:
        slot = self._slot_of.get(key)
        return None if slot is None else self._records[slot]

    def offset(self, view: torch.Tensor) -> int:
        """Byte offset in the slab of a slot view this tier handed out (what a mapping client indexes by)."""
        return view.data_ptr() - self._slab.data_ptr()

    def view(self, key: BlockKey) -> torch.Tensor | None:
        """The block's slot itself (uint8, ``block_bytes``): zero-copy, valid while pinned."""
        slot = self._slot_of.get(key)
        return None if slot is None else self._slot(slot)

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
            slots = [self._slot_of.get(k) for k in keys]
            if self._copier is None and len(slots) >= PARALLEL_COPY_MIN:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-host-copy")
        bb, sb = self.layout.block_bytes, self._slot_bytes
        work = [(out, self._slab[s * sb : s * sb + bb]) for s, out in zip(slots, outs, strict=True) if s is not None]
        if len(work) >= PARALLEL_COPY_MIN:
            half = len(work) // 2
            assert self._copier is not None
            other = self._copier.submit(_copy_all, work[:half])
            _copy_all(work[half:])
            other.result()
        else:
            _copy_all(work)
        self.stats.add(bytes_read=len(work) * bb)
        return [s is not None for s in slots]

    # -- two-phase store -----------------------------------------------------
    def reserve(self, key: BlockKey, record: BlockRecord) -> torch.Tensor | None:
        """Take a free slot for ``key`` and return it to be filled; None when full or already present."""
        with self._lock:
            if key in self._slot_of or key in self._reserved or not self._free:
                return None
            slot = self._free.pop()
            self._reserved[key] = slot
            self._records[slot] = record
        return self._slot(slot)

    def commit(self, key: BlockKey) -> None:
        """Publish a reserved slot: from now on lookups see the block."""
        with self._lock:
            slot = self._reserved.pop(key)
            self._slot_of[key] = slot
        self.stats.add(bytes_written=self.layout.block_bytes)

    def abort(self, key: BlockKey) -> None:
        """Give a reserved slot back unpublished (a failed store is never indexed)."""
        with self._lock:
            slot = self._reserved.pop(key, None)
            if slot is not None:
                self._records[slot] = None
                self._free.append(slot)

    def withhold(self, key: BlockKey) -> int | None:
        """Drop ``key``'s reservation but keep its slot out of the free list; the slot, for :meth:`release`.

        For a reservation whose writer may still be writing (a cache service
        client that stalled past its lease): the key may be reserved again by
        anyone, in another slot, while this one waits until no write of the
        old writer can land in it. Reused at once, a late write would change
        a block someone else committed there.
        """
        with self._lock:
            slot = self._reserved.pop(key, None)
            if slot is not None:
                self._records[slot] = None
                self._withheld += 1
        return slot

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
            slot = self._slot_of.pop(key, None)
            if slot is None:
                return False
            self._records[slot] = None
            self._free.append(slot)
        return True

    def remove_many(self, keys: Sequence[BlockKey]) -> int:
        return sum(self.remove(k) for k in keys)

    def entries(self) -> Iterator[tuple[BlockKey, BlockRecord]]:
        with self._lock:
            items = list(self._slot_of.items())
        for key, slot in items:
            record = self._records[slot]
            if record is not None:
                yield key, record

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown()
            self._copier = None
