"""A clean close's seal: what lets the next open trust the index without walking it, and read the mirror in one go.

Opening a disk tier checks its LMDB file with lmdb's page walker before
liblmdb may read it (a damaged file could crash the process), then reads
every record through a cursor into the mirror: both cost time per block
indexed, and at ten million blocks, minutes. A tier closed cleanly writes,
after its last commit and with liblmdb's file closed, two files into the
index directory:

* ``mirror.bin``: the mirror's keys, then its records, oldest store first,
  each end to end (the records exactly as LMDB holds them);
* ``seal.json``: the size and CRC-32C of ``data.mdb`` as liblmdb left it,
  the size and CRC-32C of ``mirror.bin``, and the number of records.

The next open takes the seal away before anything else, so a crash at any
later point leaves none and the open after it walks. It trusts ``data.mdb``
without the walk only when its size and CRC-32C are the sealed ones: the file
is then, byte for byte, the one the last open verified (or started empty)
and only liblmdb wrote to since. It reads the mirror from ``mirror.bin`` only
when that file's size and CRC-32C match and the index holds as many records.
Any mismatch falls back to the walk and the cursor: never an error, never a
mirror the index does not hold. Both files move with the index directory
when it is quarantined or wiped.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.private import FILE_MODE, sync_dir
from kvtier.tiers import native

log = logging.getLogger("kvtier")

SEAL_FILE = "seal.json"
MIRROR_FILE = "mirror.bin"
DATA_FILE = "data.mdb"
_FORMAT = 1
_CHUNK = 64 * 1024**2


@dataclass(frozen=True)
class Seal:
    format: int
    data_bytes: int
    data_crc32c: int
    mirror_bytes: int
    mirror_crc32c: int
    records: int
    record_bytes: int

    def trusts_index(self, index: Path) -> bool:
        """Whether ``data.mdb`` is byte for byte the file this seal was written over."""
        data = index / DATA_FILE
        try:
            return data.stat().st_size == self.data_bytes and file_crc32c(data) == self.data_crc32c
        except OSError:
            return False

    def mirror(self, index: Path, records: int, record_bytes: int) -> tuple[memoryview, memoryview] | None:
        """The sealed mirror's keys and records, when it holds ``records`` of ``record_bytes`` and reads intact.

        Mapped, not read: the file is as large as the index, and a copy on
        the heap would double the start-up's peak memory for a moment. The
        mapping goes when the caller drops the two views.
        """
        if (records, record_bytes) != (self.records, self.record_bytes):
            return None
        try:
            with open(index / MIRROR_FILE, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != self.mirror_bytes:
                    return None
                view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b"")
        except OSError:
            return None
        if native.BACKEND.crc32c(view) != self.mirror_crc32c:
            return None
        cut = records * 16
        return view[:cut], view[cut:]


def file_crc32c(path: Path) -> int:
    """CRC-32C of a whole file, read a chunk at a time."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = native.BACKEND.crc32c(chunk, crc)
    return crc


def take(index: Path) -> Seal | None:
    """The index's seal, removed from the directory for good (synced) before it is returned; None without one."""
    path = index / SEAL_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    path.unlink()
    sync_dir(index)
    try:
        seal = Seal(**json.loads(raw))
    except (ValueError, TypeError):
        log.warning("disk tier index %s: an unreadable seal, ignored (the index is walked instead)", index)
        return None
    return seal if seal.format == _FORMAT else None


def write(index: Path, keys: bytes, records: bytes, count: int, record_bytes: int) -> None:
    """Seal a cleanly closed index (liblmdb's file closed): the mirror first, then the seal naming it, each synced.

    Raises ``OSError`` when a file cannot be written; the caller logs it and the next open walks.
    """
    mirror = index / MIRROR_FILE
    crc = native.BACKEND.crc32c(keys, 0)
    crc = native.BACKEND.crc32c(records, crc)
    _write_synced(mirror, [keys, records])
    seal = Seal(
        format=_FORMAT,
        data_bytes=(index / DATA_FILE).stat().st_size,
        data_crc32c=file_crc32c(index / DATA_FILE),
        mirror_bytes=len(keys) + len(records),
        mirror_crc32c=crc,
        records=count,
        record_bytes=record_bytes,
    )
    _write_synced(index / SEAL_FILE, [json.dumps(asdict(seal)).encode()])
    sync_dir(index)


def _write_synced(path: Path, parts: list[bytes]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        for part in parts:
            view = memoryview(part)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def discard_mirror(index: Path) -> None:
    """Delete ``mirror.bin`` once read (or found stale): no seal names it any more."""
    (index / MIRROR_FILE).unlink(missing_ok=True)
