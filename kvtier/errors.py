"""Exceptions kvtier raises, and the log-once rule for failures it absorbs.

Only set-up problems raise (a disk tier written for another model, a bad
config). Failures on the data path are misses: counted in the tier's stats
and logged once per kind, so a flapping disk cannot flood the log.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvtier")

_seen: set[str] = set()
_seen_lock = threading.Lock()


class KVTierError(Exception):
    pass


class BindError(KVTierError):
    """``kvtier serve`` cannot listen where it was told (the port is taken, the address is not this host's)."""


class TierMismatchError(KVTierError):
    """A persistent tier was written for another model, layout, block size or format."""


class DiskUnavailableError(KVTierError):
    """The disk tier's directory cannot be created, written or locked (read-only, permissions, missing).

    The cache manager catches it and runs with host memory only: a cache that
    cannot persist is still a cache, and refusing to serve would turn a lost
    optimisation into an outage.
    """


class DiskLockedError(KVTierError):
    """Another disk tier (this process or another) holds the directory: two owners would overwrite each other."""


class DiskCorruptError(KVTierError):
    """The disk tier's index is damaged and ``disk.on_corrupt`` is ``error``."""


def warn_once(kind: str, message: str, *args: object) -> None:
    with _seen_lock:
        if kind in _seen:
            return
        _seen.add(kind)
    log.warning(message, *args)
