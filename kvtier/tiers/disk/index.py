"""The disk tier's index: an LMDB file of key → record, the source of truth, and its in-memory mirror.

A record names a block's slot, its store order and its per-layer checksums.
Committing records is the acknowledgement point of a store (see
:mod:`kvtier.tiers.disk` for the order that makes it so); the mirror, loaded
once at open, answers lookups without a transaction.

Opening checks before it trusts: the index is verified by a walker that
cannot crash the process (:func:`kvtier.tiers.disk.directory.index_damage`), and
every record must decode and name its own slot. A damaged index is
quarantined (moved aside with its slabs; the tier starts empty) or refused,
per :class:`~kvtier.config.OnCorrupt`. An index written for another setup is
refused or wiped per :class:`~kvtier.config.OnMismatch`. An index of an older
format is wiped, with one log line: this code cannot read it, and formats
before 3 kept the token ids in plain form, which is exactly what must not
linger on disk.

Record encoding (little-endian, no pickle)::

    uint32 slot | uint64 sequence | uint8 has_parent | 16 B parent
    | uint32 crc32c[num_layers] | 32 B token digest (kvtier.keys.KeyHasher.digest)
"""

from __future__ import annotations

import functools
import json
import logging
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import lmdb
import numpy as np

from kvtier.config import FsyncMode, OnCorrupt, OnMismatch
from kvtier.errors import DiskCorruptError, DiskUnavailableError, TierMismatchError, warn_once
from kvtier.keys import DIGEST_BYTES, KEY_BYTES, BlockDigest, BlockKey
from kvtier.layout import KVLayout
from kvtier.private import FILE_MODE, make_private, private_dir, sync_dir
from kvtier.stats import DiskStats
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk.directory import DiskDir, index_damage
from kvtier.tiers.host import align_up

log = logging.getLogger("kvtier")

FORMAT_VERSION = 3  # 3: a keyed token digest instead of the token ids; 2: per-layer CRC-32C; 1: xxh3-64
_HEAD = struct.Struct("<IQB16s")
_HEADER_KEY = b"header"
_SEQ_KEY = b"sequence"
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


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One index record, decoded: where the block is, in what order it was stored, and how to check it."""

    slot: int
    seq: int
    checksums: bytes  # CRC-32C per layer, packed (:func:`pack_checksums`): the mirror holds one per block
    record: BlockRecord


class IndexDamage(Exception):
    """A header or record this format cannot have: the index is damaged, not merely written for another setup."""


def pack_checksums(crcs: Sequence[int]) -> bytes:
    """Per-layer CRC-32Cs as the record stores them (little-endian uint32 each).

    Kept packed in memory too: a tuple of Python ints costs about 40 bytes per
    layer per block, which the disk tier's mirror pays for every block it indexes.
    """
    return struct.pack(f"<{len(crcs)}I", *crcs)


def record_bytes(num_layers: int) -> int:
    return _HEAD.size + 4 * num_layers + DIGEST_BYTES


def encode_record(e: IndexEntry) -> bytes:
    parent = e.record.parent
    head = _HEAD.pack(e.slot, e.seq, parent is not None, parent or bytes(KEY_BYTES))
    return head + e.checksums + e.record.digest


def decode_record(key: bytes, value: bytes, num_layers: int) -> IndexEntry:
    """Decode one record; raises :class:`IndexDamage` when its sizes cannot be this format's."""
    if len(key) != KEY_BYTES or len(value) != record_bytes(num_layers):
        want = record_bytes(num_layers)
        raise IndexDamage(f"a record of {len(key)}+{len(value)} B, where this format has {KEY_BYTES}+{want} B")
    slot, seq, has_parent, parent, checksums, digest = _record_struct(num_layers).unpack(value)
    return IndexEntry(slot, seq, checksums, BlockRecord(BlockDigest(digest), BlockKey(parent) if has_parent else None))


def _store_order(values: Sequence[bytes]) -> list[int]:
    """Indices of encoded records, oldest store first (a record too short for a sequence sorts as 0: it is damage,
    which decoding it reports)."""
    seqs = np.fromiter((int.from_bytes(v[4:12], "little") for v in values), dtype=np.uint64, count=len(values))
    return np.argsort(seqs, kind="stable").tolist()


@functools.cache
def _record_struct(num_layers: int) -> struct.Struct:
    """A whole record in one unpack: a start-up decodes one per indexed block."""
    return struct.Struct(f"{_HEAD.format}{4 * num_layers}s{DIGEST_BYTES}s")


def index_header(
    layout: KVLayout, *, model_fingerprint: str, slot_bytes: int, slots_per_file: int
) -> dict[str, object]:
    """What an index is written for: opening one whose stored header differs refuses or wipes it."""
    return {
        "format_version": FORMAT_VERSION,
        "model_fingerprint": model_fingerprint,
        "layout": layout.descriptor,
        "block_size": layout.block_size,
        "num_layers": layout.num_layers,  # with layer_bytes: what `kvtier cache check` needs without the model
        "layer_bytes": layout.layer_bytes,
        "slot_bytes": slot_bytes,
        "slots_per_file": slots_per_file,
    }


class DiskIndex:
    """The LMDB index of one disk tier and its in-memory mirror.

    Once open, ``mirror`` and ``seq`` change under the tier's lock, which
    this class is given: the tier changes the mirror and its free list in one
    critical section.
    """

    _env: lmdb.Environment  # absent until the index opened, and again once closed

    def __init__(
        self,
        disk: DiskDir,
        layout: KVLayout,
        header: dict[str, object],
        *,
        num_slots: int,
        fsync: FsyncMode,
        stats: DiskStats,
        lock: threading.Lock,
    ) -> None:
        self.mirror: dict[BlockKey, IndexEntry] = {}
        self.seq = 0  # the highest sequence number stored: store order, oldest first
        self._dir = disk
        self._layout = layout
        self._header = header
        self._num_slots = num_slots
        self._fsync = fsync
        self._stats = stats
        self._lock = lock

    # -- opening -------------------------------------------------------------
    def open(self, on_mismatch: OnMismatch, on_corrupt: OnCorrupt) -> None:
        """Verify, open and load the index; a damaged one is quarantined (the tier starts empty) or refused."""
        damage = index_damage(self._dir.index_path)
        if damage is None:
            try:
                self._env = self._open_env(on_mismatch)
                self._load()
                return
            except (IndexDamage, *_LMDB_DAMAGE) as err:
                damage = f"{type(err).__name__}: {err}"
            self.close()
            self.mirror.clear()
            self.seq = 0
        self._on_damage(damage, on_corrupt)
        self._env = self._open_env(on_mismatch)

    def close(self) -> None:
        env = self.__dict__.pop("_env", None)  # absent until the index opened
        if env is not None:
            env.close()

    def _on_damage(self, damage: str, on_corrupt: OnCorrupt) -> None:
        data = self._dir.index_path / "data.mdb"
        if on_corrupt is OnCorrupt.ERROR:
            raise DiskCorruptError(
                f"disk tier index {data} is damaged ({damage}); see `kvtier cache check`, move {self._dir.path} "
                "aside, or set disk.on_corrupt: quarantine"
            )
        where = self._dir.quarantine()
        self._stats.add(quarantined=1)
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
                self._dir.path,
                version,
                FORMAT_VERSION,
            )
        elif on_mismatch is OnMismatch.ERROR:
            detail = ", ".join(f"{k}: stored {a!r} != wanted {b!r}" for k, (a, b) in diff.items())
            raise TierMismatchError(
                f"disk tier at {self._dir.path} was written for another configuration ({detail}); "
                "point disk.path elsewhere or set disk.on_mismatch: wipe to erase it"
            )
        else:
            warn_once("disk-wipe", "wiping disk tier at %s: %s", self._dir.path, sorted(diff))
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
        size = record_bytes(self._layout.num_layers) + KEY_BYTES
        map_size = 64 * 1024**2 + self._num_slots * 2 * align_up(size + 64, 512)
        sync = self._fsync is not FsyncMode.NEVER
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

    def _load(self) -> None:
        """Mirror the index in memory, dropping records past the capacity (it shrank since they were written).

        Every record is read first, then decoded oldest store first, not in
        the file's key order (random): the records read are freed together,
        their memory given back instead of left in holes between the mirror's
        objects; a chain's objects are made one after another; and the
        policies' rebuild sorts a mirror already in store order. Over 10^7
        blocks (``kvtier bench scale``'s layout, alternated twice): resident
        memory 629 -> 568 B a block, start-up 113 / 102 -> 103 / 95 s.
        """
        stale = []
        slots: set[int] = set()
        with self._env.begin(db=self._blocks) as txn:
            keys = list(txn.cursor().iternext(keys=True, values=False))
            values = list(txn.cursor().iternext(keys=False, values=True))
        for i in _store_order(values):
            key, value = keys[i], values[i]
            entry = decode_record(key, value, self._layout.num_layers)
            if entry.slot in slots:
                raise IndexDamage(f"two records name slot {entry.slot}")
            slots.add(entry.slot)
            if entry.slot >= self._num_slots:
                stale.append(BlockKey(bytes(key)))
                continue
            self.mirror[BlockKey(bytes(key))] = entry
            self.seq = max(self.seq, entry.seq)
        self._forget(stale)

    def drop_lost(self, holding: Callable[[int], bool]) -> None:
        """Forget records whose slab file is missing or too short to hold their block (``holding`` says which).

        A slab deleted under a stopped tier would be recreated full of zeros
        (one truncated, read short) while its records stay indexed: a failed
        read on every pass. Their slots go back to the free list.
        """
        lost = [k for k, e in self.mirror.items() if not holding(e.slot)]
        if not lost:
            return
        self._forget(lost)
        for key in lost:
            del self.mirror[key]
        self._stats.add(lost_blocks=len(lost))
        log.warning(
            "disk tier at %s: %d indexed blocks point into missing or short slab files; dropped (lost_blocks)",
            self._dir.path,
            len(lost),
        )

    def _forget(self, keys: Iterable[BlockKey]) -> None:
        """Delete records from the index file (at open, before the in-memory mirror is in use)."""
        keys = list(keys)
        if keys:
            with self._env.begin(write=True, db=self._blocks) as txn:
                for key in keys:
                    txn.delete(key)

    # -- in use --------------------------------------------------------------
    def next_seqs(self, n: int) -> int:
        """Reserve ``n`` sequence numbers for a batch of stores; returns the first."""
        with self._lock:
            first = self.seq + 1
            self.seq += n
        return first

    def commit(self, entries: list[tuple[BlockKey, IndexEntry]]) -> None:
        """Write the records in one transaction, then show them in the mirror."""
        with self._env.begin(write=True, db=self._blocks) as txn:
            for key, entry in entries:
                txn.put(key, encode_record(entry))
        with self._lock:
            for key, entry in entries:
                self.mirror[key] = entry

    def remove(self, keys: Sequence[BlockKey]) -> list[IndexEntry]:
        """Delete the records of ``keys`` that exist; the entries removed (none when the delete failed).

        The caller holds the lock, and frees the slots of what this returns in the same critical section.
        A failed delete puts the entries back, counted and logged once.
        """
        gone = [(k, self.mirror.pop(k)) for k in dict.fromkeys(keys) if k in self.mirror]
        if not gone:
            return []
        try:
            with self._env.begin(write=True, db=self._blocks) as txn:
                for key, _ in gone:
                    txn.delete(key)
        except lmdb.Error as err:
            self._stats.add(errors=1)
            warn_once("disk-remove", "disk tier index delete failed (%s)", err)
            for key, entry in gone:
                self.mirror[key] = entry
            return []
        return [entry for _, entry in gone]

    def in_store_order(self) -> list[tuple[BlockKey, IndexEntry]]:
        """A snapshot of the mirror, oldest store first."""
        with self._lock:
            return sorted(self.mirror.items(), key=lambda kv: kv[1].seq)
