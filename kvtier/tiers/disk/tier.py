"""The disk tier: preallocated slab files of aligned slots, indexed by LMDB.

Files: ``slab-NNNN.bin`` (fixed-size slots, each a multiple of 4096 bytes at a
4096-aligned offset, so O_DIRECT can read them), ``index.lmdb/`` (key →
record) and ``lock`` (:mod:`kvtier.tiers.disk.directory`: one opener at a time). The
index is the source of truth; an in-memory mirror of it, loaded at open,
answers lookups without a transaction.

:class:`DiskTier` is the tier's public face and owns the order of things
(open, store, read, drop); each job under it is its own module:

* :mod:`kvtier.tiers.disk.index`: the LMDB index, its header, and what
  opening does with an index that is damaged, written for another setup, or
  of an older format; :mod:`kvtier.tiers.disk.records` encodes its records.
* :mod:`kvtier.tiers.disk.mirror`: the index in memory, in flat arrays by
  slot, with the tier's recency list.
* :mod:`kvtier.tiers.disk.seal`: what a clean close leaves so the next open
  trusts the index without walking it and reads the mirror in one go.
* :mod:`kvtier.tiers.disk.slabs`: the slab files, where a slot lies, the I/O
  mode (O_DIRECT when the filesystem allows it), and the free slots.
* :mod:`kvtier.tiers.disk.slab_io`: a batch of reads or writes as one native call,
  with bounce buffers for unaligned memory and per-layer checksums.

Opening checks before it trusts: the directory is made private (0700, files
0600) and locked; the index is verified and every record must decode and name
its own slot (quarantined or refused otherwise, per
:class:`~kvtier.config.OnCorrupt`). Records whose slab file is missing or too
short are dropped.

Durability order of a store: write the payload → fsync (per :class:`FsyncMode`)
→ commit the index record. A block is *acknowledged* only once its record is
committed, so a crash at any point leaves either no record (the slot is simply
free again at the next open: a slot is free unless the index names it, which
reclaims every orphan with no scan) or a record whose bytes were written
first. Each layer's bytes carry a CRC-32C in the record (the SSE4.2
instruction checks a block far faster than the disk reads it; format 1 used
xxh3-64); a read that fails it, or ends early, is a counted miss and the
record is dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb
import numpy as np
import torch

from kvtier.config import FsyncMode, OnCorrupt, OnMismatch
from kvtier.errors import DiskUnavailableError, warn_once
from kvtier.keys import BlockDigest, BlockKey
from kvtier.layout import KVLayout
from kvtier.stats import DiskStats
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord, TierKind
from kvtier.tiers.disk.directory import DiskDir
from kvtier.tiers.disk.index import FORMAT_VERSION, DiskIndex, index_header
from kvtier.tiers.disk.mirror import SlotMirror
from kvtier.tiers.disk.records import IndexDamage, IndexEntry, decode_record, encode_record, record_bytes
from kvtier.tiers.disk.slab_io import BOUNCE_BYTES, SlabIO, SlotRead
from kvtier.tiers.disk.slabs import DiskSlabs, IOMode, choose_io_mode, io_mode_for
from kvtier.tiers.host import SLOT_ALIGN, align_up

_DiskErrors = (OSError, lmdb.Error)


class DiskTier:
    kind = TierKind.DISK

    def __init__(
        self,
        path: Path,
        layout: KVLayout,
        capacity_bytes: int,
        *,
        model_fingerprint: str,
        file_bytes: int = 1024**3,
        fsync: FsyncMode = FsyncMode.BATCH,
        on_mismatch: OnMismatch = OnMismatch.ERROR,
        on_corrupt: OnCorrupt = OnCorrupt.QUARANTINE,
        io_mode: IOMode | None = None,
        backend: native.IOBackend = native.BACKEND,
    ) -> None:
        """``io_mode`` None: O_DIRECT when the filesystem allows it, else buffered (logged once).

        ``backend`` is the C extension when it is built (:data:`kvtier.tiers.native.BACKEND`);
        tests pass :data:`kvtier.tiers.native.PYTHON` to run the fallback.

        Raises :class:`~kvtier.errors.DiskUnavailableError` when the directory
        cannot be created, written or locked, :class:`~kvtier.errors.DiskLockedError`
        when another disk tier holds it, :class:`~kvtier.errors.TierMismatchError`
        and :class:`~kvtier.errors.DiskCorruptError` per ``on_mismatch`` / ``on_corrupt``.
        """
        self.layout = layout
        self.stats = DiskStats()
        self.path = Path(path)
        self.fsync = fsync
        self._slot_bytes = align_up(layout.block_bytes)
        self._num_slots = capacity_bytes // self._slot_bytes
        if self._num_slots == 0:
            raise ValueError(f"disk capacity {capacity_bytes} B holds no block of {self._slot_bytes} B")
        slots_per_file = max(1, file_bytes // self._slot_bytes)
        header = index_header(
            layout, model_fingerprint=model_fingerprint, slot_bytes=self._slot_bytes, slots_per_file=slots_per_file
        )
        self._lock = threading.Lock()
        self._io = backend
        self._dir = DiskDir.open(self.path)
        self._slabs = DiskSlabs(
            self._dir,
            layout,
            num_slots=self._num_slots,
            slots_per_file=slots_per_file,
            stats=self.stats,
            lock=self._lock,
        )
        self._index = DiskIndex(
            self._dir, layout, header, num_slots=self._num_slots, fsync=fsync, stats=self.stats, lock=self._lock
        )
        try:
            self._open(io_mode, on_mismatch, on_corrupt)
        except OSError as err:
            self._abandon()
            raise DiskUnavailableError(f"disk tier at {self.path} cannot be opened: {err.strerror or err}") from err
        except BaseException:
            self._abandon()
            raise

    # -- opening -------------------------------------------------------------
    def _open(self, io_mode: IOMode | None, on_mismatch: OnMismatch, on_corrupt: OnCorrupt) -> None:
        self._io_mode = choose_io_mode(self.path, io_mode, self._io)
        self._slab_io = SlabIO(
            self._slabs, self.layout, self.stats, backend=self._io, io_mode=self._io_mode, fsync=self.fsync
        )
        self._index.open(on_mismatch, on_corrupt)
        self._slabs.open(self._io_mode)
        self._index.drop_lost(self._slabs.held)
        self._slabs.free_all_but(self._index.mirror.slots())
        native.return_freed_heap()  # the index was read through buffers as large as itself, now freed
        self._dir.warn_if_short_of_space(self.capacity_bytes)

    def _abandon(self) -> None:
        """Undo a failed open: close what was opened and release the lock."""
        self._slabs.close()
        self._index.close()
        self._dir.close()

    # -- sizes ---------------------------------------------------------------
    @property
    def io_mode(self) -> IOMode:
        return self._io_mode

    @property
    def io_backend(self) -> str:
        """``native`` (the C extension) or ``python`` (the fallback)."""
        return self._io.name

    @property
    def capacity_blocks(self) -> int:
        return self._num_slots

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._num_slots * self._slot_bytes

    @property
    def used_bytes(self) -> int:
        return (self._num_slots - self._slabs.free_count()) * self._slot_bytes

    def __len__(self) -> int:
        return len(self._index.mirror)

    def free_blocks(self) -> int:
        return self._slabs.free_count()

    # -- lookups -------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._index.mirror

    def record(self, key: BlockKey) -> BlockRecord | None:
        entry = self._index.mirror.get(key)
        return None if entry is None else entry.record

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return self._index.mirror.keys()

    def confirm(self, key: BlockKey, digest: BlockDigest) -> bool | None:
        return self._index.mirror.confirm(key, digest)

    # -- reads ---------------------------------------------------------------
    def get(self, key: BlockKey, out: torch.Tensor) -> bool:
        return self.get_many([key], [out])[0]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """All present blocks in one batched native read, whose threads also take each layer's CRC-32C."""
        entries = [self._index.mirror.get(k) for k in keys]
        results, bad = self._slab_io.read(keys, entries, outs)
        for r in bad:
            self._drop_unreadable(r)
        return results

    def _drop_unreadable(self, r: SlotRead) -> None:
        """Forget a block whose bytes failed their read, unless it was replaced meanwhile.

        Kept, it would fail every lookup that reaches it again; dropped, its
        slot is free for a block that can be read.
        """
        with self._lock:
            if self._index.mirror.get(r.key) != r.entry:
                return  # the slot was reused while we read it: a race, not damage on disk
        self.remove(r.key)

    # -- stores --------------------------------------------------------------
    def put(self, key: BlockKey, payload: torch.Tensor, record: BlockRecord) -> bool:
        return self.put_many([key], [payload], [record])[0]

    def put_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[torch.Tensor], records: Sequence[BlockRecord]
    ) -> list[bool]:
        """Write → fsync → commit, per block (``always``) or once for the batch (``batch``/``never``).

        Each write batch is one native call. A payload that is not exactly one block is a
        caller bug and raises ``ValueError`` before anything is allocated (it would spill
        into the next slot).
        """
        datas = [p.reshape(-1).view(torch.uint8).numpy() for p in payloads]
        for data in datas:
            if data.nbytes != self.layout.block_bytes:
                raise ValueError(f"a disk tier payload is {self.layout.block_bytes} B, got {data.nbytes} B")
        results, todo = self._slabs.allocate(keys, records, self._index.mirror.get)
        if not todo:
            return results
        batches = [[t] for t in todo] if self.fsync is FsyncMode.ALWAYS else [todo]
        for batch in batches:
            ok = self._write_batch([(keys[i], datas[i], records[i], slot) for i, slot in batch])
            for i, _ in batch:
                results[i] = ok
        return results

    def _write_batch(self, batch: list[tuple[BlockKey, np.ndarray, BlockRecord, int]]) -> bool:
        try:
            checksums = self._slab_io.write([slot for *_, slot in batch], [data for _, data, _, _ in batch])
            first = self._index.next_seqs(len(batch))
            entries = [
                (key, IndexEntry(slot, first + n, sums, record))
                for n, ((key, _, record, slot), sums) in enumerate(zip(batch, checksums, strict=True))
            ]
            self._commit(entries)
        except _DiskErrors as err:
            self.stats.add(errors=1, write_errors=len(batch))
            warn_once("disk-write", "disk tier write failed (%s); blocks not stored (write_errors)", err)
            with self._lock:
                self._slabs.release(slot for *_, slot in batch)
            return False
        self.stats.add(bytes_written=len(entries) * self.layout.block_bytes)
        return True

    def _commit(self, entries: list[tuple[BlockKey, IndexEntry]]) -> None:
        """The acknowledgement point: after this returns, the blocks survive a crash."""
        replaced = self._index.commit(entries)
        if replaced:
            with self._lock:
                self._slabs.release(replaced)

    # -- removal -------------------------------------------------------------
    def remove(self, key: BlockKey) -> bool:
        return self.remove_many([key]) == 1

    def remove_many(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            gone = self._index.remove(keys)
            self._slabs.release(entry.slot for entry in gone)
        return len(gone)

    def entries(self) -> Iterator[tuple[BlockKey, BlockRecord]]:
        for key, entry in self._index.in_store_order():
            yield key, entry.record

    # -- housekeeping --------------------------------------------------------
    def drop_page_cache(self) -> bool:
        """Evict this tier's slab pages from the OS page cache (for cold-read benchmarks)."""
        return self._slabs.drop_page_cache()

    def slab_path(self, slot: int) -> tuple[Path, int]:
        """File and byte offset of ``slot`` (tests flip bytes there to prove checksums work)."""
        return self._slabs.path_of(slot)

    def slot_of(self, key: BlockKey) -> int | None:
        return self._index.mirror.slot_of(key)

    @property
    def recency(self) -> SlotMirror:
        """The tier's own recency list over what it holds, for an LRU policy to rank by (see the mirror)."""
        return self._index.mirror

    def close(self) -> None:
        """Close the files, seal the index (a quick next open), then release the directory's lock (idempotent)."""
        with self._lock:
            self._slabs.close()
            self._index.close(seal_it=True)
            self._dir.close()

    # -- parts that tests reach for (fault injection, O_DIRECT flags, bounce buffers) --
    @property
    def _fds(self) -> dict[int, int]:
        return self._slabs.fds

    def _file(self, index: int) -> int:
        return self._slabs.file(index)

    def _bounce(self) -> native.Buffer | None:
        return self._slab_io.bounce()


__all__ = [
    "BOUNCE_BYTES",
    "FORMAT_VERSION",
    "SLOT_ALIGN",
    "DiskTier",
    "IOMode",
    "IndexDamage",
    "IndexEntry",
    "decode_record",
    "encode_record",
    "io_mode_for",
    "record_bytes",
]
