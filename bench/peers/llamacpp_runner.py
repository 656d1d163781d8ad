"""llama-cpp-python on the workload of ``kvtier bench peer``: the same GGUF, the same token ids.

Run by the llama-cpp venv's python (never imports kvtier)::

    .venv-peer-llamacpp/bin/python bench/peers/llamacpp_runner.py WORKLOAD.json RESULT.json

How each number is taken (see ``common.py`` for the JSON contract):

* TTFT is ``create_completion(ids, max_tokens=1, stream=True)`` until its
  first chunk: llama-cpp-python yields that chunk before it saves the state
  to its cache, so the save is not counted. The stream is then drained, so
  the save does happen before the next request.
* ``llm.reset()`` before every request that must not reuse what the context
  already holds: llama-cpp-python otherwise reuses the longest prefix still
  in its own KV (which is what ``in_context`` measures on the traces).
  ``miss`` runs with no cache; ``ram_hit`` with ``LlamaRAMCache`` (the state
  saved after the prefix is loaded back); ``disk_hit`` with ``LlamaDiskCache``
  in a temporary directory whose page cache is dropped before each request.
* Decode is ``llm.generate`` (the token loop that ``create_completion`` runs),
  greedy, counted token by token; it never stops at EOS by itself, which is
  the ``ignore_eos`` the other engines get.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import common
import llama_cpp
from llama_cpp import Llama, LlamaDiskCache, LlamaRAMCache

RAM_CACHE_BYTES = 8 << 30  # well above what any case stores (a 7k-token state is ~170 MB)


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
    prompts = common.prompts(case)
    out: dict[str, list[float]] = {}
    llm.set_cache(None)
    out["miss"] = common.measure(lambda p: first_token_s(llm, p), prompts)
    llm.set_cache(LlamaRAMCache(capacity_bytes=RAM_CACHE_BYTES))
    first_token_s(llm, case["prefix"])
    out["ram_hit"] = common.measure(lambda p: first_token_s(llm, p), prompts)
    with tempfile.TemporaryDirectory(prefix="peer-llamacpp-disk-") as tmp:
        llm.set_cache(LlamaDiskCache(cache_dir=tmp, capacity_bytes=RAM_CACHE_BYTES))
        first_token_s(llm, case["prefix"])
        cold: list[bool] = []

        def from_disk(p: list[int]) -> float:
            cold.append(common.drop_page_cache(Path(tmp)))
            return first_token_s(llm, p)

        out["disk_hit"] = common.measure(from_disk, prompts)
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
    prompt = common.probe_prompt(w)

    def once() -> None:
        llm.reset()
        decode_run(llm, prompt, common.PROBE_NEW_TOKENS)

    return common.probe_time(once)


def stored_types(w: dict[str, Any]) -> str:
    """The file's weight types as the orchestrator read them (``Q4_K x168, Q6_K x29``)."""
    types = w.get("gguf_weight_types") or {}
    return ", ".join(f"{k} x{n}" for k, n in types.items()) or "types not given"


def main() -> int:
    args = common.parse_args(__doc__.splitlines()[0])
    w = common.read_workload(args.workload)
    if args.probe:
        common.print_probe(probe(w, int(args.probe)))
        return 0
    # llama.cpp's best thread count differs by CPU (SMT siblings, memory bandwidth): try 1 .. the bench's threads
    candidates = sorted({1, max(1, w["threads"] // 2), w["threads"]})
    best, choice = common.fastest(__file__, args.workload, [str(t) for t in candidates])
    threads = int(best)
    start = time.perf_counter()
    llm = make_llama(w, threads)
    load_s = time.perf_counter() - start
    common.log(f"llama-cpp-python {llama_cpp.__version__}: loaded {Path(w['gguf']).name} in {load_s:.1f}s")
    ttft = []
    for case in w["ttft"]:
        common.log(f"TTFT {case['tokens']} tokens: miss, RAM-cache hit, disk-cache hit")
        cases, cold = ttft_cases(llm, case)
        ttft.append({"tokens": case["tokens"], "cases": cases, "cold": cold})
    d = w["decode"]
    common.log(f"decode {d['max_tokens']} tokens at context {len(d['prompt'])}")
    decode_run(llm, d["prompt"], d["max_tokens"])  # warm-up
    runs = [decode_run(llm, d["prompt"], d["max_tokens"]) for _ in range(w["reps"])]
    traces = []
    for trace in w["traces"]:
        common.log(f"trace {trace['name']}: {len(trace['turns'])} turns x {w['trace_reps']}")
        traces.append({"name": trace["name"], "cases": trace_cases(llm, trace["turns"], w["trace_reps"])})
    common.write_result(
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
        decode=common.decode_result(d, runs),
        traces=traces,
    )
    common.log(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
