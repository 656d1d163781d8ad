"""``kvtier cache check``: verify a disk tier offline, without loading the model, and say what is wrong.

The checks the tier makes when it opens (the index walked by lmdb's own
verifier, which cannot crash the process; a readable header; every record of
this format's size, each naming its own slot), plus what a running tier
would only find one read at a time: every record's block inside an existing
slab file and, with ``read``, every block's per-layer CRC-32C against the
slab's bytes. It takes the directory's lock, so it never reads under a
running server: it names that server's pid instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvtier.errors import KVTierError
from kvtier.tiers import native
from kvtier.tiers.disk.directory import DiskDir, index_damage
from kvtier.tiers.disk.index import FORMAT_VERSION
from kvtier.tiers.disk.records import IndexDamage, IndexEntry, decode_record, pack_checksums


@dataclass(frozen=True)
class _Shape:
    """What the header says about slots and layers: all the check needs instead of the model."""

    num_layers: int
    layer_bytes: int
    slot_bytes: int
    slots_per_file: int

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def where(self, slot: int) -> tuple[int, int]:
        """(slab file number, byte offset) of ``slot``."""
        return slot // self.slots_per_file, (slot % self.slots_per_file) * self.slot_bytes


@dataclass
class CheckReport:
    path: Path
    damage: str | None = None  # the index itself is damaged: nothing else was checked
    old_format: int | None = None  # a format this version wipes at start: its records were not checked
    records: int = 0
    slab_files: int = 0
    lost: int = 0  # records whose slab file is missing or too short
    past_capacity: int = 0  # records beyond the configured capacity: dropped at the next start, not damage
    read: int = 0  # blocks read back (``read``)
    checksum_failures: int = 0

    @property
    def healthy(self) -> bool:
        return self.damage is None and not self.lost and not self.checksum_failures

    def lines(self) -> list[str]:
        head = f"disk tier at {self.path}:"
        if self.damage is not None:
            return [f"{head} DAMAGED index: {self.damage}"]
        if self.old_format is not None:
            return [f"{head} format {self.old_format}, which this version wipes at start (it reads {FORMAT_VERSION})"]
        out = [f"{head} {self.records} records in {self.slab_files} slab files; index ok"]
        out.append(f"  slabs: {'ok' if not self.lost else f'{self.lost} records point past a missing or short file'}")
        if self.past_capacity:
            out.append(f"  {self.past_capacity} records lie past disk.capacity_bytes (dropped at the next start)")
        if self.read:
            out.append(f"  checksums: {self.read} blocks read, {self.checksum_failures} failed")
        out.append("  healthy" if self.healthy else "  DAMAGED")
        return out


def check(path: Path, *, capacity_bytes: int | None = None, read: bool = False) -> CheckReport:
    """Check the disk tier at ``path`` (locked while checking); ``capacity_bytes`` as configured, if known.

    Raises :class:`~kvtier.errors.KVTierError` when there is nothing to
    check or a server holds the directory.
    """
    disk = DiskDir.open(path, create=False)
    try:
        return _check(disk, capacity_bytes, read)
    finally:
        disk.close()


def _check(disk: DiskDir, capacity_bytes: int | None, read: bool) -> CheckReport:
    report = CheckReport(disk.path)
    if not (disk.index_path / "data.mdb").exists():
        raise KVTierError(f"no disk tier index at {disk.index_path}")
    report.damage = index_damage(disk.index_path)
    if report.damage is not None:
        return report
    env = lmdb.open(str(disk.index_path), readonly=True, lock=False, max_dbs=2)  # we hold the directory's lock
    try:
        shape = _shape(env, report)
        entries = [] if shape is None else _entries(env, shape, report)
    finally:
        env.close()
    if shape is not None and report.damage is None:
        _check_slabs(disk, shape, entries, report, capacity_bytes, read)
    return report


def _shape(env: lmdb.Environment, report: CheckReport) -> _Shape | None:
    """The header's slot and layer sizes; None (with the report saying why) when the records cannot be read."""
    with env.begin(db=env.open_db(b"meta", create=False)) as txn:
        raw = txn.get(b"header")
    try:
        header = json.loads(raw) if raw is not None else None
    except ValueError:
        header = None
    if not isinstance(header, dict):
        report.damage = "no readable header"
        return None
    version = header.get("format_version")
    if isinstance(version, int) and version < FORMAT_VERSION:
        report.old_format = version
        return None
    if version != FORMAT_VERSION:
        raise KVTierError(f"{env.path()} is format {version!r}; this version of kvtier reads {FORMAT_VERSION}")
    return _Shape(header["num_layers"], header["layer_bytes"], header["slot_bytes"], header["slots_per_file"])


def _entries(env: lmdb.Environment, shape: _Shape, report: CheckReport) -> list[IndexEntry]:
    entries: list[IndexEntry] = []
    slots: set[int] = set()
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        for key, value in txn.cursor():
            try:
                entry = decode_record(key, value, shape.num_layers)
            except IndexDamage as err:
                report.damage = str(err)
                return []
            if entry.slot in slots:
                report.damage = f"two records name slot {entry.slot}"
                return []
            slots.add(entry.slot)
            entries.append(entry)
    report.records = len(entries)
    return entries


def _check_slabs(
    disk: DiskDir,
    shape: _Shape,
    entries: list[IndexEntry],
    report: CheckReport,
    capacity_bytes: int | None,
    read: bool,
) -> None:
    slots = None if capacity_bytes is None else capacity_bytes // shape.slot_bytes
    numbers = sorted({shape.where(e.slot)[0] for e in entries})
    fds = {i: os.open(disk.slab_path(i), os.O_RDONLY) for i in numbers if disk.slab_path(i).exists()}
    try:
        sizes = {i: os.fstat(fd).st_size for i, fd in fds.items()}
        report.slab_files = len(fds)
        for entry in entries:
            number, offset = shape.where(entry.slot)
            if offset + shape.block_bytes > sizes.get(number, 0):
                report.lost += 1
            elif read:
                report.read += 1
                report.checksum_failures += not _block_ok(fds[number], offset, shape, entry)
            if slots is not None and entry.slot >= slots:
                report.past_capacity += 1
    finally:
        for fd in fds.values():
            os.close(fd)


def _block_ok(fd: int, offset: int, shape: _Shape, entry: IndexEntry) -> bool:
    data = os.pread(fd, shape.block_bytes, offset)
    return pack_checksums(native.BACKEND.crc32c_layers(data, shape.layer_bytes)) == entry.checksums
