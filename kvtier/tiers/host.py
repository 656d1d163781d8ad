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

import threading
from collections.abc import Iterator, Sequence

import torch

from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.stats import TierStats
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord, TierKind

SLOT_ALIGN = 4096


def align_up(n: int, align: int = SLOT_ALIGN) -> int:
    return (n + align - 1) // align * align


class HostTier:
    kind = TierKind.HOST

    def __init__(self, layout: KVLayout, capacity_bytes: int, *, pin: bool | None = None) -> None:
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
        if pin:
            self._slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            # Page-aligned (so the disk tier's O_DIRECT reads land in slots without a bounce
            # copy) and lazily backed: untouched pages cost no memory.
            self._backing = native.alloc_aligned(nbytes)
            self._slab = torch.frombuffer(self._backing, dtype=torch.uint8)
        self._records: list[BlockRecord | None] = [None] * num_slots
        self._slot_of: dict[BlockKey, int] = {}  # committed blocks, insertion (store) order
        self._reserved: dict[BlockKey, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._lock = threading.Lock()

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

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [k in self._slot_of for k in keys]

    def record(self, key: BlockKey) -> BlockRecord | None:
        slot = self._slot_of.get(key)
        return None if slot is None else self._records[slot]

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
        out.copy_(src)
        self.stats.add(bytes_read=src.numel())
        return True

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        return [self.get(k, o) for k, o in zip(keys, outs, strict=True)]

    def get_layer(self, key: BlockKey, layer: int, out: torch.Tensor) -> bool:
        src = self.view(key)
        if src is None:
            return False
        off = self.layout.layer_offset(layer)
        out.copy_(src[off : off + self.layout.layer_bytes])
        self.stats.add(bytes_read=self.layout.layer_bytes)
        return True

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

    def put(self, key: BlockKey, payload: torch.Tensor, record: BlockRecord) -> bool:
        existing = self.record(key)
        if existing is not None:
            return existing.matches(record.tokens)
        dst = self.reserve(key, record)
        if dst is None:
            self.stats.add(rejected_stores=1)
            return False
        try:
            dst.copy_(payload.reshape(-1).view(torch.uint8))
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
        pass
