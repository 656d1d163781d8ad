"""Tier counters and latency percentiles: exact figures for hand-fed samples."""

from __future__ import annotations

import socket
from dataclasses import fields

import msgspec

from kvtier.server.metrics import tier_report
from kvtier.server.schemas import TierReport
from kvtier.service import protocol as p
from kvtier.stats import (
    RECENT_SAMPLES,
    TIER_COUNTERS,
    CacheStats,
    DiskStats,
    Histogram,
    RemoteSnapshot,
    RemoteStats,
    TierSnapshot,
    TierStats,
)


def test_percentiles_are_samples_not_bucket_bounds() -> None:
    one = Histogram()
    one.observe(1.0)
    assert (one.quantile(0.5), one.quantile(0.99)) == (1.0, 1.0)  # not the 2.5 s bucket bound
    h = Histogram()
    for v in range(1, 101):
        h.observe(v / 100)
    snap = h.snapshot()
    assert (snap.p50_s, snap.p90_s, snap.p99_s) == (0.5, 0.9, 0.99)
    assert snap.count == 100 and sum(c for _, c in snap.buckets) == 100
    assert Histogram().quantile(0.5) is None


def test_percentiles_follow_the_recent_window_while_buckets_count_everything() -> None:
    h = Histogram()
    for _ in range(RECENT_SAMPLES):
        h.observe(9.0)
    for _ in range(RECENT_SAMPLES):
        h.observe(0.001)
    assert h.quantile(0.99) == 0.001 and h.n == 2 * RECENT_SAMPLES
    assert sum(h.counts) == 2 * RECENT_SAMPLES


def test_tier_counters_add_up_and_snapshot_is_a_copy() -> None:
    stats = TierStats()
    stats.add(lookups=2, hit_tokens=32)
    stats.add(hit_tokens=16, errors=1)
    stats.observe_load(0.002)
    snap = stats.snapshot()
    assert (snap.lookups, snap.hit_tokens, snap.errors) == (2, 48, 1)
    assert snap.load_latency.p50_s == 0.002
    stats.add(lookups=1)
    assert snap.lookups == 2


# -- the typed snapshot: one tree for both caches, the service's message and the reports ---------------------


def test_every_counter_is_named_once_and_reported_under_that_name() -> None:
    """A counter a tier keeps is in TIER_COUNTERS, the snapshot, /stats' TierReport and /metrics, by one name."""
    counters = {f.name for f in fields(DiskStats)} | {f.name for f in fields(TierStats)}
    counters -= {"load_latency", "_lock"}
    assert counters == set(TIER_COUNTERS) - {"bytes_moved"}  # the one derived there: read + written
    assert set(TIER_COUNTERS) <= set(TierSnapshot.__struct_fields__) | {"bytes_moved"}
    assert set(TIER_COUNTERS) <= set(TierReport.model_fields)
    stats = DiskStats()
    stats.add(**{name: i + 1 for i, name in enumerate(sorted(counters))})
    report = tier_report(stats.snapshot(blocks=7))
    assert {name: getattr(report, name) for name in counters} == {n: i + 1 for i, n in enumerate(sorted(counters))}
    assert report.bytes_moved == report.bytes_read + report.bytes_written and report.blocks == 7
    remote = {f.name for f in fields(RemoteStats)} - counters - {"load_latency", "_lock"}
    assert remote <= set(RemoteSnapshot.__struct_fields__)  # what only the remote tier counts


def test_cache_stats_cross_a_socket_as_themselves_and_between_versions() -> None:
    """The stats message body is CacheStats, tags and all; a reader takes a newer writer's extra fields
    (ignored) and an older one's missing fields (defaults), so a new counter needs no protocol version."""
    remote = RemoteStats()
    remote.add(writes=3, bad_mac=1, hit_tokens=16)
    stats = CacheStats(
        tiers={"host": TierStats().snapshot(blocks=4), "remote": remote.snapshot(breakers={"127.0.0.1:1": "open"})},
        pinned_blocks=2,
        break_even={"block_tokens": 16},
    )
    a, b = socket.socketpair()
    with a, b:
        p.send(a, p.StatsReply(stats))
        reply = p.recv_reply(b)
    assert isinstance(reply, p.StatsReply) and reply.stats == stats
    assert reply.stats.remote is not None and reply.stats.remote.breakers == {"127.0.0.1:1": "open"}
    newer = msgspec.msgpack.encode({"tiers": {"host": {"snapshot": "tier", "blocks": 1, "a_new_counter": 5}}})
    older = msgspec.msgpack.decode(newer, type=CacheStats)
    assert older.tiers["host"].blocks == 1 and older.tiers["host"].hit_tokens == 0 and older.pinned_blocks == 0
