"""The disk tier's index: an LMDB file of key → record, the source of truth, and its in-memory mirror.

A record names a block's slot, its store order and its per-layer checksums
(:mod:`kvtier.tiers.disk.records` has the encoding). Committing records is
the acknowledgement point of a store (see :mod:`kvtier.tiers.disk` for the
order that makes it so); the mirror (:mod:`kvtier.tiers.disk.mirror`),
loaded once at open in bulk, answers lookups without a transaction.

Opening checks before it trusts: the index is verified by a walker that
cannot crash the process (:func:`kvtier.tiers.disk.directory.index_damage`), and
every record must decode and name its own slot. A damaged index is
quarantined (moved aside with its slabs; the tier starts empty) or refused,
per :class:`~kvtier.config.OnCorrupt`. An index written for another setup is
refused or wiped per :class:`~kvtier.config.OnMismatch`. An index of an older
format is wiped, with one log line: this code cannot read it, and formats
before 3 kept the token ids in plain form, which is exactly what must not
linger on disk.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import lmdb
import numpy as np

from kvtier.config import FsyncMode, OnCorrupt, OnMismatch
from kvtier.errors import DiskCorruptError, DiskUnavailableError, TierMismatchError, warn_once
from kvtier.keys import KEY_BYTES, BlockKey
from kvtier.layout import KVLayout
from kvtier.private import FILE_MODE, make_private, private_dir, sync_dir
from kvtier.stats import DiskStats
from kvtier.tiers.disk import seal
from kvtier.tiers.disk.directory import DiskDir, index_damage
from kvtier.tiers.disk.mirror import SlotMirror
from kvtier.tiers.disk.records import IndexDamage, IndexEntry, decode_record, encode_record, record_bytes
from kvtier.tiers.host import align_up

log = logging.getLogger("kvtier")

FORMAT_VERSION = 3  # 3: a keyed token digest instead of the token ids; 2: per-layer CRC-32C; 1: xxh3-64
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
        self.mirror = SlotMirror(num_slots, layout.num_layers)
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
        """Verify, open and load the index; a damaged one is quarantined (the tier starts empty) or refused.

        An index sealed by a clean close (:mod:`kvtier.tiers.disk.seal`) whose
        file is still the one sealed needs no walk, and its mirror is read in one go.
        """
        index = self._dir.index_path
        sealed = seal.take(index) if index.is_dir() else None
        trusted = sealed is not None and sealed.trusts_index(index)
        damage = None if trusted else index_damage(index)
        if damage is None:
            try:
                self._env = self._open_env(on_mismatch)
                self._load(sealed if trusted else None)
                return
            except (IndexDamage, *_LMDB_DAMAGE) as err:
                damage = f"{type(err).__name__}: {err}"
            self.close()
            self.mirror = SlotMirror(self._num_slots, self._layout.num_layers)
            self.seq = 0
        self._on_damage(damage, on_corrupt)
        self._env = self._open_env(on_mismatch)

    def close(self, *, seal_it: bool = False) -> None:
        """Close the index; ``seal_it`` (a clean close) also seals it for a quick next open."""
        env = self.__dict__.pop("_env", None)  # absent until the index opened
        if env is None:
            return
        env.close()
        if seal_it:
            keys, values = self.mirror.in_store_order_packed()
            try:
                seal.write(self._dir.index_path, keys, values, len(self.mirror), record_bytes(self._layout.num_layers))
            except OSError as err:
                log.warning("disk tier index %s: not sealed (%s); the next open walks it", self._dir.index_path, err)

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

    def _load(self, sealed: seal.Seal | None) -> None:
        """Mirror the index in memory, dropping records past the capacity (it shrank since they were written).

        From the sealed mirror when there is one for this index; else the
        keys and the records are each read end to end in one buffer (a
        cursor pass apiece, no object per record kept), every record checked
        for this format's size first (a pass of ``len`` over each, since two
        wrong sizes could cancel in a total). The mirror copies them into its
        arrays, oldest store first.
        """
        size = record_bytes(self._layout.num_layers)
        with self._env.begin(db=self._blocks) as txn:
            count = txn.stat(self._blocks)["entries"]
            found = None if sealed is None else sealed.mirror(self._dir.index_path, count, size)
            keys, values = found or self._read_records(txn, count, size)
        seal.discard_mirror(self._dir.index_path)
        stale = self.mirror.load(keys, values)
        if count:
            self.seq = int(np.frombuffer(values, np.uint8).reshape(count, size)[:, 4:12].copy().view("<u8").max())
        self._forget(BlockKey(bytes(keys[i * KEY_BYTES : (i + 1) * KEY_BYTES])) for i in stale)

    def _read_records(self, txn: lmdb.Transaction, count: int, size: int) -> tuple[bytes, bytes]:
        """Every key and every record, each joined end to end in the index's key order."""
        key_sizes = set(map(len, txn.cursor().iternext(keys=True, values=False)))
        value_sizes = set(map(len, txn.cursor().iternext(keys=False, values=True)))
        if count and (key_sizes, value_sizes) != ({KEY_BYTES}, {size}):
            for key, value in txn.cursor():
                decode_record(key, value, self._layout.num_layers)  # raises IndexDamage, naming the sizes
        keys = b"".join(txn.cursor().iternext(keys=True, values=False))
        return keys, b"".join(txn.cursor().iternext(keys=False, values=True))

    def drop_lost(self, held: Callable[[np.ndarray], np.ndarray]) -> None:
        """Forget records whose slab file is missing or too short to hold their block (``held`` says which).

        A slab deleted under a stopped tier would be recreated full of zeros
        (one truncated, read short) while its records stay indexed: a failed
        read on every pass. Their slots go back to the free list.
        """
        slots = self.mirror.slots()
        lost = [key for slot in slots[~held(slots)].tolist() if (key := self.mirror.key_at(slot)) is not None]
        if not lost:
            return
        self._forget(lost)
        for key in lost:
            self.mirror.pop(key)
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

    def commit(self, entries: list[tuple[BlockKey, IndexEntry]]) -> list[int]:
        """Write the records in one transaction, then show them in the mirror.

        Returns the slots that the same keys held before, now named by no
        record (two stores of one key that raced past the free-slot check),
        for the caller to free under the lock it holds.
        """
        with self._env.begin(write=True, db=self._blocks) as txn:
            for key, entry in entries:
                txn.put(key, encode_record(entry))
        replaced = []
        with self._lock:
            for key, entry in entries:
                old = self.mirror.put(key, entry)
                if old is not None:
                    replaced.append(old)
        return replaced

    def remove(self, keys: Sequence[BlockKey]) -> list[IndexEntry]:
        """Delete the records of ``keys`` that exist; the entries removed (none when the delete failed).

        The caller holds the lock, and frees the slots of what this returns in the same critical section.
        A failed delete puts the entries back, counted and logged once.
        """
        gone = [(k, e) for k in dict.fromkeys(keys) if (e := self.mirror.pop(k)) is not None]
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
                self.mirror.put(key, entry)
            return []
        return [entry for _, entry in gone]

    def in_store_order(self) -> Iterator[tuple[BlockKey, IndexEntry]]:
        """A snapshot of the mirror, oldest store first."""
        with self._lock:
            return self.mirror.in_store_order()
