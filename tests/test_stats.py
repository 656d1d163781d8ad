"""Tier counters and latency percentiles: exact figures for hand-fed samples."""

from __future__ import annotations

from kvtier.stats import RECENT_SAMPLES, Histogram, TierStats


def test_percentiles_are_samples_not_bucket_bounds() -> None:
    one = Histogram()
    one.observe(1.0)
    assert (one.quantile(0.5), one.quantile(0.99)) == (1.0, 1.0)  # not the 2.5 s bucket bound
    h = Histogram()
    for v in range(1, 101):
        h.observe(v / 100)
    snap = h.snapshot()
    assert (snap["p50_s"], snap["p90_s"], snap["p99_s"]) == (0.5, 0.9, 0.99)
    assert snap["count"] == 100 and sum(c for _, c in snap["buckets"]) == 100
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
    assert (snap["lookups"], snap["hit_tokens"], snap["errors"]) == (2, 48, 1)
    assert snap["load_latency"]["p50_s"] == 0.002
    stats.add(lookups=1)
    assert snap["lookups"] == 2
