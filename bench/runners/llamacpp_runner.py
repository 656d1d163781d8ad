"""llama-cpp-python, run by its own venv's python: the one runner for every use of llama.cpp here.

Three modes: ``serve`` and ``bench`` (llama.cpp with kvtier's
``KVTierLlamaCache``, below) and ``workload`` (llama.cpp alone on ``kvtier
bench peer``'s workload, the contract in ``workload.py``)::

    .venv-peer-llamacpp/bin/python bench/runners/llamacpp_runner.py workload WORKLOAD.json RESULT.json

``workload``, how each number is taken: TTFT is ``create_completion(ids,
max_tokens=1, stream=True)`` until its first chunk (llama-cpp-python yields
it before it saves the state to its cache, so the save is not counted; the
stream is then drained, so the save happens before the next request).
``llm.reset()`` before every request that must not reuse what the context
already holds. ``miss`` runs with no cache; ``ram_hit`` with
``LlamaRAMCache``; ``disk_hit`` with ``LlamaDiskCache`` in a temporary
directory whose page cache is dropped before each request. Decode is
``llm.generate`` (the token loop ``create_completion`` runs), greedy, counted
token by token; it never stops at EOS by itself, which is the ``ignore_eos``
the other engines get. The thread count is llama.cpp's fastest of 1 .. the
bench's threads, probed in fresh processes.

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
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import workload
from llama_cpp import Llama, LlamaDiskCache, LlamaRAMCache

PREFIX = "KVTIER "
RAM_CACHE_BYTES = 8 << 30  # well above what any case stores (a 7k-token state is ~170 MB)


# -- the engine's side -------------------------------------------------------------------------------
def say(obj: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(obj), flush=True)


def serve(args: argparse.Namespace) -> int:
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


# -- llama.cpp alone, on kvtier bench peer's workload ------------------------------------------------


def first_token_s(llm: Llama, ids: list[int], *, reset: bool = True) -> float:
    if reset:
        llm.reset()
    start = time.perf_counter()
    stream = llm.create_completion(ids, max_tokens=1, temperature=0.0, stream=True)
    next(iter(stream))
    elapsed = time.perf_counter() - start
    for _ in stream:  # lets create_completion save its cache entry
        pass
    return elapsed


def ttft_cases(llm: Llama, case: dict[str, Any]) -> tuple[dict[str, list[float]], bool]:
    """The three cases, and whether every disk read was certainly cold."""
    prompts = workload.prompts(case)
    out: dict[str, list[float]] = {}
    llm.set_cache(None)
    out["miss"] = workload.measure(lambda p: first_token_s(llm, p), prompts)
    llm.set_cache(LlamaRAMCache(capacity_bytes=RAM_CACHE_BYTES))
    first_token_s(llm, case["prefix"])
    out["ram_hit"] = workload.measure(lambda p: first_token_s(llm, p), prompts)
    with tempfile.TemporaryDirectory(prefix="peer-llamacpp-disk-") as tmp:
        llm.set_cache(LlamaDiskCache(cache_dir=tmp, capacity_bytes=RAM_CACHE_BYTES))
        first_token_s(llm, case["prefix"])
        cold: list[bool] = []

        def from_disk(p: list[int]) -> float:
            cold.append(workload.drop_page_cache(Path(tmp)))
            return first_token_s(llm, p)

        out["disk_hit"] = workload.measure(from_disk, prompts)
    llm.set_cache(None)
    return out, all(cold)


def decode_run(llm: Llama, ids: list[int], max_tokens: int) -> dict[str, Any]:
    llm.reset()
    tokens: list[int] = []
    start = time.perf_counter()
    first = 0.0
    for token in llm.generate(ids, temp=0.0):
        if not tokens:
            first = time.perf_counter() - start
        tokens.append(int(token))
        if len(tokens) == max_tokens:
            break
    return {"ttft_s": first, "total_s": time.perf_counter() - start, "tokens": len(tokens), "token_ids": tokens}


def trace_cases(llm: Llama, turns: list[list[int]], reps: int) -> dict[str, list[list[float]]]:
    """``ram_cache``: context reset every turn, so LlamaRAMCache serves the prefix; ``in_context``: no reset."""
    out: dict[str, list[list[float]]] = {"ram_cache": [], "in_context": []}
    for _ in range(reps):
        for case, reset in (("ram_cache", True), ("in_context", False)):
            llm.set_cache(LlamaRAMCache(capacity_bytes=RAM_CACHE_BYTES))
            llm.reset()
            out[case].append([first_token_s(llm, ids, reset=reset) for ids in turns])
    llm.set_cache(None)
    return out


def make_llama(w: dict[str, Any], threads: int) -> Llama:
    return Llama(
        model_path=w["gguf"], n_ctx=w["n_ctx"], n_threads=threads, n_threads_batch=threads, seed=0, verbose=False
    )


def probe(w: dict[str, Any], threads: int) -> float:
    llm = make_llama(w, threads)
    prompt = workload.probe_prompt(w)

    def once() -> None:
        llm.reset()
        decode_run(llm, prompt, workload.PROBE_NEW_TOKENS)

    return workload.probe_time(once)


def stored_types(w: dict[str, Any]) -> str:
    """The file's weight types as the orchestrator read them (``Q4_K x168, Q6_K x29``)."""
    types = w.get("gguf_weight_types") or {}
    return ", ".join(f"{k} x{n}" for k, n in types.items()) or "types not given"


def run_workload(args: argparse.Namespace) -> int:
    w = workload.read_workload(args.workload)
    if args.probe:
        workload.print_probe(probe(w, int(args.probe)))
        return 0
    # llama.cpp's best thread count differs by CPU (SMT siblings, memory bandwidth): try 1 .. the bench's threads
    candidates = sorted({1, max(1, w["threads"] // 2), w["threads"]})
    best, choice = workload.fastest(__file__, args.workload, [str(t) for t in candidates])
    threads = int(best)
    start = time.perf_counter()
    llm = make_llama(w, threads)
    load_s = time.perf_counter() - start
    workload.log(f"llama-cpp-python {llama_cpp.__version__}: loaded {Path(w['gguf']).name} in {load_s:.1f}s")
    ttft = []
    for case in w["ttft"]:
        workload.log(f"TTFT {case['tokens']} tokens: miss, RAM-cache hit, disk-cache hit")
        cases, cold = ttft_cases(llm, case)
        ttft.append({"tokens": case["tokens"], "cases": cases, "cold": cold})
    d = w["decode"]
    workload.log(f"decode {d['max_tokens']} tokens at context {len(d['prompt'])}")
    decode_run(llm, d["prompt"], d["max_tokens"])  # warm-up
    runs = [decode_run(llm, d["prompt"], d["max_tokens"]) for _ in range(w["reps"])]
    traces = workload.traces(w, functools.partial(trace_cases, llm))
    workload.write_result(
        args.result,
        engine="llama-cpp-python",
        version=llama_cpp.__version__,
        setup={
            "weights": Path(w["gguf"]).name,
            "compute": f"GGUF weights as stored ({stored_types(w)}), f16 KV cache",
            "n_ctx": w["n_ctx"],
            "n_threads": threads,
            "n_threads_batch": threads,
            "threads_choice": choice,
            "n_batch": llm.n_batch,
            "flash_attn": False,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
            "load_s": round(load_s, 3),
            "ttft_api": "create_completion(stream=True, max_tokens=1), first chunk",
            "decode_api": "Llama.generate, greedy",
        },
        ttft=ttft,
        decode=workload.decode_result(d, runs),
        traces=traces,
    )
    workload.log(f"wrote {args.result}")
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
    workload.add_arguments(sub.add_parser("workload", help="kvtier bench peer's workload, llama.cpp alone"))
    args = parser.parse_args(argv)
    return {"serve": serve, "bench": bench, "workload": run_workload}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
