"""The verdicts and table of ``kvtier bench soak``, on a hand-made result (the run itself needs minutes)."""

from __future__ import annotations

from typing import Any

from kvtier.bench import soak


def result(short_s: float, computed: int) -> dict[str, Any]:
    return {
        "setup": {
            "date": "2026-12-04T00:00:00Z",
            "source": "this checkout",
            "long_tokens": 8000,
            "burst": 4,
            "shared_tokens": 1100,
            "own_tokens": 600,
        },
        "short_alone_s": 0.1,
        "long_and_short": {"long_ttft_s": 30.0, "short_ttft_s": short_s, "step_budget_s": 2.0},
        "burst": {
            "ttft_s": [1.0, 2.0, 3.0, 4.0],
            "ttft_p50_s": 2.0,
            "ttft_p99_s": 4.0,
            "wall_s": 4.0,
            "prefill_tokens_computed": computed,
            "prompt_tokens": 4 * 1700,
        },
    }


def test_targets_are_two_x_alone_plus_a_step_and_the_shared_blocks_once() -> None:
    # 2 x 0.1 + 2.0 = 2.2 s; 6,800 prompt tokens less 3 x 1,088 shareable (68 whole blocks) = 3,536.
    assert [(got, target, ok) for _, got, target, ok in soak.checks(result(2.1, 3536))] == [
        (2.1, 2.2, True),
        (3536, 3536, True),
    ]
    assert [ok for *_, ok in soak.checks(result(30.0, 6800))] == [False, False]


def test_the_table_names_both_targets_and_their_verdicts() -> None:
    lines = soak.table(result(2.1, 3536)).splitlines()
    assert lines[-2].endswith("pass") and lines[-1].endswith("pass")
    assert "p50 2.00 s, p99 4.00 s" in lines[3]


def test_quantiles_are_taken_from_the_measurements() -> None:
    xs = [float(i) for i in range(1, 17)]
    assert (soak._quantile(xs, 0.5), soak._quantile(xs, 0.99)) == (9.0, 16.0)
