"""llama-cpp-python 0.3.36 with kvtier's ``KVTierLlamaCache``: run by llama's own venv, driven by JSON lines.

``serve``: one ``Llama`` (greedy, ``--n-threads``); one JSON command per stdin
line, each answered by one stdout line ``KVTIER {json}``:

- at start: ``{"ready": true, "llama_cpp": version, "setting": {...}, "flavour", "namespace"}``;
- ``{"op": "generate", "prompt": [ids], "max_tokens": n}``: ``{"tokens": [the
  completion's ids], "ttft_s", "total_s", "cached_tokens", "counters": {...},
  "saved": {...} | null}``. The context is reset first, so whatever is reused
  comes from kvtier, never from this process's own KV;
- ``{"op": "quit"}``.

Without ``--socket`` the cache only records the completion's ids (it never
answers a lookup): the reference output, computed from nothing.

``bench``: cold and hit time to first token (:func:`bench`), each in fresh
``serve`` processes of this script, against a running cache service;
prints one ``KVTIER {json}`` line. The prompts come from a JSON file
(``{"prompts": [[ids], ...], "question": [ids]}``), written by whoever calls.

The parent side (:class:`Engine`) needs no llama_cpp: the in-engine tests
drive this script from kvtier's own venv with it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PREFIX = "KVTIER "


# -- the parent's side -------------------------------------------------------------------------------
class EngineFailed(RuntimeError):
    pass


class Engine:
    """A ``serve`` process: started with ``python`` (llama's venv), asked one command at a time, stopped by PID."""

    def __init__(self, python: str | Path, args: Sequence[str], log: Path, *, timeout: float = 600.0) -> None:
        self.log = log
        self.timeout = timeout
        with log.open("a") as err:
            self.proc = subprocess.Popen(
                [str(python), __file__, "serve", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=Path(__file__).resolve().parents[3],
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self._reply()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise EngineFailed(f"no answer in {self.timeout:.0f} s:\n{self.tail()}") from None
            if line is None:
                raise EngineFailed(f"the engine exited (rc {self.proc.wait()}):\n{self.tail()}")
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def generate(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "generate", "prompt": list(prompt), "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine_args(model: str | Path, socket: str | Path | None, *, n_threads: int, n_ctx: int) -> list[str]:
    args = ["--model", str(model), "--n-threads", str(n_threads), "--n-ctx", str(n_ctx)]
    return args + (["--socket", str(socket)] if socket is not None else [])


# -- the engine's side -------------------------------------------------------------------------------
def say(obj: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(obj), flush=True)


def serve(args: argparse.Namespace) -> int:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_cache import BaseLlamaCache

    from kvtier.connectors.llamacpp import KVTierLlamaCache, flavour_of

    class Recorder(BaseLlamaCache):
        """No cache at all, except that it keeps the ids llama stores under (the completion's own ids)."""

        last_key: tuple[int, ...] = ()

        @property
        def cache_size(self) -> int:
            return 0

        def __getitem__(self, key: Sequence[int]) -> Any:
            raise KeyError("the reference run computes everything")

        def __contains__(self, key: Sequence[int]) -> bool:
            return False

        def __setitem__(self, key: Sequence[int], value: Any) -> None:
            self.last_key = tuple(key)

    class Recording(KVTierLlamaCache):
        """kvtier's cache, timed, keeping the ids llama stores under."""

        last_key: tuple[int, ...] = ()
        lookup_s = save_s = 0.0

        def __getitem__(self, key: Sequence[int]) -> Any:
            started = time.perf_counter()
            try:
                return super().__getitem__(key)
            finally:
                self.lookup_s = time.perf_counter() - started

        def __setitem__(self, key: Sequence[int], value: Any) -> None:
            self.last_key = tuple(key)
            started = time.perf_counter()
            super().__setitem__(key, value)
            self.save_s = time.perf_counter() - started

    llm = Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.n_threads, verbose=False)
    cache: Any = Recording.attach(llm, args.socket) if args.socket else Recorder()
    if not args.socket:
        llm.set_cache(cache)
    setting = {
        "n_threads": args.n_threads,
        "n_ctx": args.n_ctx,
        "n_batch": llm.n_batch,
        "temperature": 0.0,
        "kv_type": "f16",
        "cpus": os.cpu_count(),
        "cache": "kvtier" if args.socket else "none",
    }
    say(
        {
            "ready": True,
            "llama_cpp": llama_cpp.__version__,
            "setting": setting,
            "flavour": flavour_of(llm),
            "namespace": getattr(cache, "namespace", None),
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "generate":
            say(generate(llm, cache, cmd["prompt"], cmd["max_tokens"]))
        else:
            say({"error": f"no op {cmd['op']!r}"})
    if args.socket:
        cache.close()
    return 0


def generate(llm: Any, cache: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    llm.reset()
    counters = getattr(cache, "counters", None)
    hits = counters.hits if counters else 0
    started = time.perf_counter()
    ttft = None
    for _ in llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stream=True):
        if ttft is None:
            ttft = time.perf_counter() - started
    total = time.perf_counter() - started
    out: dict[str, Any] = {"tokens": list(cache.last_key[len(prompt) :]), "ttft_s": ttft, "total_s": total}
    if counters is not None:
        hit = counters.hits > hits
        out["cached_tokens"] = counters.last_hit_tokens if hit else 0
        out["lookup_s"], out["save_s"] = cache.lookup_s, cache.save_s
        out["counters"] = {
            "lookups": counters.lookups,
            "hits": counters.hits,
            "misses": counters.misses,
            "saves": {str(k): v for k, v in counters.saves.items()},
            "service_failures": cache.service_failures,
        }
        saved = cache.last_saved
        out["saved"] = None if saved is None else {"position": saved.position.hex(), "generation": saved.generation}
    else:
        out["cached_tokens"] = 0
    return out


def bench(args: argparse.Namespace) -> int:
    """cold_s: TTFT of each prompt, nothing cached; hit_s: the prompt + the question in a fresh process.

    Medians over the prompts (each one cold once). ``same_output``: every
    hit's greedy tokens equal a run of the same prompt with no cache at all.
    """
    spec = json.loads(Path(args.prompts).read_text())
    question, work = spec["question"], Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    kw = {"n_threads": args.n_threads, "n_ctx": args.n_ctx}
    runs: dict[str, list[Any]] = {"cold_s": [], "hit_s": [], "hit_lookup_s": [], "hit_tokens": [], "same": []}
    setting: dict[str, Any] = {}
    for i, prompt in enumerate(spec["prompts"]):
        asked = prompt + question
        with Engine(sys.executable, engine_args(args.model, None, **kw), work / f"alone-{i}.log") as alone:
            reference = alone.generate(asked, args.max_tokens)["tokens"]
        with Engine(sys.executable, engine_args(args.model, args.socket, **kw), work / f"cold-{i}.log") as cold:
            runs["cold_s"].append(cold.generate(prompt, args.max_tokens)["ttft_s"])
        with Engine(sys.executable, engine_args(args.model, args.socket, **kw), work / f"hit-{i}.log") as hit:
            got = hit.generate(asked, args.max_tokens)
            setting = {**hit.ready["setting"], "llama_cpp": hit.ready["llama_cpp"], "max_tokens": args.max_tokens}
        runs["hit_s"].append(got["ttft_s"])
        runs["hit_lookup_s"].append(got["lookup_s"])
        runs["hit_tokens"].append(got["cached_tokens"])
        runs["same"].append(got["tokens"] == reference)
    cold_s, hit_s = statistics.median(runs["cold_s"]), statistics.median(runs["hit_s"])
    say(
        {
            "cold_s": cold_s,
            "hit_s": hit_s,
            "speedup": round(cold_s / hit_s, 2),
            "hit_tokens": int(statistics.median(runs["hit_tokens"])),
            "same_output": all(runs["same"]),
            "prompt_tokens": [len(p) + len(question) for p in spec["prompts"]],
            "setting": setting,
            "runs": runs,
        }
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for name in ("serve", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--socket", default=None, help="unix:///path of the cache service (serve: none = no cache)")
        p.add_argument("--n-threads", type=int, default=2)
        p.add_argument("--n-ctx", type=int, default=4608)
    b = sub.choices["bench"]
    b.add_argument("--prompts", required=True, help='JSON file: {"prompts": [[ids], ...], "question": [ids]}')
    b.add_argument("--max-tokens", type=int, default=8)
    b.add_argument("--work", required=True, help="a directory for the engines' logs")
    args = parser.parse_args(argv)
    return serve(args) if args.mode == "serve" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
