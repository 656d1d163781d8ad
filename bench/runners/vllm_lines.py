"""What the vLLM runners share (``vllm_runner.py``, ``lmcache_runner.py``): the line protocol and one timed request.

Runs in an engine's venv, beside the runner that imports it (never kvtier).
Each command is one JSON line on stdin; each answer one ``KVTIER {json}``
line on stdout, so vLLM's own logging (stderr) never gets in the way.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any


def reply(obj: dict[str, Any]) -> None:
    print("KVTIER " + json.dumps(obj), flush=True)


def timed(llm: Any, prompt: list[int], params: Any) -> tuple[float, float, list[int], int]:
    """One request through ``LLMEngine``: (TTFT, total seconds, its token ids, prompt tokens vLLM did not compute).

    TTFT runs from ``add_request`` to the step that returns the first token.
    """
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(f"r{time.monotonic_ns()}", TokensPrompt(prompt_token_ids=prompt), params)
    first = None
    token_ids: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.perf_counter() - start
            if o.finished:
                token_ids, cached = list(o.outputs[0].token_ids), o.num_cached_tokens or 0
    total = time.perf_counter() - start
    return (first if first is not None else total), total, token_ids, cached


def generate(llm: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One greedy request: its tokens, the prompt tokens vLLM did not compute, its TTFT and total time."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft_s, total_s, tokens, cached = timed(llm, prompt, params)
    return {"tokens": tokens, "cached_tokens": cached, "ttft_s": ttft_s, "total_s": total_s}


def serve(llm: Any, on_error: Callable[[BaseException], dict[str, Any]] | None = None) -> int:
    """Answer commands until ``quit`` or end of input: ``generate``, ``reset_prefix_cache``.

    ``on_error``: a failed request becomes that reply and the runner exits 3
    (a crash mid-request is data too); without it, the exception propagates.
    """
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "generate":
            try:
                reply(generate(llm, cmd["prompt"], int(cmd.get("max_tokens", 8))))
            except Exception as exc:
                if on_error is None:
                    raise
                reply({"ok": False, **on_error(exc)})
                return 3
        elif op == "reset_prefix_cache":
            llm.reset_prefix_cache()
            reply({})
        elif op == "quit":
            break
        else:
            reply({"error": f"unknown op {op!r}"})
    return 0
