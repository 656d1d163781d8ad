"""kvtier's side of `kvtier bench peer` on the real model: a short trace replayed without and with the cache."""

from __future__ import annotations

from pathlib import Path

from kvtier.bench import ttft
from kvtier.bench.peer import measure
from kvtier.bench.peer.workload import Trace
from kvtier.engine.runtime import LoadedModel
from tests.engine.test_engine import config


def test_a_replayed_trace_times_every_turn_and_checks_its_first_tokens(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    ids = ttft.text_tokens(loaded_model, 120)
    trace = Trace("short", [ids[:40], ids[:80], ids[:120]])  # each turn's prompt holds the last one's full blocks
    out = measure._trace(loaded_model, config(tmp_path), trace, reps=1)
    assert out["name"] == "short"
    assert {case: [len(rep) for rep in reps] for case, reps in out["cases"].items()} == {
        "no_cache": [3],
        "tiers": [3],
        "resident": [3],
    }
    assert out["first_token_as_no_cache"] == {"tiers": {"same": 3, "of": 3}, "resident": {"same": 3, "of": 3}}
