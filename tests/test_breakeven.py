"""The reload-vs-recompute model: fits what it is shown, and plans cuts that follow the costs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtier.breakeven import BreakEvenModel
from kvtier.tiers.base import TierKind

H, D = TierKind.HOST, TierKind.DISK
BLOCK, BLOCK_BYTES = 16, 737_280  # SmolLM2 float32


def truth(start: int, count: int) -> float:
    """A machine whose prefill costs 10 ms + 2 ms/token + 100 ns per attended position."""
    return 0.01 + 2e-3 * count + 1e-7 * (count * start + count * (count + 1) / 2)


def trained(**kw: float) -> BreakEvenModel:
    model = BreakEvenModel(BLOCK, BLOCK_BYTES, **kw)
    rng = np.random.default_rng(0)
    for _ in range(40):
        start, count = int(rng.integers(0, 4096)), int(rng.integers(2, 2048))
        model.observe_forward([(start, count)], truth(start, count))
    return model


def test_prefill_fit_predicts_what_it_was_shown() -> None:
    model = trained()
    for start, count in [(0, 2048), (4032, 64), (1024, 512)]:
        assert model.prefill_s(start, count) == pytest.approx(truth(start, count), rel=0.15)


def test_short_prompts_do_not_move_the_attention_term() -> None:
    """Short prompts carry almost no attention time: the prior's figure stands instead of a wild extrapolation."""
    model = BreakEvenModel(BLOCK, BLOCK_BYTES)
    prior = model.snapshot()["prefill"]["ns_per_attended_position"]
    for n in (30, 35, 33):
        model.observe_forward([(0, n)], 0.03 + n * 3.7e-3)
    assert model.snapshot()["prefill"]["ns_per_attended_position"] == pytest.approx(prior, rel=0.05)
    assert model.snapshot()["prefill"]["ms_per_token"] > 2.5  # the term that carried the time moved


def test_decode_only_steps_do_not_teach_the_prefill_model() -> None:
    model = BreakEvenModel(BLOCK, BLOCK_BYTES)
    model.observe_forward([(100, 1), (200, 1)], 0.05)
    assert model.snapshot()["prefill"]["samples"] == 0


def test_tier_fit_follows_measured_bandwidth() -> None:
    model = BreakEvenModel(BLOCK, BLOCK_BYTES)
    for blocks in (8, 32, 64, 128, 256):  # a 1 GB/s disk with 1 ms per batch
        model.observe_fetch(D, blocks * BLOCK_BYTES, 1e-3 + blocks * BLOCK_BYTES / 1e9)
    assert model.snapshot()["tiers"]["disk"]["bandwidth_gbps"] == pytest.approx(1.0, rel=0.1)
    # A disk block also pays the host -> pool copy on top of its own read.
    assert model.fetch_s(D, 100) > model.fetch_s(H, 100) + 100 * BLOCK_BYTES / 1e9 * 0.9


def test_plan_fetches_everything_when_fetching_is_cheap() -> None:
    plan = trained().plan([H] * 256, 0, 4096 + 64)
    assert plan.blocks == 256
    assert 0 < plan.fetch_s < plan.recompute_s
    assert plan.fetch_s <= plan.deadline_s <= plan.recompute_s


def test_plan_stops_where_the_slow_tier_begins() -> None:
    model = trained()
    for _ in range(5):  # a disk that needs 10 s per block: recomputing always wins
        model.observe_fetch(D, BLOCK_BYTES, 10.0)
    plan = model.plan([H] * 10 + [D] * 50, 0, 60 * BLOCK + 8)
    assert plan.blocks == 10
    assert model.plan([D] * 50, 10, 60 * BLOCK + 8).blocks == 0


def test_deadline_never_exceeds_what_the_fetch_saves() -> None:
    model = trained(deadline_slack=1000.0)
    plan = model.plan([D] * 4, 0, 4 * BLOCK + 1)
    assert plan.blocks == 4 and plan.deadline_s == pytest.approx(plan.recompute_s)


def test_extension_judges_a_fetch_on_its_own_progress() -> None:
    model = trained()
    total = 256 * BLOCK + 64
    recompute_all = model.prefill_s(0, total) - model.prefill_s(256 * BLOCK, 64)
    # Nothing landed yet: no rate; it may wait until it has spent half of what it saves, no longer.
    assert model.extension_s(0, 256, 0, 0.1, total) == pytest.approx(recompute_all / 2 - 0.1)
    assert model.extension_s(0, 256, 0, recompute_all / 2, total) == 0.0
    assert model.extension_s(0, 256, 192, 0.1, total) > 0.0  # 64 blocks in ~33 ms vs recomputing 1,024 tokens
    assert model.extension_s(0, 256, 1, 10.0, total) == 0.0  # 255 more blocks at 10 s each: recompute


def test_snapshot_is_plain_json() -> None:
    snap = trained().snapshot()
    assert json.loads(json.dumps(snap)) == snap
    block = snap["per_block_at_context"]["4096"]
    assert block["recompute_ms"] > snap["per_block_at_context"]["1024"]["recompute_ms"] > 0
    assert block["host_wins_x"] > block["disk_wins_x"] > 0


def test_a_fit_on_overhead_bound_forwards_still_fetches() -> None:
    """Tiny prompts cost the same whatever their length; recomputing must still not look free."""
    model = BreakEvenModel(BLOCK, BLOCK_BYTES)
    for n in (20, 40, 60, 80, 100, 120):
        model.observe_forward([(0, n)], 0.05)  # all fixed cost
    assert model.snapshot()["prefill"]["ms_per_token"] > 0
    assert model.plan([H] * 6, 0, 6 * BLOCK + 9).blocks == 6


def test_plan_prices_a_mixed_prefix_as_the_sum_of_its_tiers() -> None:
    """Each tier among the first k blocks pays its latency once and its bytes per block."""
    model = trained()
    for blocks in (8, 64):
        model.observe_fetch(D, blocks * BLOCK_BYTES, 2e-3 + blocks * BLOCK_BYTES / 1.5e9)
    tiers = [H] * 3 + [D] * 5 + [H] * 2
    plan = model.plan(tiers, 0, 10 * BLOCK + 8)
    assert plan.blocks == 10
    assert plan.fetch_s == pytest.approx(model.fetch_s(H, 5) + model.fetch_s(D, 5))
    model.observe_fetch(D, BLOCK_BYTES, 5.0)  # a fresh sample is seen by the next plan
    assert model.plan(tiers, 0, 10 * BLOCK + 8).fetch_s > plan.fetch_s
