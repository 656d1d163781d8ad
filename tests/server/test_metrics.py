"""The stats report's typed view of the cost model and the prefetch counters, and its Prometheus rendering.

Toy shapes (tests.helpers) and a real cache manager; no server, no model.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvtier.breakeven import BreakEvenModel
from kvtier.engine.request import PrefetchCounters, SpeculationCounters
from kvtier.manager import CacheManager
from kvtier.server.metrics import EngineMetrics, StatsCollector, build_report
from kvtier.server.schemas import BreakEvenReport, PrefetchReport, SpeculationReport, StatsReport
from kvtier.tiers.base import TierKind
from tests.helpers import make_config, toy_layout
from tests.server.live import metric_values


def test_the_break_even_report_carries_every_figure_of_the_model_unchanged() -> None:
    model = BreakEvenModel(block_size=16, block_bytes=4096)
    model.observe_fetch(TierKind.HOST, 8 * 4096, 2e-4)
    model.observe_forward([(0, 64)], 0.05)
    snapshot = model.snapshot()
    report = BreakEvenReport.model_validate(snapshot)
    assert report.tiers[TierKind.HOST].samples == 1 and report.prefill.samples == 1
    assert set(report.per_block_at_context) == {1024, 4096}
    assert report.model_dump(mode="json") == snapshot  # nothing dropped, renamed or rounded again


def test_the_prefetch_report_has_every_engine_counter_and_keeps_a_copy() -> None:
    assert list(PrefetchReport.model_fields) == [f.name for f in fields(PrefetchCounters)]
    counters = PrefetchCounters(started=2, blocks_planned=5, blocks_used=4, deadline_missed=1)
    metrics = EngineMetrics()
    metrics.set_prefetch(counters)
    counters.started = 99  # the engine thread goes on counting; the report shows what was published
    report = metrics.engine_report().prefetch
    assert report == PrefetchReport(
        started=2, blocks_planned=5, blocks_used=4, deadline_missed=1, recompute_chosen=0, cancelled=0
    )


def scrape(report: StatsReport) -> dict:
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: report))
    return metric_values(generate_latest(registry).decode())


def test_prometheus_shows_the_cost_model_in_base_units_and_the_prefetch_counters(tmp_path: Path) -> None:
    metrics = EngineMetrics()
    metrics.set_prefetch(PrefetchCounters(started=3, blocks_planned=7, blocks_used=6, cancelled=1))
    with CacheManager(make_config(tmp_path), toy_layout(), model_fingerprint="toy-model") as cache:
        cache.costs.observe_fetch(TierKind.HOST, 4 * 4096, 1e-4)
        report = build_report("toy", cache, metrics)
    costs = report.break_even
    assert costs.block_bytes == toy_layout().block_bytes and costs.block_tokens == toy_layout().block_size
    assert costs.tiers[TierKind.HOST].samples == 1 and costs.tiers[TierKind.DISK].samples == 0
    got = scrape(report)
    for kind, tier in costs.tiers.items():
        label = (("tier", kind.value),)
        assert got[("kvtier_tier_bandwidth_bytes_per_second", label)] == tier.bandwidth_gbps * 1e9
        assert got[("kvtier_tier_fetch_latency_seconds", label)] == tier.latency_ms / 1e3
    assert got[("kvtier_prefill_model_seconds_per_token", ())] == costs.prefill.ms_per_token / 1e3
    prefetch = {name: got[(f"kvtier_prefetch_{name}_total", ())] for name in PrefetchReport.model_fields}
    assert prefetch == {
        "started": 3,
        "blocks_planned": 7,
        "blocks_used": 6,
        "deadline_missed": 0,
        "recompute_chosen": 0,
        "cancelled": 1,
    }

    unfitted = report.model_copy(deep=True)
    unfitted.break_even.tiers[TierKind.DISK].bandwidth_gbps = None  # no per-byte cost: no sample, not +Inf
    labels = {k[1] for k in scrape(unfitted) if k[0] == "kvtier_tier_bandwidth_bytes_per_second"}
    assert labels == {(("tier", "device"),), (("tier", "host"),)}


def test_a_quarantined_index_and_lost_blocks_show_in_stats_and_metrics(tmp_path: Path) -> None:
    with CacheManager(make_config(tmp_path), toy_layout(), model_fingerprint="toy-model") as cache:
        assert cache.disk is not None
        cache.disk.stats.add(quarantined=1, lost_blocks=3)  # what a damaged index found at open records
        cache.disk.stats.add(write_errors=2, read_errors=5)  # what ENOSPC / EIO record
        report = build_report("toy", cache, EngineMetrics())
    disk = report.tiers[TierKind.DISK]
    assert (disk.quarantined, disk.lost_blocks, disk.write_errors, disk.read_errors) == (1, 3, 2, 5)
    assert report.tiers[TierKind.HOST].quarantined == 0
    got = scrape(report)
    assert got[("kvtier_tier_quarantined_total", (("tier", "disk"),))] == 1
    assert got[("kvtier_tier_lost_blocks_total", (("tier", "disk"),))] == 3
    assert got[("kvtier_tier_write_errors_total", (("tier", "disk"),))] == 2


def test_speculation_shows_drafted_accepted_and_the_rate_in_stats_and_metrics(tmp_path: Path) -> None:
    metrics = EngineMetrics()
    assert metrics.engine_report().speculation == SpeculationReport(
        verify_steps=0, drafted=0, accepted=0, acceptance_rate=None
    )
    counters = SpeculationCounters(verify_steps=5, drafted=12, accepted=9)
    metrics.set_speculation(counters)
    counters.drafted = 99  # a copy was published
    with CacheManager(make_config(tmp_path), toy_layout(), model_fingerprint="toy-model") as cache:
        report = build_report("toy", cache, metrics)
    assert report.engine.speculation == SpeculationReport(verify_steps=5, drafted=12, accepted=9, acceptance_rate=0.75)
    got = scrape(report)
    assert got[("kvtier_spec_draft_tokens_total", ())] == 12
    assert got[("kvtier_spec_accepted_tokens_total", ())] == 9
    assert got[("kvtier_spec_verify_steps_total", ())] == 5
