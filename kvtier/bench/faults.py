"""The faults `kvtier bench chaos` injects besides its kill -9 loop: each one a function, a typed outcome.

Each fault runs the real thing (the manager and its tiers on real files and a
real LMDB, a real ``kvtier serve`` or cache service where the fault is about a
process, a real ``redis-server`` for the remote tier) in a directory of its
own, injects one fault, and says what it injected and what kvtier did. The
tests under ``tests/reliability`` assert the same outcomes; the chaos run
prints them as figures. A fault registers itself with :func:`fault`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path


class Fault(StrEnum):
    POWER_LOSS = "power_loss"  # writes not yet synced dropped
    DISK_FULL = "disk_full"  # ENOSPC on a small filesystem
    EIO = "eio"  # injected EIO on read, write and fsync
    INDEX_DAMAGED = "index_damaged"  # the LMDB file damaged
    SLAB_TRUNCATED = "slab_truncated"
    READ_ONLY = "read_only"  # the data directory read-only
    EVICT_WHILE_READING = "evict_while_reading"
    SAME_HASH_WRITERS = "same_hash_writers"
    MEMORY_FLOOD = "memory_flood"  # host/pinned memory exhausted
    TWO_SERVERS = "two_servers"  # two servers on one data directory
    DISCONNECTS = "disconnects"  # clients that go away mid-stream
    REMOTE_DOWN = "remote_down"  # the Redis tier killed under load


@dataclass(frozen=True)
class FaultOutcome:
    """What was injected, what kvtier did, and whether that is what it promises (``held``)."""

    fault: Fault
    injected: str
    outcome: str
    held: bool
    wrong_bytes_served: int = 0
    figures: dict[str, float | int] = field(default_factory=dict)


class FaultSkipped(Exception):
    """A fault this host cannot inject (no root to mount a filesystem, no redis-server): why, in one line.

    Raised instead of an outcome, because an outcome says what kvtier did and
    here kvtier was never tested: the chaos run reports it skipped, a test skips.
    """


FaultRun = Callable[[Path], FaultOutcome]
FAULTS: dict[Fault, FaultRun] = {}


def fault(kind: Fault) -> Callable[[FaultRun], FaultRun]:
    """Register ``run(workdir) -> FaultOutcome`` as the chaos entry for ``kind``."""

    def register(run: FaultRun) -> FaultRun:
        FAULTS[kind] = run
        return run

    return register
