"""Counters every tier keeps, the latency histogram behind its percentiles, and the typed snapshot of them all.

Tiers own the I/O counters (bytes moved, checksum failures) because only they
see them; the manager adds the lookup-side counters (hits, misses, confirm
mismatches, evictions) to the same object, so one snapshot per tier tells the
whole story. Increments take a small lock: transfer threads and the engine's
thread update the same counters.

:class:`CacheStats` is what :meth:`kvtier.cache.Cache.stats` returns, from
either cache, and also the body of the cache service's stats message: one
typed tree, read by ``/stats`` and ``/metrics`` (:data:`TIER_COUNTERS` names
and documents each tier counter once). Every field has a default and a
reader ignores fields it does not know, so a counter added here crosses
between a newer and an older process without a protocol version.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

# Upper bounds in seconds, log-spaced from 10 µs to 10 s; the last bucket is open.
LATENCY_BUCKETS_S: tuple[float, ...] = (*(m * 10.0**e for e in range(-5, 1) for m in (1.0, 2.5, 5.0)), 10.0)


RECENT_SAMPLES = 1024  # the window the reported percentiles are exact over


class LatencySnapshot(msgspec.Struct, kw_only=True):
    """A :class:`Histogram` at one moment: count and sum over every sample, percentiles over the recent ones."""

    count: int = 0
    sum_s: float = 0.0
    p50_s: float | None = None
    p90_s: float | None = None
    p99_s: float | None = None
    buckets: list[tuple[float, int]] = msgspec.field(default_factory=list)  # (upper bound, count); the last is +inf


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

    def snapshot(self) -> LatencySnapshot:
        return LatencySnapshot(
            count=self.n,
            sum_s=self.total,
            p50_s=self.quantile(0.5),
            p90_s=self.quantile(0.9),
            p99_s=self.quantile(0.99),
            buckets=[(b, c) for b, c in zip((*self.bounds, float("inf")), self.counts, strict=True)],
        )


TIER_COUNTERS: dict[str, str] = {
    "lookups": "Lookups that reached the tier.",
    "hit_tokens": "Prompt tokens served by the tier.",
    "miss_tokens": "Prompt tokens that reached the tier and were not served by it.",
    "confirm_mismatches": "Keys found holding other tokens (a counted miss, never served).",
    "evictions": "Blocks evicted.",
    "demotions": "Blocks written down to the next tier on eviction.",
    "bytes_read": "Payload bytes read from the tier.",
    "bytes_written": "Payload bytes written to the tier.",
    "bytes_moved": "bytes_read + bytes_written.",
    "checksum_failures": "Blocks that failed their checksum (a counted miss).",
    "errors": "Tier I/O errors (a counted miss).",
    "rejected_stores": "Blocks a store offered that the tier had no room for (never written).",
    "quarantined": "Damaged indexes moved aside at start (the disk tier started empty).",
    "lost_blocks": "Records dropped because their bytes were gone (slab missing, short or truncated).",
    "write_errors": "Disk: blocks not stored because a write, fsync or index commit failed (never indexed).",
    "read_errors": "Disk: blocks whose read failed (each a counted miss).",
}
"""Every tier counter and its meaning, by the one name it has in :class:`TierSnapshot`, ``/stats`` and ``/metrics``
(``bytes_moved`` is the one derived there; the others are :class:`TierStats` fields)."""


class TierSnapshot(msgspec.Struct, kw_only=True, tag_field="snapshot", tag="tier"):
    """One tier at one moment: its size, and its counters (:data:`TIER_COUNTERS`; the disk's four are 0 elsewhere)."""

    capacity_bytes: int = 0
    used_bytes: int = 0
    capacity_blocks: int = 0
    blocks: int = 0
    withheld_blocks: int = 0  # host: blocks held back from eviction while a load reads them
    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    confirm_mismatches: int = 0
    evictions: int = 0
    demotions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    checksum_failures: int = 0
    errors: int = 0
    rejected_stores: int = 0
    quarantined: int = 0
    lost_blocks: int = 0
    write_errors: int = 0
    read_errors: int = 0
    load_latency: LatencySnapshot = msgspec.field(default_factory=LatencySnapshot)

    @property
    def hit_rate(self) -> float | None:
        seen = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / seen if seen else None

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


class RemoteSnapshot(TierSnapshot, kw_only=True, tag="remote"):
    """The shared remote tier: its tier counters, and what only a shared, fallible, asynchronous tier has.

    Its sizes are a shared store's, unknown here: 0. Each rejection counter
    (``bad_mac``, ``foreign_tokens``, ...) is also a miss.
    """

    probes: int = 0
    timeouts: int = 0
    skipped: int = 0
    redirects: int = 0
    writes: int = 0
    dropped_writes: int = 0
    bad_length: int = 0
    bad_header: int = 0
    bad_mac: int = 0
    wrong_key: int = 0
    wrong_layout: int = 0
    foreign_tokens: int = 0
    bad_payload: int = 0
    breakers: dict[str, str] = msgspec.field(default_factory=dict)  # each node's breaker state, by host:port
    breaker_opens: int = 0
    write_queue: int = 0


class LinkSnapshot(msgspec.Struct, kw_only=True):
    """A server's link to its node's cache service."""

    connected: bool = False  # the service answered this snapshot (its tiers' figures are fresh)
    connects: int = 0  # connections made since start: more than one, the service restarted
    failures: int = 0  # calls that found the service away or failing (each a miss)


class CacheStats(msgspec.Struct, kw_only=True):
    """Everything a cache counts: its tiers by name (``host``, ``disk``, ``remote``), its pins, its cost model.

    ``service`` is set by a server whose cache is the node's service (None:
    embedded); ``break_even`` is the cost model's own report
    (:meth:`kvtier.breakeven.BreakEvenModel.snapshot`).
    """

    tiers: dict[str, TierSnapshot | RemoteSnapshot] = msgspec.field(default_factory=dict)
    pinned_blocks: int = 0
    ttl_pinned_blocks: int = 0
    break_even: dict[str, Any] = msgspec.field(default_factory=dict)
    service: LinkSnapshot | None = None

    @property
    def remote(self) -> RemoteSnapshot | None:
        tier = self.tiers.get("remote")
        return tier if isinstance(tier, RemoteSnapshot) else None


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
    confirm_mismatches: int = 0
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

    def snapshot(self, **sizes: int) -> TierSnapshot:
        """The counters now, with the tier's ``sizes`` (capacity_bytes, blocks, ...)."""
        return TierSnapshot(**self._counters(), **sizes)

    def _counters(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
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

    def snapshot(self, **extra: Any) -> RemoteSnapshot:  # type: ignore[override]
        """The counters now, with what the tier adds (its breakers, its write queue)."""
        return RemoteSnapshot(**self._counters(), **extra)
