"""Counters every tier keeps, and the latency histogram behind its percentiles.

Tiers own the I/O counters (bytes moved, checksum failures) because only they
see them; the manager adds the lookup-side counters (hits, misses, confirm
mismatches, evictions) to the same object, so one snapshot per tier tells the
whole story. Increments take a small lock: transfer threads and the engine's
thread update the same counters.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from dataclasses import dataclass, field, fields

# Upper bounds in seconds, log-spaced from 10 µs to 10 s; the last bucket is open.
LATENCY_BUCKETS_S: tuple[float, ...] = (*(m * 10.0**e for e in range(-5, 1) for m in (1.0, 2.5, 5.0)), 10.0)


RECENT_SAMPLES = 1024  # the window the reported percentiles are exact over


class Histogram:
    """Fixed buckets over every sample (Prometheus-shaped, for /metrics) and the most recent samples themselves.

    A bucket bound is no percentile: one 1.0 s sample would read "p50 2.5 s".
    The percentiles are exact (nearest rank) over the last
    :data:`RECENT_SAMPLES` samples, which is also what an operator asking
    "how slow is it now" wants.
    """

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.n = 0
        self.recent: deque[float] = deque(maxlen=RECENT_SAMPLES)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1
        self.recent.append(value)

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the recent samples, nearest rank (None when empty)."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def snapshot(self) -> dict[str, object]:
        return {
            "count": self.n,
            "sum_s": self.total,
            "p50_s": self.quantile(0.5),
            "p90_s": self.quantile(0.9),
            "p99_s": self.quantile(0.99),
            "buckets": [[b, c] for b, c in zip((*self.bounds, float("inf")), self.counts, strict=True)],
        }


@dataclass
class TierStats:
    """One tier's counters.

    ``hit_tokens`` are tokens the tier served: for host memory, blocks found
    and confirmed there at lookup (a host read cannot fail); for the disk
    tier, blocks read back and verified (checksums) when fetched, since an
    index hit may still fail its read or never be fetched. ``miss_tokens``
    are tokens that reached the tier at lookup (no faster tier served them)
    and were not in its index, plus, for the disk tier, blocks whose read
    failed.
    """

    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    confirm_mismatch: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    demotions: int = 0
    checksum_failures: int = 0
    errors: int = 0
    rejected_stores: int = 0
    load_latency: Histogram = field(default_factory=Histogram)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            self.load_latency.observe(seconds)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            out: dict[str, object] = {
                f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("load_latency", "_lock")
            }
            out["load_latency"] = self.load_latency.snapshot()
        return out


@dataclass
class DiskStats(TierStats):
    """The disk tier's counters, plus what only a persistent tier can lose."""

    quarantined: int = 0  # damaged indexes moved aside at open (with their slabs); the tier started empty
    lost_blocks: int = 0  # records dropped because their bytes are gone (slab file missing, short or truncated)
    write_errors: int = 0  # blocks not stored: their write, fsync or index commit failed (ENOSPC, EIO); never indexed
    read_errors: int = 0  # blocks not served: their read failed (EIO); each a counted miss, the record kept


@dataclass
class RemoteStats(TierStats):
    """The remote tier's counters, plus what only a shared, fallible, asynchronous tier has.

    Every rejected value is also a miss (``miss_tokens``); the reason
    counters say why (see :class:`kvtier.tiers.remote.frame.Rejection`).
    """

    probes: int = 0  # header reads at lookup (one per key asked)
    timeouts: int = 0  # calls that hit remote.timeout_ms (also counted in errors)
    skipped: int = 0  # calls not made because a circuit breaker was open
    redirects: int = 0  # keys a cluster node sent elsewhere (MOVED/ASK: a reshard or failover), followed once
    writes: int = 0  # blocks written
    dropped_writes: int = 0  # blocks not written: the write queue was full, or the write failed
    bad_length: int = 0
    bad_header: int = 0
    bad_mac: int = 0
    wrong_key: int = 0
    wrong_layout: int = 0
    foreign_tokens: int = 0
    bad_payload: int = 0
