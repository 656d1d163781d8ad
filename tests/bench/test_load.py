"""`kvtier bench load`: its agents' prompts, its verdicts on hand-made samples, a short run against a real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench import load
from kvtier.bench.load import LoadSpec, Probe, Sample
from kvtier.bench.soak import kv_bytes_per_token


def test_a_session_only_grows_and_every_session_starts_with_the_shared_prompt() -> None:
    spec = LoadSpec(clients=4, turns=3, turn_tokens=32, shared_tokens=64)
    agents = load.Agents(spec)
    turns = [agents.prompt(1, 0, t) for t in range(spec.turns)]
    assert [len(p) for p in turns] == [96, 128, 160]
    assert all(turns[t + 1][: len(turns[t])] == turns[t] for t in range(spec.turns - 1))
    firsts = {tuple(agents.prompt(c, s, 0)[:65]) for c in range(4) for s in range(3)}
    assert len(firsts) == 12  # every session its own blocks past the shared prompt
    assert len({tuple(agents.prompt(c, s, 0)[:64]) for c in range(4) for s in range(3)}) == 1


def test_the_host_tier_is_a_third_of_the_working_set() -> None:
    spec = LoadSpec()
    assert spec.working_set_tokens == 128 + 64 * 8 * 48
    host = spec.sections()["host"]["capacity_bytes"]
    assert host * 3 == pytest.approx(spec.working_set_tokens * kv_bytes_per_token(), abs=3)


def samples(n: int, *, error_at: int | None = None) -> list[Sample]:
    return [
        Sample(i % 4, ended_s=i + 0.5, ttft_s=0.1 * (i % 10 + 1), prompt_tokens=100, cached_tokens=75,
               error="HTTP 503: b''" if i == error_at else None)
        for i in range(n)
    ]  # fmt: skip


def probes(n: int, rss: list[int], floor: list[int]) -> list[Probe]:
    """One probe a second; ``rss`` and ``floor`` are per 10-second window; the last probe is the idle one."""
    out = [Probe(float(i), rss[i // 10], floor[i // 10] + (i % 2) * 5) for i in range(n)]
    return [*out, Probe(float(n), rss[-1], 0)]


SPEC = LoadSpec(clients=4, window_s=10, sample_s=1, warmup_fraction=0.2)


def test_flat_rss_and_pins_pass_and_every_figure_comes_from_the_samples() -> None:
    got = load.summarize(SPEC, samples(100), probes(100, [900, 1000] + [1010] * 8, [0] * 10), 100.0)
    s = got["summary"]
    assert (s["requests"], s["errors"], s["warmup_s"], s["window_s"]) == (100, 0, 20.0, 10.0)
    assert (s["rss_after_warmup_bytes"], s["rss_end_bytes"]) == (1010, 1010)  # windows from 20 s on
    assert s["hit_rate"] == 0.75
    assert s["ttft_p99_s"] == pytest.approx(1.0) and s["ttft_p50_s"] == pytest.approx(0.6)
    assert s["checks"] == {"no_errors": True, "rss_flat": True, "pinned_flat": True, "pinned_idle_zero": True}
    assert [w["requests"] for w in got["series"]] == [10] * 10
    assert got["series"][0]["pinned_max"] == 5 and got["series"][0]["pinned_min"] == 0


def test_growing_rss_a_rising_pin_floor_or_one_error_fail() -> None:
    got = load.summarize(SPEC, samples(100, error_at=50), probes(100, [1000] * 9 + [1100], [4] * 9 + [9]), 100.0)
    s = got["summary"]
    assert s["rss_growth"] == pytest.approx(0.1) and s["pinned_floor_growth"] == pytest.approx(1.25)
    assert s["errors"] == 1 and s["error_examples"] == ["HTTP 503: b''"]
    assert s["checks"] == {"no_errors": False, "rss_flat": False, "pinned_flat": False, "pinned_idle_zero": True}


@pytest.mark.slow
def test_a_short_run_against_a_real_server(tmp_path: Path) -> None:
    spec = LoadSpec(clients=8, requests=16, minutes=10, turns=2, sample_s=0.5)
    result = load.run(spec)
    s = result["summary"]
    assert (s["requests"], s["errors"]) == (16, 0)
    assert len(result["samples"]) == 16 and all(x["ttft_s"] > 0 for x in result["samples"])
    assert s["hit_rate"] is None or 0 <= s["hit_rate"] <= 1
    assert sum(x["cached_tokens"] for x in result["samples"]) > 0  # turn 2 of a session reuses turn 1
    assert s["pinned_idle"] == 0
    assert load.recompute(json.loads(json.dumps(result))) == {"summary": s, "series": result["series"]}
    path, _ = load.save(result, tmp_path)
    assert json.loads(path.read_text())["summary"] == s
    assert "16 requests, 0 errors" in load.table(result)


def test_warm_up_lasts_until_host_memory_is_full() -> None:
    """RSS climbs while the host slab's pages are first touched: that is filling, not a leak."""
    rising = [900, 950, 1000, 1050] + [1060] * 6
    ps = [Probe(p.at_s, p.rss_bytes, p.pinned_blocks, host_full=p.at_s >= 40) for p in probes(100, rising, [0] * 10)]
    s = load.summarize(SPEC, samples(100), ps, 100.0)["summary"]
    assert (s["host_full_s"], s["warmup_s"], s["rss_after_warmup_bytes"], s["checks"]["rss_flat"]) == (
        40.0,
        40.0,
        1060,
        True,
    )
