"""The disk tier's directory: private, held by one opener at a time, its index checked before use.

* **One owner.** Two disk tiers on one directory would each start their free
  list at slot 0 and overwrite each other's blocks. The opener takes an
  exclusive, non-blocking ``flock`` on ``<dir>/lock`` for its lifetime and
  writes its pid there, so a second opener (another process, or the same
  one) refuses with the holder's pid. The kernel drops the lock when its
  holder exits, however it exits: a crash never leaves a stale lock.
* **Private.** The directory is 0700 and its files 0600 whatever the umask:
  another local user must not read any tenant's KV.
* **Checked before liblmdb sees it.** liblmdb trusts its file: a torn or
  overwritten page makes it raise, or abort the whole process on an
  assertion no ``except`` can catch. :func:`index_damage` runs lmdb's own
  offline verifier, a pure-Python byte walker that never hands the file to
  liblmdb, over every page reachable from the committed meta page (the free
  list included, which no cursor walk reaches and every write uses): a file
  it passes is safe to open, read and write. It costs time in proportion to
  the index's size, once per start.
* **Damage is kept, not deleted.** :meth:`DiskDir.quarantine` moves the index
  and the slab files into ``quarantine/<UTC time>/`` beside them: same
  filesystem (renames, no copy), still private, there for a post-mortem.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import shutil
from pathlib import Path

from lmdb import verify as lmdb_verify

from kvtier.errors import DiskLockedError, DiskUnavailableError, warn_once
from kvtier.private import FILE_MODE, make_private, private_dir

LOCK_FILE = "lock"
INDEX_DIR = "index.lmdb"
QUARANTINE_DIR = "quarantine"
_SLAB_GLOB = "slab-*.bin"
_SHOWN_PROBLEMS = 2  # verifier findings quoted in a damage message; the rest are counted


def index_damage(index: Path) -> str | None:
    """What is wrong with the LMDB environment at ``index``, or None when it is sound or does not exist yet.

    Raises ``OSError`` when the file cannot be read at all (that is not damage).
    """
    if not (index / "data.mdb").exists():
        return None
    try:
        problems = lmdb_verify.verify(str(index), subdir=True)
    except lmdb_verify.VerifyError as err:
        return str(err)
    if not problems:
        return None
    more = len(problems) - _SHOWN_PROBLEMS
    return "; ".join(problems[:_SHOWN_PROBLEMS]) + (f" (and {more} more)" if more > 0 else "")


class DiskDir:
    """An opened disk-tier directory: its lock held, its file names, and what to do with damaged files."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd

    @classmethod
    def open(cls, path: Path, *, create: bool = True) -> DiskDir:
        """Make ``path`` private (creating it unless ``create`` is False) and take its lock.

        Raises :class:`DiskUnavailableError` when the directory cannot be
        created, written or locked (read-only, permissions, missing), and
        :class:`DiskLockedError` when another opener holds it.
        """
        try:
            if create:
                private_dir(path)
            elif not path.is_dir():
                raise FileNotFoundError(errno.ENOENT, "no such directory", str(path))
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as err:
            raise DiskUnavailableError(f"disk tier at {path} cannot be used: {err.strerror or err}") from err
        try:
            _lock(fd, path)
        except BaseException:
            os.close(fd)
            raise
        make_private(path / LOCK_FILE)
        return cls(path, fd)

    @property
    def index_path(self) -> Path:
        return self.path / INDEX_DIR

    def slab_path(self, index: int) -> Path:
        return self.path / f"slab-{index:04d}.bin"

    def data_files(self) -> list[Path]:
        """The index directory and the slab files: everything but the lock (and earlier quarantines)."""
        index = [self.index_path] if self.index_path.exists() else []
        return index + sorted(self.path.glob(_SLAB_GLOB))

    def quarantine(self) -> Path:
        """Move the index and every slab file into a new ``quarantine/<UTC time>/``; returns it."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        dest = private_dir(self.path / QUARANTINE_DIR / stamp)
        for path in self.data_files():
            os.rename(path, dest / path.name)
        return dest

    def wipe(self) -> None:
        """Delete the index and the slab files, keeping the lock file this opener holds."""
        for path in self.data_files():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()

    def warn_if_short_of_space(self, capacity_bytes: int) -> None:
        """Warn once when the slab files still to be made need more than the filesystem has free.

        Slabs are created as the free list reaches them, so a tier sized past
        the free space starts fine and fails stores only when the disk fills:
        said at start, the operator hears it before the cache stops growing.
        """
        made = sum(p.stat().st_size for p in self.path.glob(_SLAB_GLOB))
        free = shutil.disk_usage(self.path).free
        if capacity_bytes - made > free:
            warn_once(
                "disk-space",
                "disk tier at %s is configured for %d bytes but its filesystem has %d bytes free (and %d are "
                "already in slab files): stores will fail once the disk fills; lower disk.capacity_bytes",
                self.path,
                capacity_bytes,
                free,
                made,
            )

    def close(self) -> None:
        """Release the lock (idempotent); the lock file stays, for the next opener to lock."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _lock(fd: int, path: Path) -> None:
    """Take the exclusive lock on ``fd`` and write this pid in it, or raise naming the holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        mine = " (this process)" if holder == str(os.getpid()) else ""
        raise DiskLockedError(
            f"disk tier at {path} is in use by pid {holder}{mine}: two caches on one disk directory would "
            "overwrite each other's blocks; give each server its own disk.path, or share one cache: "
            "`kvtier cache serve` and cache.service: unix:///path/to.sock in every server's config"
        ) from None
    except OSError as err:  # e.g. ENOLCK: a filesystem without locks
        raise DiskUnavailableError(f"disk tier at {path} cannot be locked: {err.strerror or err}") from err
