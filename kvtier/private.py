"""Files only this user may read (directories 0700, files 0600, whatever the umask), whose names survive a power cut.

The data directory holds the key secret, and the disk tier holds every
tenant's KV and (keyed digests of) their prompts' blocks: another local user
must not read any of it. ``mkdir``/``open`` modes are masked by the umask,
which can only remove bits, so a mode of 0700/0600 is never looser than asked;
it is the files made before this rule (or by a library that ignores it) that
need the ``chmod``, hence :func:`make_private` on what already exists.

A name is durable only once its directory is synced: ``fsync`` on a new file
makes its bytes durable, not the entry that names it, so after a power cut
a file synced a thousand times can be gone. Whoever creates a directory
(:func:`private_dir`) or a file that must outlive a crash (the key secret,
a slab file, the LMDB index) syncs the directory that holds it
(:func:`sync_dir`) before anything that depends on it is acknowledged.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.errors import warn_once

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create ``path`` and its missing parents at mode 0700, and tighten ``path`` itself if it exists.

    Parents made here are kvtier's own (a data directory's parents did not
    exist before it), so they are private too; parents that exist are left as
    they are. Raises ``OSError`` when a directory cannot be created.
    """
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        try:
            os.mkdir(p, DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another process
        os.chmod(p, DIR_MODE)  # exactly 0700, even under a umask that also masks owner bits
        sync_dir(p.parent)
    make_private(path)
    return path


def sync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (its new, renamed and removed names).

    A directory that cannot be synced (no read permission, a filesystem
    without directory fsync) is logged once: its names may not survive a
    power cut, which costs cached blocks, never wrong ones.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        warn_once("sync-dir", "cannot sync directory %s (%s); new files in it may not survive a power cut", path, err)


def make_private(path: Path) -> None:
    """Drop group and other permissions from ``path`` (a file or directory) if it exists and has them.

    Each owner calls this at start on the files it keeps (the key secret, the
    fingerprint cache, the disk tier's index and slabs), so a file loosened
    since (a ``chmod``, a restore from a backup, a copy under a looser umask)
    is private again before kvtier uses it. Tightening is said once per
    process, naming the first file: one operator mistake usually loosens
    many files at once, and one line says it. A file kvtier cannot chmod
    (another owner, a read-only filesystem) is logged once and left: the
    caller finds out soon enough whether it can use it.
    """
    try:
        mode = os.stat(path).st_mode
        if stat.S_IMODE(mode) & 0o077:
            private = DIR_MODE if stat.S_ISDIR(mode) else FILE_MODE
            os.chmod(path, private)
            warn_once(
                "private-tightened",
                "tightened %s from %04o to %04o (and any other file of kvtier's that other users could read)",
                path,
                stat.S_IMODE(mode),
                private,
            )
    except FileNotFoundError:
        return
    except OSError as err:
        warn_once("private-chmod", "cannot make %s private (%s); other local users may read it", path, err)
