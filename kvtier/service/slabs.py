"""Whose shared-memory slab is whose: a killed cache service's slab is reclaimed by the next one to start.

The host slab is a file in shared memory (``/dev/shm``) so that clients can
map it; it outlives the process that made it. A service that closes
deletes its own, but one killed (kill -9, the OOM killer, a crash) cannot,
and every restart would leave another slab the size of the host tier in
RAM until reboot.

So each slab has a lock file beside it (``kvtier-<uid>-<token>.lock`` for
``kvtier-<uid>-<token>.slab``) that its service holds an exclusive
``flock`` on for its whole life. The kernel drops the lock when the holder
dies, however it dies. A service about to create its slab first takes every
lock of its user that it can: each one it gets belonged to a dead service,
whose slab and lock it deletes. The lock is taken under a temporary name and
renamed into place, so no one ever sees a lock file that is not yet held.
Clients that still map a reclaimed slab keep their mapping; only the name
goes. A lock works across PID namespaces, where a PID check would not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

from kvtier.private import FILE_MODE


def _stem(slab_dir: Path, token: str) -> Path:
    return slab_dir / f"kvtier-{os.getuid()}-{token}"


class SlabLock:
    """The lock that says this process's slab is alive; :attr:`slab_path` is the slab it guards."""

    def __init__(self, slab_dir: Path) -> None:
        stem = _stem(slab_dir, secrets.token_hex(6))
        self.slab_path = stem.with_suffix(".slab")
        self.path = stem.with_suffix(".lock")
        pending = stem.with_suffix(".lock-new")
        self._fd: int | None = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(pending, self.path)

    def release(self) -> None:
        """Delete the lock file and let go (idempotent); call after the slab itself is deleted."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None


def reclaim(slab_dir: Path) -> int:
    """Delete the slabs (and locks) of this user's dead services in ``slab_dir``; how many slabs went."""
    gone = 0
    for lock in slab_dir.glob(f"kvtier-{os.getuid()}-*.lock"):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # reclaimed or released meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its service is alive
        try:
            with contextlib.suppress(FileNotFoundError):
                lock.with_suffix(".slab").unlink()
                gone += 1
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        finally:
            os.close(fd)
    return gone
