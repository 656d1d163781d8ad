"""The disk tier: preallocated slab files of aligned slots, indexed by LMDB.

Files: ``slab-NNNN.bin`` (fixed-size slots, each a multiple of 4096 bytes at a
4096-aligned offset, so O_DIRECT can read them), ``index.lmdb/`` (key →
record) and ``lock`` (:mod:`kvtier.tiers.diskdir`: one opener at a time). The
index is the source of truth; an in-memory mirror of it, loaded at open,
answers lookups without a transaction.

Opening checks before it trusts: the directory is made private (0700, files
0600) and locked; the index is verified by a walker that cannot crash the
process (:func:`kvtier.tiers.diskdir.index_damage`), and every record must
decode and name its own slot. A damaged index is quarantined (moved aside
with its slabs; the tier starts empty) or refused, per
:class:`~kvtier.config.OnCorrupt`. Records whose slab file is missing or too
short are dropped. An index of an older format is wiped, with one log line:
this code cannot read it, and formats before 3 kept the token ids in plain
form, which is exactly what must not linger on disk.

I/O: slabs are opened with O_DIRECT when the filesystem allows it (probed
once at open, :attr:`DiskTier.io_mode`), so blocks skip the page cache and
the host tier is the only copy in memory; otherwise buffered I/O, logged
once. A batch (``get_many``/``put_many``) is one call into
:mod:`kvtier.tiers.native`, which spreads the requests over a few threads
with the GIL released. O_DIRECT needs aligned memory, and torch/numpy
allocations are not page-aligned: requests whose memory is not aligned go
through an aligned bounce buffer (one per calling thread, reused) and are
copied.

Durability order of a store: write the payload → fsync (per :class:`FsyncMode`)
→ commit the index record. A block is *acknowledged* only once its record is
committed, so a crash at any point leaves either no record (the slot is simply
free again at the next open: a slot is free unless the index names it, which
reclaims every orphan with no scan) or a record whose bytes were written
first. Each layer's bytes carry a CRC-32C in the record (the SSE4.2
instruction checks a block far faster than the disk reads it; format 1 used
xxh3-64); a read that fails it, or ends early, is a counted miss and the
record is dropped.

Record encoding (little-endian, no pickle)::

    uint32 slot | uint64 sequence | uint8 has_parent | 16 B parent
    | uint32 crc32c[num_layers] | 32 B token digest (kvtier.keys.KeyHasher.digest)
"""

from __future__ import annotations

import enum
import heapq
import json
import logging
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np
import torch

from kvtier.config import DiskIO, FsyncMode, OnCorrupt, OnMismatch
from kvtier.errors import DiskCorruptError, DiskUnavailableError, KVTierError, TierMismatchError, warn_once
from kvtier.keys import DIGEST_BYTES, KEY_BYTES, BlockDigest, BlockKey
from kvtier.layout import KVLayout
from kvtier.private import FILE_MODE, make_private, private_dir, sync_dir
from kvtier.stats import DiskStats
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord, TierKind
from kvtier.tiers.diskdir import DiskDir, index_damage
from kvtier.tiers.host import SLOT_ALIGN, align_up

log = logging.getLogger("kvtier")

FORMAT_VERSION = 3  # 3: a keyed token digest instead of the token ids; 2: per-layer CRC-32C; 1: xxh3-64
_HEAD = struct.Struct("<IQB16s")
_HEADER_KEY = b"header"
_SEQ_KEY = b"sequence"
_DiskErrors = (OSError, lmdb.Error)
# What liblmdb raises on a damaged file (the verifier should have caught it first).
_LMDB_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.InvalidError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.BadTxnError,
    lmdb.PanicError,
    lmdb.IncompatibleError,
)
# Per calling thread: four 4 MiB slices, one per I/O thread. Adjacent slots of a batch are
# gathered into requests of up to a slice (a SmolLM2 bf16 block is 360 KiB): under O_DIRECT
# large requests keep the disk streaming, while per-request overhead dominates small ones.
BOUNCE_BYTES = 16 * 1024**2


class IOMode(enum.StrEnum):
    """How the slab files are read and written; chosen once, when the tier opens."""

    DIRECT = "direct"  # O_DIRECT: no page cache; aligned requests, bounced when the memory is not aligned
    BUFFERED = "buffered"  # through the page cache: the filesystem refused O_DIRECT, or it was asked for


def io_mode_for(setting: DiskIO) -> IOMode | None:
    """The configured I/O mode; None (``auto``) lets the tier probe O_DIRECT at open."""
    return {DiskIO.BUFFERED: IOMode.BUFFERED, DiskIO.DIRECT: IOMode.DIRECT, DiskIO.AUTO: None}[setting]


@dataclass(frozen=True)
class IndexEntry:
    """One index record, decoded: where the block is, in what order it was stored, and how to check it."""

    slot: int
    seq: int
    checksums: tuple[int, ...]  # CRC-32C per layer
    record: BlockRecord


class IndexDamage(Exception):
    """A header or record this format cannot have: the index is damaged, not merely written for another setup."""


def record_bytes(num_layers: int) -> int:
    return _HEAD.size + 4 * num_layers + DIGEST_BYTES


def encode_record(e: IndexEntry) -> bytes:
    parent = e.record.parent
    head = _HEAD.pack(e.slot, e.seq, parent is not None, parent or bytes(KEY_BYTES))
    return head + struct.pack(f"<{len(e.checksums)}I", *e.checksums) + e.record.digest


def decode_record(key: bytes, value: bytes, num_layers: int) -> IndexEntry:
    """Decode one record; raises :class:`IndexDamage` when its sizes cannot be this format's."""
    if len(key) != KEY_BYTES or len(value) != record_bytes(num_layers):
        want = record_bytes(num_layers)
        raise IndexDamage(f"a record of {len(key)}+{len(value)} B, where this format has {KEY_BYTES}+{want} B")
    slot, seq, has_parent, parent = _HEAD.unpack_from(value)
    checksums = struct.unpack_from(f"<{num_layers}I", value, _HEAD.size)
    digest = BlockDigest(bytes(value[_HEAD.size + 4 * num_layers :]))
    return IndexEntry(slot, seq, checksums, BlockRecord(digest, BlockKey(bytes(parent)) if has_parent else None))


@dataclass(frozen=True)
class _Read:
    """One block (or one layer of it) to read into ``buf``: bytes at ``offset`` checked against ``checksums``."""

    index: int  # in the caller's batch
    key: BlockKey
    entry: IndexEntry
    buf: np.ndarray
    fd: int
    offset: int
    checksums: tuple[int, ...]


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
        self._slots_per_file = max(1, file_bytes // self._slot_bytes)
        self._header = {
            "format_version": FORMAT_VERSION,
            "model_fingerprint": model_fingerprint,
            "layout": layout.descriptor,
            "block_size": layout.block_size,
            "num_layers": layout.num_layers,  # with layer_bytes: what `kvtier cache check` needs without the model
            "layer_bytes": layout.layer_bytes,
            "slot_bytes": self._slot_bytes,
            "slots_per_file": self._slots_per_file,
        }
        self._lock = threading.Lock()
        self._io = backend
        self._local = threading.local()  # this thread's bounce buffer
        self._fds: dict[int, int] = {}
        self._index: dict[BlockKey, IndexEntry] = {}
        self._seq = 0
        self._dir = DiskDir.open(self.path)
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
        if not self._io.native:
            warn_once(
                "disk-python-io",
                "kvtier._native is not built (%s); the disk tier uses pure-Python I/O and CRC-32C (slow)",
                native.NATIVE_IMPORT_ERROR or "not selected",
            )
        self._io_mode = self._choose_io_mode(io_mode)
        self._flags = os.O_RDWR | (os.O_DIRECT if self._io_mode is IOMode.DIRECT else 0)
        self._open_index(on_mismatch, on_corrupt)
        self._fds = self._open_slabs()
        self._drop_lost()
        used = {e.slot for e in self._index.values()}
        self._free = [s for s in range(self._num_slots) if s not in used]  # sorted: already a heap
        self._dir.warn_if_short_of_space(self.capacity_bytes)

    def _abandon(self) -> None:
        """Undo a failed open: close what was opened and release the lock."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self._close_env()
        self._dir.close()

    def _close_env(self) -> None:
        env = self.__dict__.pop("_env", None)  # absent until the index opened
        if env is not None:
            env.close()

    def _choose_io_mode(self, wanted: IOMode | None) -> IOMode:
        if wanted is IOMode.BUFFERED:
            return IOMode.BUFFERED
        refused = native.probe_direct(self.path, self._io)
        if refused is None:
            return IOMode.DIRECT
        if wanted is IOMode.DIRECT:
            raise KVTierError(f"disk tier at {self.path}: O_DIRECT asked for but refused here ({refused})")
        warn_once(
            "disk-buffered",
            "disk tier at %s: the filesystem refuses O_DIRECT (%s); using buffered I/O through the page cache",
            self.path,
            refused,
        )
        return IOMode.BUFFERED

    def _open_index(self, on_mismatch: OnMismatch, on_corrupt: OnCorrupt) -> None:
        """Verify, open and load the index; a damaged one is quarantined (the tier starts empty) or refused."""
        damage = index_damage(self._dir.index_path)
        if damage is None:
            try:
                self._env = self._open_env(on_mismatch)
                self._load_index()
                return
            except (IndexDamage, *_LMDB_DAMAGE) as err:
                damage = f"{type(err).__name__}: {err}"
            self._close_env()
            self._index, self._seq = {}, 0
        self._on_damage(damage, on_corrupt)
        self._env = self._open_env(on_mismatch)

    def _on_damage(self, damage: str, on_corrupt: OnCorrupt) -> None:
        data = self._dir.index_path / "data.mdb"
        if on_corrupt is OnCorrupt.ERROR:
            raise DiskCorruptError(
                f"disk tier index {data} is damaged ({damage}); see `kvtier cache check`, move {self.path} "
                "aside, or set disk.on_corrupt: quarantine"
            )
        where = self._dir.quarantine()
        self.stats.add(quarantined=1)
        log.warning(
            "disk tier index %s is damaged (%s); moved it and its slab files to %s and started empty",
            data,
            damage,
            where,
        )

    def _open_env(self, on_mismatch: OnMismatch) -> lmdb.Environment:
        """Open the index and check its header: a new index gets ours; another setup's is refused or wiped."""
        env = self._lmdb_env()
        try:
            found = self._stored_header(env)
        except BaseException:
            env.close()
            raise
        diff = {} if found is None else {k: (found.get(k), v) for k, v in self._header.items() if found.get(k) != v}
        if not diff:
            return env
        env.close()
        version = found.get("format_version") if found is not None else None
        if isinstance(version, int) and version < FORMAT_VERSION:
            log.warning(
                "wiping the disk tier at %s: it is format %d, which this version cannot read (format %d "
                "keeps a keyed digest of each block's tokens, never the token ids)",
                self.path,
                version,
                FORMAT_VERSION,
            )
        elif on_mismatch is OnMismatch.ERROR:
            detail = ", ".join(f"{k}: stored {a!r} != wanted {b!r}" for k, (a, b) in diff.items())
            raise TierMismatchError(
                f"disk tier at {self.path} was written for another configuration ({detail}); "
                "point disk.path elsewhere or set disk.on_mismatch: wipe to erase it"
            )
        else:
            warn_once("disk-wipe", "wiping disk tier at %s: %s", self.path, sorted(diff))
        self._dir.wipe()
        return self._open_env(OnMismatch.ERROR)

    def _stored_header(self, env: lmdb.Environment) -> dict[str, object] | None:
        """The header the index holds, or None after writing ours into a new one."""
        with env.begin(write=True, db=self._meta) as txn:
            raw = txn.get(_HEADER_KEY)
            if raw is None:
                if txn.stat(self._blocks)["entries"]:
                    raise IndexDamage("block records without a header")
                txn.put(_HEADER_KEY, json.dumps(self._header, sort_keys=True).encode())
                return None
        try:
            found = json.loads(raw)
        except ValueError:
            raise IndexDamage("an unreadable header") from None
        if not isinstance(found, dict):
            raise IndexDamage("an unreadable header")
        return found

    def _lmdb_env(self) -> lmdb.Environment:
        size = record_bytes(self.layout.num_layers) + KEY_BYTES
        map_size = 64 * 1024**2 + self._num_slots * 2 * align_up(size + 64, 512)
        sync = self.fsync is not FsyncMode.NEVER
        index = private_dir(self._dir.index_path)
        try:
            env = lmdb.open(
                str(index),
                map_size=map_size,
                max_dbs=2,
                sync=sync,
                metasync=sync,
                readahead=False,
                mode=FILE_MODE,
            )
        except _LMDB_DAMAGE:
            raise
        except lmdb.Error as err:
            raise DiskUnavailableError(f"disk tier index {index} cannot be opened: {err}") from err
        try:
            self._blocks = env.open_db(b"blocks")
            self._meta = env.open_db(b"meta")
        except BaseException:
            env.close()
            raise
        for name in ("data.mdb", "lock.mdb"):
            make_private(index / name)  # made before this rule, or under a looser umask
        sync_dir(index)  # LMDB syncs its file at every commit, never the name that finds it
        return env

    def _open_slabs(self) -> dict[int, int]:
        """Open the slab files that exist (made private); the others are created when a slot in them is first used."""
        fds = {}
        for i in range(-(-self._num_slots // self._slots_per_file)):
            path = self._dir.slab_path(i)
            if path.exists():
                make_private(path)
                fds[i] = os.open(path, self._flags)
        return fds

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
                self._fds[index] = self._create_slab(index)
            return self._fds[index]

    def _create_slab(self, index: int) -> int:
        path = self._dir.slab_path(index)
        slots = min(self._slots_per_file, self._num_slots - index * self._slots_per_file)
        size = slots * self._slot_bytes
        fd = os.open(path, self._flags | os.O_CREAT, FILE_MODE)
        try:
            if os.fstat(fd).st_size < size:
                self._preallocate(fd, path, size)
            sync_dir(self.path)  # before any block in it is acknowledged: a synced file without a name is lost
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _preallocate(self, fd: int, path: Path, size: int) -> None:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            warn_once(
                "disk-fallocate",
                "disk tier: cannot preallocate %s (%s); it is a sparse file, and writes into it fail if the disk fills",
                path,
                err.strerror or err,
            )
            os.ftruncate(fd, size)

    def _load_index(self) -> None:
        """Mirror the index in memory, dropping records past the capacity (it shrank since they were written)."""
        stale = []
        slots: set[int] = set()
        with self._env.begin(db=self._blocks) as txn:
            for key, value in txn.cursor():
                entry = decode_record(key, value, self.layout.num_layers)
                if entry.slot in slots:
                    raise IndexDamage(f"two records name slot {entry.slot}")
                slots.add(entry.slot)
                if entry.slot >= self._num_slots:
                    stale.append(BlockKey(bytes(key)))
                    continue
                self._index[BlockKey(bytes(key))] = entry
                self._seq = max(self._seq, entry.seq)
        self._forget(stale)

    def _drop_lost(self) -> None:
        """Forget records whose slab file is missing or too short to hold their block.

        A slab deleted under a stopped tier would be recreated full of zeros
        (one truncated, read short) while its records stay indexed: a failed
        read on every pass. Their slots go back to the free list.
        """
        sizes = {i: os.fstat(fd).st_size for i, fd in self._fds.items()}
        lost = [k for k, e in self._index.items() if self._slot_end(e.slot) > sizes.get(self._file_of(e.slot), 0)]
        if not lost:
            return
        self._forget(lost)
        for key in lost:
            del self._index[key]
        self.stats.add(lost_blocks=len(lost))
        log.warning(
            "disk tier at %s: %d indexed blocks point into missing or short slab files; dropped (lost_blocks)",
            self.path,
            len(lost),
        )

    def _forget(self, keys: Iterable[BlockKey]) -> None:
        """Delete records from the index file (at open, before the in-memory mirror is in use)."""
        keys = list(keys)
        if keys:
            with self._env.begin(write=True, db=self._blocks) as txn:
                for key in keys:
                    txn.delete(key)

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
        return (self._num_slots - len(self._free)) * self._slot_bytes

    def __len__(self) -> int:
        return len(self._index)

    def free_blocks(self) -> int:
        return len(self._free)

    def _file_of(self, slot: int) -> int:
        return slot // self._slots_per_file

    def _offset_of(self, slot: int) -> int:
        return (slot % self._slots_per_file) * self._slot_bytes

    def _slot_end(self, slot: int) -> int:
        """The byte after ``slot``'s block in its slab file: how long the file must be to hold it."""
        return self._offset_of(slot) + self.layout.block_bytes

    def _where(self, slot: int) -> tuple[int, int]:
        return self._file(self._file_of(slot)), self._offset_of(slot)

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
        return self.get_many([key], [out])[0]

    def get_layer(self, key: BlockKey, layer: int, out: torch.Tensor) -> bool:
        entry = self._index.get(key)
        if entry is None:
            return False
        first = self.layout.layer_offset(layer)
        ok = self._read([key], [entry], [out], nbytes=self.layout.layer_bytes, first=first, first_layer=layer)
        return ok[0]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """All present blocks in one batched native read, whose threads also take each layer's CRC-32C."""
        results = [False] * len(keys)
        found = [(i, e) for i, e in enumerate(self._index.get(k) for k in keys) if e is not None]
        if not found:
            return results
        ok = self._read(
            [keys[i] for i, _ in found],
            [e for _, e in found],
            [outs[i] for i, _ in found],
            nbytes=self.layout.block_bytes,
            first=0,
            first_layer=0,
        )
        for (i, _), good in zip(found, ok, strict=True):
            results[i] = good
        return results

    def _read(
        self,
        keys: list[BlockKey],
        entries: list[IndexEntry],
        outs: list[torch.Tensor],
        *,
        nbytes: int,
        first: int,
        first_layer: int,
    ) -> list[bool]:
        """Read ``nbytes`` at byte ``first`` (layer ``first_layer``) of each entry's slot into its out, in one call."""
        results = [False] * len(keys)
        layers = nbytes // self.layout.layer_bytes
        reads: list[_Read] = []
        for i, (key, entry, out) in enumerate(zip(keys, entries, outs, strict=True)):
            buf = out.numpy()
            if buf.nbytes != nbytes:
                self.stats.add(errors=1)  # an out of the wrong size: never read past the slot
                continue
            fd, offset = self._where(entry.slot)
            sums = entry.checksums[first_layer : first_layer + layers]
            reads.append(_Read(i, key, entry, buf, fd, offset + first, sums))
        try:
            counts, sums = self._io.preadv_crc32c_batch(
                [r.fd for r in reads],
                [r.buf for r in reads],
                [r.offset for r in reads],
                self.layout.layer_bytes,
                self._bounce(),
            )
        except OSError as err:
            self.stats.add(errors=len(reads), read_errors=len(reads))
            warn_once("disk-read", "disk tier read failed (%s); serving misses (read_errors)", err)
            return results
        for r, got, crcs in zip(reads, counts, sums, strict=True):
            results[r.index] = self._verify(r, got == nbytes, tuple(crcs))
        return results

    def _verify(self, r: _Read, whole: bool, crcs: tuple[int, ...]) -> bool:
        if not whole:  # the slab ends early: truncated under us, and it will not grow back
            self.stats.add(lost_blocks=1)
            warn_once("disk-short", "disk tier block ends past its slab file's end (truncated); dropped (lost_blocks)")
            self._drop_unreadable(r)
            return False
        if crcs != r.checksums:
            self.stats.add(checksum_failures=1)
            warn_once("disk-checksum", "disk tier block failed its checksum; dropped (counted in checksum_failures)")
            self._drop_unreadable(r)
            return False
        self.stats.add(bytes_read=r.buf.nbytes)
        return True

    def _bounce(self) -> native.Buffer | None:
        """This thread's aligned bounce buffer (O_DIRECT only), allocated on first use and kept."""
        if self._io_mode is IOMode.BUFFERED:
            return None
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = self._io.alloc_aligned(BOUNCE_BYTES, SLOT_ALIGN)
        return bounce

    def _drop_unreadable(self, r: _Read) -> None:
        """Forget a block whose bytes failed their read, unless it was replaced meanwhile.

        Kept, it would fail every lookup that reaches it again; dropped, its
        slot is free for a block that can be read.
        """
        with self._lock:
            if self._index.get(r.key) is not r.entry:
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
        results, todo = self._allocate(keys, records)
        if not todo:
            return results
        batches = [[t] for t in todo] if self.fsync is FsyncMode.ALWAYS else [todo]
        for batch in batches:
            ok = self._write_batch([(keys[i], datas[i], records[i], slot) for i, slot in batch])
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
                    results[i] = entry.record.matches(record.digest)
                elif key in seen:
                    continue
                elif self._free:
                    todo.append((i, heapq.heappop(self._free)))
                    seen.add(key)
                else:
                    self.stats.add(rejected_stores=1)
        return results, todo

    def _write_batch(self, batch: list[tuple[BlockKey, np.ndarray, BlockRecord, int]]) -> bool:
        try:
            where = [self._where(slot) for *_, slot in batch]
            checksums = self._io.pwritev_crc32c_batch(
                [fd for fd, _ in where],
                [data for _, data, _, _ in batch],
                [off for _, off in where],
                self.layout.layer_bytes,
                self._bounce(),
            )
            if self.fsync is not FsyncMode.NEVER:
                for fd in {fd for fd, _ in where}:
                    self._io.fsync(fd)
            with self._lock:
                first = self._seq + 1
                self._seq += len(batch)
            entries = [
                (key, IndexEntry(slot, first + n, tuple(sums), record))
                for n, ((key, _, record, slot), sums) in enumerate(zip(batch, checksums, strict=True))
            ]
            self._commit(entries)
        except _DiskErrors as err:
            self.stats.add(errors=1, write_errors=len(batch))
            warn_once("disk-write", "disk tier write failed (%s); blocks not stored (write_errors)", err)
            with self._lock:
                for *_, slot in batch:
                    heapq.heappush(self._free, slot)
            return False
        self.stats.add(bytes_written=len(entries) * self.layout.block_bytes)
        return True

    def _commit(self, entries: list[tuple[BlockKey, IndexEntry]]) -> None:
        """The acknowledgement point: after this returns, the blocks survive a crash."""
        with self._env.begin(write=True, db=self._blocks) as txn:
            for key, entry in entries:
                txn.put(key, encode_record(entry))
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
        return self._dir.slab_path(self._file_of(slot)), self._offset_of(slot)

    def slot_of(self, key: BlockKey) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry.slot

    def close(self) -> None:
        """Close the files and the index, then release the directory's lock (idempotent)."""
        with self._lock:
            self._abandon()


__all__ = [
    "BOUNCE_BYTES",
    "FORMAT_VERSION",
    "SLOT_ALIGN",
    "DiskTier",
    "IOMode",
    "IndexDamage",
    "IndexEntry",
    "decode_record",
    "record_bytes",
]
