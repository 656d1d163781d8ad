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


class TierMismatchError(KVTierError):
    """A persistent tier was written for another model, layout, block size or format."""


def warn_once(kind: str, message: str, *args: object) -> None:
    with _seen_lock:
        if kind in _seen:
            return
        _seen.add(kind)
    log.warning(message, *args)
