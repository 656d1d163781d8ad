"""kvtier's side of the comparison, measured in-process on the workload the peers get.

The results take the same JSON shape as a peer runner's
(``bench/runners/workload.py``), so medians, ratios, the table and the plot are
one code path for all three engines.

* TTFT is :func:`kvtier.bench.ttft.run` itself (miss, host hit, cold disk
  hit, resident hit); :func:`kvtier.bench.peer.workload.ttft_prompts` gives
  the peers the very same prompts.
* Decode: a no-cache engine, greedy, ``ignore_eos``; ``Completion.ttft_s``
  and ``total_s`` give the rate after the first token.
* Traces, each case on fresh state: ``no_cache`` (one pass: it is the slow,
  steady baseline), ``tiers`` (host + disk in a temporary data dir, nothing
  kept resident, so the tiers serve every reused prefix) and ``resident``
  (the same plus the engine's pool keeping finished requests' blocks).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvtier
from kvtier import hardware, openmp
from kvtier.bench import ttft
from kvtier.bench.peer.workload import Trace, Workload
from kvtier.config import Config
from kvtier.engine.engine import Engine
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.hardware import compute_dtype

ENGINE = "kvtier"
DISK_BYTES = 1024**3  # the longest trace's KV in float32 is ~330 MB; the slab is preallocated


def run(loaded: LoadedModel, config: Config, workload: Workload) -> dict[str, Any]:
    spec = workload.spec
    sizes = [t.tokens for t in workload.ttft]
    return {
        "engine": ENGINE,
        "version": kvtier.__version__,
        "setup": {
            "weights": loaded.path.name,
            "compute": f"dequantized to {compute_dtype(config).value}, KV in {hardware.kv_dtype(config)}",
            "decode_activations": "q8" if loaded.model.q8_decode else "exact",  # engine.decode_activations, as run
            "dtype": compute_dtype(config).value,
            "block_size": config.cache.block_size,
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": openmp.wait_policy,  # torch's idle OpenMP workers asleep (PASSIVE) or spinning
            "host_bytes": int(config.host.capacity_bytes),
            "ttft_api": "kvtier.bench.ttft.run (Engine.generate, max_tokens=1)",
            "decode_api": "Engine.generate, greedy, ignore_eos",
            "trace_no_cache_reps": 1,
        },
        "ttft": [_ttft(loaded, config, n, spec.reps) for n in sizes],
        "decode": _decode(loaded, config, workload.decode_prompt, spec.decode_tokens, spec.reps),
        "traces": [_trace(loaded, config, t, spec.trace_reps) for t in workload.traces],
    }


def _ttft(loaded: LoadedModel, config: Config, tokens: int, reps: int) -> dict[str, Any]:
    result = ttft.run(loaded, config, ttft.TTFTSpec(tokens=tokens, reps=reps))
    cases = {name.removesuffix("_s"): times for name, times in result["setup"]["all_s"].items()}
    return {"tokens": tokens, "cases": cases, "cold": result["cold"]}


def _decode(loaded: LoadedModel, config: Config, prompt: list[int], max_tokens: int, reps: int) -> dict[str, Any]:
    engine = make_engine(loaded, config, cache=None, keep_resident=False)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    runs = []
    for _ in tqdm(range(reps + 1), desc="kvtier decode", unit="run", leave=False):
        (done,) = engine.generate([prompt], params)
        runs.append(done)
    runs = runs[1:]  # the first warmed up
    return {
        "context": len(prompt),
        "max_tokens": max_tokens,
        "runs": [{"ttft_s": r.ttft_s, "total_s": r.total_s, "tokens": len(r.token_ids)} for r in runs],
        "token_ids": runs[0].token_ids,
    }


def _trace(loaded: LoadedModel, config: Config, trace: Trace, reps: int) -> dict[str, Any]:
    """Every turn's TTFT per case, and whether each cached replay's first tokens are the uncached ones.

    The first token of a turn is the argmax of logits computed over the
    reused KV, so a cached block that differs by one bit from what a
    recompute makes would show here, turn after turn.
    """
    total = len(trace.turns) * (1 + 2 * reps)
    cases: dict[str, list[list[float]]] = {"no_cache": [], "tiers": [], "resident": []}
    same: dict[str, list[bool]] = {"tiers": [], "resident": []}
    with tqdm(total=total, desc=f"kvtier trace {trace.name}", unit="turn", leave=False) as bar:
        engine = make_engine(loaded, config, cache=None, keep_resident=False)
        times, cold = _replay(engine, trace, bar)
        cases["no_cache"].append(times)
        for _ in range(reps):
            for case, resident in (("tiers", False), ("resident", True)):
                with tempfile.TemporaryDirectory(prefix="bench-peer-", dir=_mkdir(config.data_dir)) as tmp:
                    cfg = _temp_tiers(config, Path(tmp))
                    with open_cache(loaded, cfg) as cache:
                        engine = make_engine(loaded, cfg, cache=cache, keep_resident=resident)
                        times, first = _replay(engine, trace, bar)
                        cases[case].append(times)
                        same[case] += [a == b for a, b in zip(first, cold, strict=True)]
    turns = {case: {"same": sum(v), "of": len(v)} for case, v in same.items()}
    return {"name": trace.name, "cases": cases, "first_token_as_no_cache": turns}


def _replay(engine: Engine, trace: Trace, bar: tqdm) -> tuple[list[float], list[int]]:
    """TTFT and first token of each turn in order; stores drain between turns (the tool call's time, as in the demo)."""
    times, first = [], []
    for ids in trace.turns:
        (done,) = engine.generate([ids], ttft.FIRST_TOKEN)
        engine.drain_stores()
        times.append(done.ttft_s)
        first.append(done.token_ids[0])
        bar.update()
    return times, first


def _temp_tiers(config: Config, data_dir: Path) -> Config:
    """``config`` with its data dir (so the disk tier and the key secret) in ``data_dir``."""
    tree = config.model_dump()
    tree["data_dir"] = str(data_dir)
    tree["disk"] = {**tree["disk"], "path": None, "enabled": True, "capacity_bytes": DISK_BYTES}
    return Config.model_validate(tree)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path
