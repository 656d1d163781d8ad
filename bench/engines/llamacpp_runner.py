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

The parent side is kvtier's :func:`kvtier.bench.engines.llamacpp_engine`
(an ``EngineProcess``): the in-engine tests, ``kvtier bench engines`` and this
script's own ``bench`` mode all drive ``serve`` processes with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PREFIX = "KVTIER "


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
    from kvtier.bench.engines import llamacpp_engine

    spec = json.loads(Path(args.prompts).read_text())
    py = Path(sys.executable)
    question, work = spec["question"], Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    kw = {"n_threads": args.n_threads, "n_ctx": args.n_ctx}
    runs: dict[str, list[Any]] = {"cold_s": [], "hit_s": [], "hit_lookup_s": [], "hit_tokens": [], "same": []}
    setting: dict[str, Any] = {}
    for i, prompt in enumerate(spec["prompts"]):
        asked = prompt + question
        with llamacpp_engine(py, work / f"alone-{i}.log", args.model, None, **kw) as alone:
            reference = alone.generate(asked, args.max_tokens)["tokens"]
        with llamacpp_engine(py, work / f"cold-{i}.log", args.model, args.socket, **kw) as cold:
            runs["cold_s"].append(cold.generate(prompt, args.max_tokens)["ttft_s"])
        with llamacpp_engine(py, work / f"hit-{i}.log", args.model, args.socket, **kw) as hit:
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
