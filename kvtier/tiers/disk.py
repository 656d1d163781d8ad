"""The disk tier: preallocated slab files of aligned slots, indexed by LMDB.

Files: ``slab-NNNN.bin`` (fixed-size slots, each a multiple of 4096 bytes at a
4096-aligned offset, so O_DIRECT can read them) and ``index.lmdb/`` (key →
record). The index is the source of truth; an in-memory mirror of it, loaded
at open, answers lookups without a transaction.

Durability order of a store: write the payload → fsync (per :class:`FsyncMode`)
→ commit the index record. A block is *acknowledged* only once its record is
committed, so a crash at any point leaves either no record (the slot is simply
free again at the next open: a slot is free unless the index names it, which
reclaims every orphan with no scan) or a record whose bytes were written
first. Each layer's bytes carry an xxh3-64 checksum in the record; a read that
fails it is a counted miss and the record is dropped.

Record encoding (little-endian, no pickle)::

    uint32 slot | uint64 sequence | uint8 has_parent | 16 B parent
    | uint64 checksum[num_layers] | int32 tokens[block_size]
"""

from __future__ import annotations

import heapq
import json
import os
import shutil
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import torch
import xxhash

from kvtier.config import FsyncMode, OnMismatch
from kvtier.errors import TierMismatchError, warn_once
from kvtier.keys import KEY_BYTES, BlockKey
from kvtier.layout import KVLayout
from kvtier.stats import TierStats
from kvtier.tiers.base import BlockRecord, TierKind
from kvtier.tiers.host import SLOT_ALIGN, align_up

FORMAT_VERSION = 1
_HEAD = struct.Struct("<IQB16s")
_HEADER_KEY = b"header"
_SEQ_KEY = b"sequence"
_DiskErrors = (OSError, lmdb.Error)


@dataclass(frozen=True)
class _Entry:
    slot: int
    seq: int
    checksums: np.ndarray  # uint64 [num_layers]
    record: BlockRecord


def _layer_checksums(payload: np.ndarray, layout: KVLayout) -> np.ndarray:
    lb = layout.layer_bytes
    return np.array(
        [xxhash.xxh3_64_intdigest(payload[i * lb : (i + 1) * lb]) for i in range(layout.num_layers)],
        dtype="<u8",
    )


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
    ) -> None:
        self.layout = layout
        self.stats = TierStats()
        self.path = Path(path)
        self.fsync = fsync
        self._slot_bytes = align_up(layout.block_bytes)
        self._num_slots = capacity_bytes // self._slot_bytes
        if self._num_slots == 0:
            raise ValueError(f"disk capacity {capacity_bytes} B holds no block of {self._slot_bytes} B")
        self._slots_per_file = max(1, file_bytes // self._slot_bytes)
        self._header = {
            "format_version": FORMAT_VERSION,
            "model_fingerprint": model_fingerprint,
            "layout": layout.descriptor,
            "block_size": layout.block_size,
            "slot_bytes": self._slot_bytes,
            "slots_per_file": self._slots_per_file,
        }
        self._lock = threading.Lock()
        self.path.mkdir(parents=True, exist_ok=True)
        self._env = self._open_index(on_mismatch)
        self._fds = self._open_slabs()
        self._index: dict[BlockKey, _Entry] = {}
        self._seq = 0
        self._load_index()
        used = {e.slot for e in self._index.values()}
        self._free = [s for s in range(self._num_slots) if s not in used]  # sorted: already a heap

    # -- opening -------------------------------------------------------------
    def _open_index(self, on_mismatch: OnMismatch) -> lmdb.Environment:
        env = self._lmdb_env()
        with env.begin(write=True, db=self._meta) as txn:
            raw = txn.get(_HEADER_KEY)
            if raw is None:
                txn.put(_HEADER_KEY, json.dumps(self._header, sort_keys=True).encode())
                return env
        found = json.loads(raw)
        diff = {k: (found.get(k), v) for k, v in self._header.items() if found.get(k) != v}
        if not diff:
            return env
        if on_mismatch is OnMismatch.ERROR:
            env.close()
            detail = ", ".join(f"{k}: stored {a!r} != wanted {b!r}" for k, (a, b) in diff.items())
            raise TierMismatchError(
                f"disk tier at {self.path} was written for another configuration ({detail}); "
                "point disk.path elsewhere or set disk.on_mismatch: wipe to erase it"
            )
        env.close()
        warn_once("disk-wipe", "wiping disk tier at %s: %s", self.path, sorted(diff))
        shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        return self._open_index(OnMismatch.ERROR)

    def _lmdb_env(self) -> lmdb.Environment:
        record_bytes = _HEAD.size + 8 * self.layout.num_layers + 4 * self.layout.block_size + KEY_BYTES
        map_size = 64 * 1024**2 + self._num_slots * 2 * align_up(record_bytes + 64, 512)
        sync = self.fsync is not FsyncMode.NEVER
        env = lmdb.open(
            str(self.path / "index.lmdb"), map_size=map_size, max_dbs=2, sync=sync, metasync=sync, readahead=False
        )
        self._blocks = env.open_db(b"blocks")
        self._meta = env.open_db(b"meta")
        return env

    def _open_slabs(self) -> dict[int, int]:
        """Open the slab files that exist; the others are created when a slot in them is first used."""
        return {
            i: os.open(self.path / f"slab-{i:04d}.bin", os.O_RDWR)
            for i in range(-(-self._num_slots // self._slots_per_file))
            if (self.path / f"slab-{i:04d}.bin").exists()
        }

    def _file(self, index: int) -> int:
        """The fd of slab file ``index``, creating it at its full, preallocated size on first use.

        Files are preallocated whole (``posix_fallocate``) so a later write
        never fails for lack of space half-way; creating them only as the
        free list reaches them (lowest slots first) keeps a large configured
        capacity from claiming the disk before it holds anything.
        """
        fd = self._fds.get(index)
        if fd is not None:
            return fd
        with self._lock:
            if index not in self._fds:
                slots = min(self._slots_per_file, self._num_slots - index * self._slots_per_file)
                fd = os.open(self.path / f"slab-{index:04d}.bin", os.O_RDWR | os.O_CREAT, 0o600)
                size = slots * self._slot_bytes
                if os.fstat(fd).st_size < size:
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError:
                        os.ftruncate(fd, size)  # a filesystem without fallocate: a sparse file
                self._fds[index] = fd
            return self._fds[index]

    def _load_index(self) -> None:
        stale = []
        with self._env.begin(db=self._blocks) as txn:
            for key, value in txn.cursor():
                entry = self._decode(value)
                if entry.slot >= self._num_slots:
                    stale.append(key)  # capacity shrank since it was written
                    continue
                self._index[BlockKey(bytes(key))] = entry
                self._seq = max(self._seq, entry.seq)
        if stale:
            with self._env.begin(write=True, db=self._blocks) as txn:
                for key in stale:
                    txn.delete(key)

    # -- record encoding -----------------------------------------------------
    def _encode(self, e: _Entry) -> bytes:
        parent = e.record.parent
        head = _HEAD.pack(e.slot, e.seq, parent is not None, parent or bytes(KEY_BYTES))
        return head + e.checksums.astype("<u8").tobytes() + e.record.tokens.astype("<i4").tobytes()

    def _decode(self, value: bytes) -> _Entry:
        slot, seq, has_parent, parent = _HEAD.unpack_from(value)
        n = self.layout.num_layers
        checksums = np.frombuffer(value, dtype="<u8", count=n, offset=_HEAD.size).copy()
        tokens = np.frombuffer(value, dtype="<i4", offset=_HEAD.size + 8 * n).astype(np.int32)
        return _Entry(slot, seq, checksums, BlockRecord(tokens, BlockKey(parent) if has_parent else None))

    # -- sizes ---------------------------------------------------------------
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
        return (self._num_slots - len(self._free)) * self._slot_bytes

    def __len__(self) -> int:
        return len(self._index)

    def free_blocks(self) -> int:
        return len(self._free)

    def _where(self, slot: int) -> tuple[int, int]:
        return self._file(slot // self._slots_per_file), (slot % self._slots_per_file) * self._slot_bytes

    # -- lookups -------------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        return key in self._index

    def contains_many(self, keys: Sequence[BlockKey]) -> list[bool]:
        return [k in self._index for k in keys]

    def record(self, key: BlockKey) -> BlockRecord | None:
        entry = self._index.get(key)
        return None if entry is None else entry.record

    # -- reads ---------------------------------------------------------------
    def get(self, key: BlockKey, out: torch.Tensor) -> bool:
        return self._read(key, out, None)

    def get_layer(self, key: BlockKey, layer: int, out: torch.Tensor) -> bool:
        return self._read(key, out, layer)

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        return [self._read(k, o, None) for k, o in zip(keys, outs, strict=True)]

    def _read(self, key: BlockKey, out: torch.Tensor, layer: int | None) -> bool:
        entry = self._index.get(key)
        if entry is None:
            return False
        fd, offset = self._where(entry.slot)
        if layer is None:
            nbytes, first, layers = self.layout.block_bytes, 0, range(self.layout.num_layers)
        else:
            nbytes, first, layers = self.layout.layer_bytes, self.layout.layer_offset(layer), range(layer, layer + 1)
        buf = out.numpy()
        try:
            got = os.preadv(fd, [buf], offset + first)
        except OSError as err:
            self.stats.add(errors=1)
            warn_once("disk-read", "disk tier read failed (%s); serving misses", err)
            return False
        if got != nbytes:
            self.stats.add(errors=1)
            return False
        lb = self.layout.layer_bytes
        for i, layer_i in enumerate(layers):
            if xxhash.xxh3_64_intdigest(buf[i * lb : (i + 1) * lb]) != int(entry.checksums[layer_i]):
                self._drop_corrupt(key, entry)
                return False
        self.stats.add(bytes_read=nbytes)
        return True

    def _drop_corrupt(self, key: BlockKey, entry: _Entry) -> None:
        """Forget a block whose bytes fail their checksum, unless it was replaced meanwhile."""
        self.stats.add(checksum_failures=1)
        warn_once("disk-checksum", "disk tier block failed its checksum; dropped (counted in checksum_failures)")
        with self._lock:
            if self._index.get(key) is not entry:
                return  # the slot was reused while we read it: a race, not corruption on disk
        self.remove(key)

    # -- stores --------------------------------------------------------------
    def put(self, key: BlockKey, payload: torch.Tensor, record: BlockRecord) -> bool:
        return self.put_many([key], [payload], [record])[0]

    def put_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[torch.Tensor], records: Sequence[BlockRecord]
    ) -> list[bool]:
        """Write → fsync → commit, per block (``always``) or once for the batch (``batch``/``never``)."""
        results, todo = self._allocate(keys, records)
        if not todo:
            return results
        batches = [[t] for t in todo] if self.fsync is FsyncMode.ALWAYS else [todo]
        for batch in batches:
            ok = self._write_batch([(i, keys[i], payloads[i], records[i], slot) for i, slot in batch])
            for i, _ in batch:
                results[i] = ok
        return results

    def _allocate(
        self, keys: Sequence[BlockKey], records: Sequence[BlockRecord]
    ) -> tuple[list[bool], list[tuple[int, int]]]:
        results = [False] * len(keys)
        todo: list[tuple[int, int]] = []
        seen: set[BlockKey] = set()
        with self._lock:
            for i, (key, record) in enumerate(zip(keys, records, strict=True)):
                entry = self._index.get(key)
                if entry is not None:
                    results[i] = entry.record.matches(record.tokens)
                elif key in seen:
                    continue
                elif self._free:
                    todo.append((i, heapq.heappop(self._free)))
                    seen.add(key)
                else:
                    self.stats.add(rejected_stores=1)
        return results, todo

    def _write_batch(self, batch: list[tuple[int, BlockKey, torch.Tensor, BlockRecord, int]]) -> bool:
        entries: list[tuple[BlockKey, _Entry]] = []
        try:
            touched: set[int] = set()
            for _, key, payload, record, slot in batch:
                data = payload.reshape(-1).view(torch.uint8).numpy()
                fd, offset = self._where(slot)
                if os.pwritev(fd, [data], offset) != data.nbytes:
                    raise OSError("short write to disk tier slab")
                touched.add(fd)
                with self._lock:
                    self._seq += 1
                    seq = self._seq
                entries.append((key, _Entry(slot, seq, _layer_checksums(data, self.layout), record)))
            if self.fsync is not FsyncMode.NEVER:
                for fd in touched:
                    os.fsync(fd)
            self._commit(entries)
        except _DiskErrors as err:
            self.stats.add(errors=1)
            warn_once("disk-write", "disk tier write failed (%s); blocks not stored", err)
            with self._lock:
                for *_, slot in batch:
                    heapq.heappush(self._free, slot)
            return False
        self.stats.add(bytes_written=len(entries) * self.layout.block_bytes)
        return True

    def _commit(self, entries: list[tuple[BlockKey, _Entry]]) -> None:
        """The acknowledgement point: after this returns, the blocks survive a crash."""
        with self._env.begin(write=True, db=self._blocks) as txn:
            for key, entry in entries:
                txn.put(key, self._encode(entry))
        with self._lock:
            for key, entry in entries:
                self._index[key] = entry

    # -- removal -------------------------------------------------------------
    def remove(self, key: BlockKey) -> bool:
        return self.remove_many([key]) == 1

    def remove_many(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            gone = [(k, self._index.pop(k)) for k in dict.fromkeys(keys) if k in self._index]
            if not gone:
                return 0
            try:
                with self._env.begin(write=True, db=self._blocks) as txn:
                    for key, _ in gone:
                        txn.delete(key)
            except lmdb.Error as err:
                self.stats.add(errors=1)
                warn_once("disk-remove", "disk tier index delete failed (%s)", err)
                for key, entry in gone:
                    self._index[key] = entry
                return 0
            for _, entry in gone:
                heapq.heappush(self._free, entry.slot)
        return len(gone)

    def entries(self) -> Iterator[tuple[BlockKey, BlockRecord]]:
        with self._lock:
            items = sorted(self._index.items(), key=lambda kv: kv[1].seq)
        for key, entry in items:
            yield key, entry.record

    # -- housekeeping --------------------------------------------------------
    def drop_page_cache(self) -> bool:
        """Evict this tier's slab pages from the OS page cache (for cold-read benchmarks)."""
        try:
            for fd in self._fds.values():
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return False
        return True

    def slab_path(self, slot: int) -> tuple[Path, int]:
        """File and byte offset of ``slot`` (tests flip bytes there to prove checksums work)."""
        return self.path / f"slab-{slot // self._slots_per_file:04d}.bin", (
            slot % self._slots_per_file
        ) * self._slot_bytes

    def slot_of(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry.slot

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
            self._env.close()


__all__ = ["FORMAT_VERSION", "SLOT_ALIGN", "DiskTier"]
