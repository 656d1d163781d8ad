"""The benches' shared timer (`kvtier.bench.tiers.median_s`, which `bench gpu` and the peer limits use too)."""

from __future__ import annotations

from kvtier.bench.tiers import median_s


def test_one_warm_up_run_is_dropped_and_before_runs_ahead_of_every_run() -> None:
    calls: list[str] = []
    seconds = median_s(lambda: calls.append("fn"), 3, before=lambda: calls.append("before"))
    assert calls == ["before", "fn"] * 4
    assert seconds >= 0.0
