"""The ``workload`` mode every runner has: the JSON contract with ``kvtier bench peer``, and small helpers.

A runner (``llamacpp_runner.py``, ``vllm_runner.py``) runs in its engine's
own venv, so nothing here imports kvtier (or anything beyond the standard
library): the contract is plain JSON both ways, never pickle.

Workload (written by kvtier's orchestrator, ``kvtier/bench/peer/workload.py``)::

    {"schema": "kvtier-peer-workload/1", "gguf": PATH, "gguf_weight_types": {TYPE: COUNT}, "hf_dir": PATH,
     "threads": 2, "n_ctx": 8192, "reps": 3, "trace_reps": 3,
     "ttft": [{"tokens": N, "new_tokens": 64, "prefix": [ids], "tails": [[ids], ...]}],
     "decode": {"prompt": [ids], "max_tokens": 64},
     "traces": [{"name": NAME, "turns": [[ids], ...]}]}

``tails[0]`` is the warm-up, the others are measured, exactly as
``kvtier.bench.ttft.run`` does; a hit case first runs the prefix alone, so
the cache holds it before the warm-up.

Result (written by a runner)::

    {"schema": "kvtier-peer-result/1", "engine": NAME, "version": V, "setup": {...},
     "ttft": [{"tokens": N, "cases": {CASE: [seconds per measured rep]}, "cold": BOOL}],
     "decode": {"context": N, "max_tokens": M, "runs": [{"ttft_s", "total_s", "tokens"}], "token_ids": [ids]},
     "traces": [{"name": NAME, "cases": {CASE: [[seconds per turn] per rep]}}]}

``cold`` (optional) says whether a disk case's reads were certainly cold.
Raw times only: medians and ratios are the orchestrator's job, the same code
for every engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKLOAD_SCHEMA = "kvtier-peer-workload/1"
RESULT_SCHEMA = "kvtier-peer-result/1"


def log(message: str) -> None:
    """Progress on stderr, prefixed so the orchestrator can echo these lines and only these."""
    print(f"[peer] {message}", file=sys.stderr, flush=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """A runner's ``workload`` mode: ``WORKLOAD.json [RESULT.json] [--probe SETTING]``."""
    parser.add_argument("workload", type=Path, help="workload JSON written by `kvtier bench peer`")
    parser.add_argument("result", type=Path, nargs="?", help="where the result JSON goes")
    parser.add_argument("--probe", default=None, help="time one setting (see fastest()) and print its seconds")


PROBE_PROMPT_TOKENS = 1024
PROBE_NEW_TOKENS = 16


def probe_prompt(workload: dict[str, Any]) -> list[int]:
    """A prompt from the workload's own text: the first TTFT case's prefix, cut to PROBE_PROMPT_TOKENS."""
    return workload["ttft"][0]["prefix"][:PROBE_PROMPT_TOKENS]


def probe_time(run: Callable[[], object], reps: int = 2) -> float:
    """Median seconds of ``run`` (a prefill plus a short decode) after one warm-up."""
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def print_probe(seconds: float) -> None:
    print(json.dumps({"probe_s": seconds}), flush=True)


def fastest(script: str, workload: Path, candidates: list[str], timeout_s: float = 900.0) -> tuple[str, dict[str, Any]]:
    """Run this runner once per candidate setting with ``--probe``, each in a fresh process; keep the fastest.

    A peer is compared at its best on the machine at hand (vLLM's dtype,
    llama.cpp's threads differ in speed from one CPU to the next), so each
    candidate times the same prefill and short decode, and the record keeps
    every candidate's time. A candidate that fails is recorded with its error
    and never chosen.
    """
    times: dict[str, Any] = {}
    for c in candidates:
        log(f"probe {c}: {PROBE_PROMPT_TOKENS}-token prefill + {PROBE_NEW_TOKENS} tokens")
        proc = subprocess.run(
            [sys.executable, script, "workload", "--probe", c, str(workload)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"probe_s"')]
        if proc.returncode != 0 or not lines:
            times[c] = {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
            continue
        times[c] = round(json.loads(lines[-1])["probe_s"], 4)
    timed = {c: t for c, t in times.items() if isinstance(t, float)}
    if not timed:
        raise SystemExit(f"every probe failed: {times}")
    best = min(timed, key=timed.__getitem__)
    log(f"probes {times}: using {best}")
    return best, {"candidates": times, "chosen": best, "by": "fastest probe"}


def read_workload(path: Path) -> dict[str, Any]:
    workload = json.loads(path.read_text())
    if workload.get("schema") != WORKLOAD_SCHEMA:
        raise SystemExit(f"{path}: schema {workload.get('schema')!r}, expected {WORKLOAD_SCHEMA!r}")
    return workload


def write_result(path: Path, **fields: Any) -> None:
    path.write_text(json.dumps({"schema": RESULT_SCHEMA, **fields}))


def traces(w: dict[str, Any], cases: Callable[[list[list[int]], int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Every trace of the workload, ``cases(turns, reps)`` timing it in an engine: the result's ``traces``."""
    out = []
    for trace in w["traces"]:
        log(f"trace {trace['name']}: {len(trace['turns'])} turns x {w['trace_reps']}")
        out.append({"name": trace["name"], "cases": cases(trace["turns"], w["trace_reps"])})
    return out


def decode_result(spec: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``decode`` part of a result, from the workload's decode spec and each run's measurement."""
    return {
        "context": len(spec["prompt"]),
        "max_tokens": spec["max_tokens"],
        "runs": [{k: r[k] for k in ("ttft_s", "total_s", "tokens")} for r in runs],
        "token_ids": runs[0]["token_ids"],
    }


def prompts(case: dict[str, Any]) -> list[list[int]]:
    """prefix + each tail; index 0 is the warm-up."""
    return [case["prefix"] + tail for tail in case["tails"]]


def measure(fn: Callable[[list[int]], float], cases: list[list[int]]) -> list[float]:
    """Warm up on ``cases[0]``, return the times of the rest (as ``kvtier.bench.ttft`` does)."""
    fn(cases[0])
    return [fn(p) for p in cases[1:]]


def drop_page_cache(directory: Path) -> bool:
    """fsync then ``POSIX_FADV_DONTNEED`` every file under ``directory``: the next read comes from the device.

    Dirty pages cannot be dropped, hence the fsync first. False when any file
    refused, so the result can say the read was not certainly cold.
    """
    cold = True
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            cold = False
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            cold = False
        finally:
            os.close(fd)
    return cold
