"""The disk tier's slab files: where each slot lies, files made whole on first use, and which slots are free.

Slots are fixed-size, each a multiple of 4096 bytes at a 4096-aligned offset
of its ``slab-NNNN.bin`` file, so O_DIRECT can read them. The files are
opened with O_DIRECT when the filesystem allows it (probed once at open,
:attr:`DiskTier.io_mode <kvtier.tiers.disk.DiskTier.io_mode>`), so blocks
skip the page cache and the host tier is the only copy in memory; otherwise
buffered I/O, logged once.

The free list is never stored: at every open it is every slot the index does
not name, which reclaims the orphans a crash leaves with no scan.
"""

from __future__ import annotations

import enum
import heapq
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np

from kvtier.config import DiskIO
from kvtier.errors import KVTierError, warn_once
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.private import FILE_MODE, make_private, sync_dir
from kvtier.stats import DiskStats
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk.directory import DiskDir
from kvtier.tiers.disk.records import IndexEntry
from kvtier.tiers.host import align_up


class IOMode(enum.StrEnum):
    """How the slab files are read and written; chosen once, when the tier opens."""

    DIRECT = "direct"  # O_DIRECT: no page cache; aligned requests, bounced when the memory is not aligned
    BUFFERED = "buffered"  # through the page cache: the filesystem refused O_DIRECT, or it was asked for


def io_mode_for(setting: DiskIO) -> IOMode | None:
    """The configured I/O mode; None (``auto``) lets the tier probe O_DIRECT at open."""
    return {DiskIO.BUFFERED: IOMode.BUFFERED, DiskIO.DIRECT: IOMode.DIRECT, DiskIO.AUTO: None}[setting]


def choose_io_mode(path: Path, wanted: IOMode | None, backend: native.IOBackend) -> IOMode:
    """``wanted``, or (None) O_DIRECT where the filesystem at ``path`` allows it, else buffered (logged once).

    Raises :class:`~kvtier.errors.KVTierError` when O_DIRECT is asked for and refused.
    """
    if wanted is IOMode.BUFFERED:
        return IOMode.BUFFERED
    refused = native.probe_direct(path, backend)
    if refused is None:
        return IOMode.DIRECT
    if wanted is IOMode.DIRECT:
        raise KVTierError(f"disk tier at {path}: O_DIRECT asked for but refused here ({refused})")
    warn_once(
        "disk-buffered",
        "disk tier at %s: the filesystem refuses O_DIRECT (%s); using buffered I/O through the page cache",
        path,
        refused,
    )
    return IOMode.BUFFERED


class DiskSlabs:
    """One disk tier's slab files, by number, and its free slots.

    It shares the tier's lock: a descriptor is created under it, and the
    free list changes under it in the same critical section that reads or
    changes the index (:meth:`allocate` takes it; :meth:`release` runs while
    the caller holds it).
    """

    def __init__(
        self,
        disk: DiskDir,
        layout: KVLayout,
        *,
        num_slots: int,
        slots_per_file: int,
        stats: DiskStats,
        lock: threading.Lock,
    ) -> None:
        self.fds: dict[int, int] = {}  # slab file number -> descriptor
        self._dir = disk
        self._block_bytes = layout.block_bytes
        self._slot_bytes = align_up(layout.block_bytes)
        self._num_slots = num_slots
        self._slots_per_file = slots_per_file
        self._stats = stats
        self._lock = lock
        self._flags = os.O_RDWR
        self._free = FreeSlots(np.empty(0, dtype=np.uint32))

    # -- files ---------------------------------------------------------------
    def open(self, io_mode: IOMode) -> None:
        """Open the slab files that exist (made private); the others are created when a slot in them is first used."""
        self._flags = os.O_RDWR | (os.O_DIRECT if io_mode is IOMode.DIRECT else 0)
        fds = {}
        for i in range(-(-self._num_slots // self._slots_per_file)):
            path = self._dir.slab_path(i)
            if path.exists():
                make_private(path)
                fds[i] = os.open(path, self._flags)
        self.fds = fds

    def file(self, index: int) -> int:
        """The fd of slab file ``index``, creating it at its full, preallocated size on first use.

        Files are preallocated whole (``posix_fallocate``) so a later write
        never fails for lack of space half-way; creating them only as the
        free list reaches them (lowest slots first) keeps a large configured
        capacity from claiming the disk before it holds anything.
        """
        fd = self.fds.get(index)
        if fd is not None:
            return fd
        with self._lock:
            if index not in self.fds:
                self.fds[index] = self._create(index)
            return self.fds[index]

    def _create(self, index: int) -> int:
        path = self._dir.slab_path(index)
        slots = min(self._slots_per_file, self._num_slots - index * self._slots_per_file)
        size = slots * self._slot_bytes
        fd = os.open(path, self._flags | os.O_CREAT, FILE_MODE)
        try:
            if os.fstat(fd).st_size < size:
                self._preallocate(fd, path, size)
            sync_dir(self._dir.path)  # before any block in it is acknowledged: a synced file without a name is lost
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

    def held(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` their slab file, at its length now, is long enough to hold (a bool per slot)."""
        files = int(-(-self._num_slots // self._slots_per_file))
        sizes = np.zeros(files, dtype=np.int64)
        for i, fd in self.fds.items():
            sizes[i] = os.fstat(fd).st_size
        slots = slots.astype(np.int64)
        ends = (slots % self._slots_per_file) * self._slot_bytes + self._block_bytes
        return ends <= sizes[slots // self._slots_per_file]

    def drop_page_cache(self) -> bool:
        """Evict the slab pages from the OS page cache (for cold-read benchmarks)."""
        try:
            for fd in self.fds.values():
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return False
        return True

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    # -- where a slot lies ---------------------------------------------------
    def file_of(self, slot: int) -> int:
        return slot // self._slots_per_file

    def offset_of(self, slot: int) -> int:
        return (slot % self._slots_per_file) * self._slot_bytes

    def slot_end(self, slot: int) -> int:
        """The byte after ``slot``'s block in its slab file: how long the file must be to hold it."""
        return self.offset_of(slot) + self._block_bytes

    def where(self, slot: int) -> tuple[int, int]:
        """The fd and byte offset of ``slot`` (its slab file is created if it does not exist yet)."""
        return self.file(self.file_of(slot)), self.offset_of(slot)

    def path_of(self, slot: int) -> tuple[Path, int]:
        """The file and byte offset of ``slot``."""
        return self._dir.slab_path(self.file_of(slot)), self.offset_of(slot)

    # -- free slots ----------------------------------------------------------
    def free_all_but(self, used: np.ndarray) -> None:
        """Make every slot free that ``used`` does not name (at open: the index names the used ones)."""
        free = np.ones(self._num_slots, dtype=bool)
        free[used] = False
        self._free = FreeSlots(np.flatnonzero(free).astype(np.uint32))

    def allocate(
        self, keys: Sequence[BlockKey], records: Sequence[BlockRecord], stored: Callable[[BlockKey], IndexEntry | None]
    ) -> tuple[list[bool], list[tuple[int, int]]]:
        """A free slot for each key not ``stored`` yet, once per key: (results, [(index in keys, slot)]).

        A stored key's result says whether its record matches; a key no slot is left for is a rejected store.
        """
        results = [False] * len(keys)
        todo: list[tuple[int, int]] = []
        seen: set[BlockKey] = set()
        with self._lock:
            for i, (key, record) in enumerate(zip(keys, records, strict=True)):
                entry = stored(key)
                if entry is not None:
                    results[i] = entry.record.matches(record.digest)
                elif key in seen:
                    continue
                elif self._free:
                    todo.append((i, self._free.pop()))
                    seen.add(key)
                else:
                    self._stats.add(rejected_stores=1)
        return results, todo

    def release(self, slots: Iterable[int]) -> None:
        """Free ``slots`` again (the caller holds the lock)."""
        for slot in slots:
            self._free.push(slot)

    def free_count(self) -> int:
        return len(self._free)


class FreeSlots:
    """The free slots of a disk tier, lowest first (so files fill in order), at about 4 bytes a slot.

    An empty terabyte of small slots has hundreds of millions free: a heap of
    Python ints would cost 36 bytes each. The slots free at open are a sorted
    array taken from the front; slots freed later go on a heap, merged into
    a new sorted array once it grows past :data:`MERGE_AT` (a clear or a
    big eviction frees many at once).
    """

    MERGE_AT = 65536

    def __init__(self, sorted_slots: np.ndarray) -> None:
        self._run = sorted_slots
        self._at = 0
        self._heap: list[int] = []

    def __len__(self) -> int:
        return len(self._run) - self._at + len(self._heap)

    def pop(self) -> int:
        """The lowest free slot, taken; ``IndexError`` when none is free."""
        if self._at < len(self._run) and (not self._heap or int(self._run[self._at]) < self._heap[0]):
            self._at += 1
            return int(self._run[self._at - 1])
        return heapq.heappop(self._heap)

    def push(self, slot: int) -> None:
        heapq.heappush(self._heap, slot)
        if len(self._heap) >= self.MERGE_AT:
            merged = np.concatenate([self._run[self._at :], np.array(self._heap, dtype=np.uint32)])
            self._run, self._at, self._heap = np.sort(merged), 0, []
