"""The disk tier's in-memory mirror of its index: key → slot and record, in flat arrays by slot.

The mirror answers every lookup of the disk tier without a transaction, so
it holds one entry per indexed block, and its cost per block is what a node
with terabytes of NVMe pays tens of millions of times. It is a
:data:`kvtier.tiers.slot_index.SlotIndex` (``native/slot_index.c``): the key, the
record's bytes exactly as the LMDB index stores them, and two links of a
recency list, each in an array by slot, with an open-addressing table from
key to slot. Entries are decoded into :class:`IndexEntry` objects only when
asked for, one at a time. ``kvtier bench scale`` has the bytes per block and
the start-up times (bench/README.md).

The mirror is also the tier's recency list for the LRU policy
(:class:`kvtier.tiers.slot_index.SlotRecency`); a reopened tier's blocks are on
it, oldest store first.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvtier.keys import DIGEST_BYTES, KEY_BYTES, BlockKey
from kvtier.tiers.disk.records import IndexDamage, IndexEntry, decode_value, encode_record, record_bytes
from kvtier.tiers.slot_index import CONFIRMED, SlotIndex, SlotRecency


class SlotMirror(SlotRecency):
    """The records of one disk tier by key, decoded on demand, and their recency list; changed under the tier's lock."""

    def __init__(self, num_slots: int, num_layers: int) -> None:
        super().__init__(SlotIndex(num_slots, record_bytes(num_layers)))
        self._num_layers = num_layers
        self._digest_at = record_bytes(num_layers) - DIGEST_BYTES

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def get(self, key: BlockKey) -> IndexEntry | None:
        found = self._slots.get(key)
        return None if found is None else decode_value(found[1], self._num_layers)

    def confirm(self, key: BlockKey, digest: bytes) -> bool | None:
        """Whether ``key``'s record has ``digest`` (the record's last field), None when absent: nothing decoded."""
        return CONFIRMED[self._slots.confirm(key, digest, self._digest_at)]

    def slot_of(self, key: BlockKey) -> int | None:
        slot = self._slots.find(key)
        return None if slot < 0 else slot

    def put(self, key: BlockKey, entry: IndexEntry) -> int | None:
        """Index ``entry`` under ``key``; the slot the key had before (for the caller to free), or None."""
        old = self._slots.put(key, entry.slot, encode_record(entry))
        return None if old < 0 else old

    def pop(self, key: BlockKey) -> IndexEntry | None:
        entry = self.get(key)
        if entry is not None:
            self._slots.pop(key)
        return entry

    def keys(self) -> list[BlockKey]:
        """Every key indexed, in slot order."""
        return self._slots.keys()

    def slots(self) -> np.ndarray:
        """The slots in use, ascending."""
        return np.frombuffer(self._slots.slots(), dtype=np.uint32)

    def key_at(self, slot: int) -> BlockKey | None:
        key = self._slots.key(slot)
        return None if key is None else BlockKey(key)

    def load(self, keys: bytes | memoryview, values: bytes | memoryview) -> list[int]:
        """Fill the empty mirror from the index's keys and records, each joined end to end; oldest store first.

        Returns the positions of the records whose slot lies past the
        capacity (it shrank since they were written), which are not loaded.
        Raises :class:`IndexDamage` when two records name one slot.
        """
        size = record_bytes(self._num_layers)
        count = len(values) // size
        seqs = np.frombuffer(values, dtype=np.uint8).reshape(count, size)[:, 4:12].copy().view("<u8").ravel()
        try:
            return self._slots.load(keys, values, np.argsort(seqs, kind="stable").astype(np.int64))
        except ValueError as err:
            raise IndexDamage(str(err)) from None

    def in_store_order(self) -> Iterator[tuple[BlockKey, IndexEntry]]:
        """Every entry, oldest store first: a snapshot taken now, decoded as the iteration reaches it."""
        _, keys, values = self._slots.dump()
        size, layers = record_bytes(self._num_layers), self._num_layers
        count = len(keys) // KEY_BYTES
        seqs = np.frombuffer(values, dtype=np.uint8).reshape(count, size)[:, 4:12].copy().view("<u8").ravel()
        order = np.argsort(seqs, kind="stable").tolist()

        def entry(i: int) -> tuple[BlockKey, IndexEntry]:
            key = BlockKey(keys[i * KEY_BYTES : (i + 1) * KEY_BYTES])
            return key, decode_value(values[i * size : (i + 1) * size], layers)

        return map(entry, order)

    def in_store_order_packed(self) -> tuple[bytes, bytes]:
        """Every key and every record, oldest store first, each joined end to end (what a seal keeps)."""
        _, keys, values = self._slots.dump()
        size = record_bytes(self._num_layers)
        count = len(keys) // KEY_BYTES
        rows = np.frombuffer(values, dtype=np.uint8).reshape(count, size)
        order = np.argsort(rows[:, 4:12].copy().view("<u8").ravel(), kind="stable")
        return np.frombuffer(keys, np.uint8).reshape(count, KEY_BYTES)[order].tobytes(), rows[order].tobytes()
