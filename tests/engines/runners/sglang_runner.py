"""SGLang's HiCache storage path with kvtier as its L3 backend, driven one command per line: the in-engine tests.

Run by the SGLang venv's python::

    .venv-peer-sglang/bin/python tests/engines/runners/sglang_runner.py --model DIR --socket SOCK
        --layout page_first --layers 3 --heads 2 --head-dim 8 --page-size 4 [--path v1|generic] [--config YAML]

What is SGLang's own code here: the host pool (``MHATokenToKVPoolHost`` on
the CPU, its ``kv_buffer``, ``alloc``, ``get_data_page``,
``set_from_flat_data_page``), the page keys (``get_storage_hash_str``), the
backend factory that loads ``dynamic`` backends by module path and class
name, and the ``HiCacheController`` methods that move pages between the pool
and L3 (``_page_backup``, ``_storage_hit_query``, ``_page_transfer`` and the
page get/set functions they pick), run on a controller made without its
``__init__`` (which wants a GPU allocator and streams) and given only the
attributes those methods read. What is not: a model forward, the scheduler,
the radix tree; full SGLang needs its CUDA kernels and torch 2.14.1.

torchvision: PyPI ships only CUDA builds of it, which fail to import beside
the CPU torch; SGLang's host pool module imports its multimodal configs,
which import ``torchvision.transforms`` at module level and use none of it
here. When torchvision is absent a permissive stand-in is installed for the
import alone (said in the ready line).

Each stdin line is one JSON command, answered by one stdout line ``KVTIER {json}``:

- at start: ``{"ready": true, "sglang": version, "backend": class, "is_hicache_storage": bool,
  "abstract_left": [...], "torchvision": version or "stand-in"}``;
- ``{"op": "set", "tokens": [ids], "seed": n}``: fill one page per whole page of
  ``tokens`` with random values, back them up through SGLang's ``_page_backup``:
  ``{"keys": [page keys], "stored_pages": n, "digests": [sha256 of each page in block order]}``;
- ``{"op": "get", "tokens": [ids]}``: SGLang's hit query, then its prefetch
  transfer into pages filled with a sentinel first: ``{"hit_pages", "loaded_pages",
  "digests": [of the loaded pages], "untouched": [each page past them still all sentinel]}``;
- ``{"op": "exists", "keys": [...]}``: ``{"leading": batch_exists, "each": [exists per key]}``;
- ``{"op": "stats"}``: the backend's counters;
- ``{"op": "quit"}``.

An exception in a command is answered ``{"error": "..."}``, never raised: the
tests assert that the backend raised nothing into SGLang.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import queue
import sys
import traceback
import types
from typing import Any

import torch

PREFIX = "KVTIER "
SENTINEL = -7.0


def reply(obj: dict[str, Any]) -> None:
    print(PREFIX + json.dumps(obj), flush=True)


# -- torchvision, for the import alone -------------------------------------------------------------
class _Anything:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Anything:
        return _Anything()

    def __getattr__(self, name: str) -> _Anything:
        return _Anything()


class _InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"
    NEAREST_EXACT = "nearest-exact"


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _InterpolationMode if name == "InterpolationMode" else _Anything


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"  # transformers parses it: older than any real torchvision
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def torchvision_for_import() -> str:
    if importlib.util.find_spec("torchvision") is not None:
        import torchvision

        return torchvision.__version__
    sys.meta_path.insert(0, _StandInFinder())
    return "stand-in"


# -- SGLang's host pool and controller -----------------------------------------------------------------
def make_pool(args: argparse.Namespace) -> Any:
    """A real ``MHATokenToKVPoolHost`` on the CPU, over small CPU "device" buffers it only reads geometry from."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    device_tokens = 16 * args.page_size
    k = tuple(torch.zeros(device_tokens, args.heads, args.head_dim) for _ in range(args.layers))
    v = tuple(torch.zeros(device_tokens, args.heads, args.head_dim) for _ in range(args.layers))

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
        page_size=args.page_size,
        head_num=args.heads,
        head_dim=args.head_dim,
        v_head_dim=args.head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        args.page_size,
        args.layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=args.layers,
    )


def make_backend(args: argparse.Namespace, pool: Any) -> Any:
    """What ``HiCacheController.attach_storage_backend`` does for ``--hicache-storage-backend dynamic``."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.connectors.sglang",
        "class_name": "KVTierStorage",
        "interface_v1": 1 if args.path == "v1" else 0,
        "socket": args.socket,
    }
    if args.config:
        extra["config"] = args.config
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=args.layout == "page_first",
        model_name=args.model,  # SGLang's served model name, its model path by default
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def make_controller(backend: Any, pool: Any, args: argparse.Namespace) -> Any:
    """SGLang's ``HiCacheController`` with the attributes its L3 page methods read, and the page functions it picks."""
    from sglang.srt.managers.cache_controller import HiCacheController

    ctl = HiCacheController.__new__(HiCacheController)
    ctl.storage_backend = backend
    ctl.storage_host_pool = ctl.mem_pool_host = pool
    ctl.page_size = args.page_size
    ctl.prefetch_sync_queue = queue.Queue()
    if args.path == "v1":  # attach_storage_backend's choice for a dynamic backend with interface_v1
        ctl.page_get_func, ctl.page_set_func = ctl._page_get_zero_copy, ctl._page_set_zero_copy
    else:
        ctl.page_get_func, ctl.page_set_func = ctl._generic_page_get, ctl._generic_page_set
    return ctl


# SGLang's get_data_page(flat=False) of one page, as [layers, K|V, heads, tokens, head_dim]; the dims per
# layout are those its init_kv_buffer allocates (page-cut layouts keep a page axis of one).
TO_BLOCK_ORDER = {
    "layer_first": lambda p: p.permute(1, 0, 3, 2, 4),  # (2, L, P, H, D)
    "page_first": lambda p: p.permute(2, 0, 3, 1, 4),  # (2, P, L, H, D)
    "page_first_direct": lambda p: p[:, 0].permute(1, 0, 3, 2, 4),  # (2, 1, L, P, H, D)
    "page_head": lambda p: p[:, 0].permute(3, 0, 1, 2, 4),  # (2, 1, H, P, L, D)
}


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pool = make_pool(args)
        self.backend = make_backend(args, self.pool)
        self.ctl = make_controller(self.backend, self.pool, args)

    def page_digest(self, index: int) -> str:
        page = TO_BLOCK_ORDER[self.args.layout](self.pool.get_data_page(index, flat=False))
        return hashlib.sha256(page.contiguous().numpy().tobytes()).hexdigest()

    def fill(self, index: int, values: torch.Tensor) -> None:
        self.pool.set_from_flat_data_page(index, values)

    def page_numel(self) -> int:
        return self.pool.get_dummy_flat_data_page().numel()

    def set(self, tokens: list[int], seed: int) -> dict[str, Any]:
        from sglang.srt.managers.cache_controller import StorageOperation
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        size = self.args.page_size
        keys = get_storage_hash_str(tokens[: len(tokens) // size * size], None, page_size=size)
        host = self.pool.alloc(len(keys) * size)
        try:
            for i in range(len(keys)):
                g = torch.Generator().manual_seed(seed * 1000 + i)
                self.fill(int(host[i * size]), torch.randn(self.page_numel(), generator=g))
            op = StorageOperation(host, tokens, hash_value=keys)
            self.ctl._page_backup(op)
            digests = [self.page_digest(int(host[i * size])) for i in range(len(keys))]
        finally:
            self.pool.free(host)
        return {"keys": keys, "stored_pages": op.completed_tokens // size, "digests": digests}

    def get(self, tokens: list[int]) -> dict[str, Any]:
        from sglang.srt.managers.cache_controller import PrefetchOperation

        size = self.args.page_size
        op = PrefetchOperation("runner", tokens)
        hashes, _ = self.ctl._storage_hit_query(op)
        op.hash_value = hashes
        if not hashes:
            return {"hit_pages": 0, "loaded_pages": 0, "digests": [], "untouched": []}
        host = self.pool.alloc(len(hashes) * size)
        try:
            starts = [int(host[i * size]) for i in range(len(hashes))]
            for s in starts:
                self.fill(s, torch.full((self.page_numel(),), SENTINEL))
            op.host_indices = host
            loaded = self.ctl._page_transfer(op)
            pages = [self.pool.get_data_page(s, flat=True) for s in starts]
            return {
                "hit_pages": len(hashes),
                "loaded_pages": loaded,
                "digests": [self.page_digest(s) for s in starts[:loaded]],
                "untouched": [bool((p == SENTINEL).all()) for p in pages[loaded:]],
            }
        finally:
            self.pool.free(host)

    def exists(self, keys: list[str]) -> dict[str, Any]:
        return {"leading": self.backend.batch_exists(keys), "each": [self.backend.exists(k) for k in keys]}

    def answer(self, cmd: dict[str, Any]) -> dict[str, Any]:
        match cmd["op"]:
            case "set":
                return self.set(cmd["tokens"], cmd.get("seed", 0))
            case "get":
                return self.get(cmd["tokens"])
            case "exists":
                return self.exists(cmd["keys"])
            case "stats":
                return dict(self.backend.counters)
        return {"error": f"unknown op {cmd['op']!r}"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--config", default=None, help="kvtier YAML (its data_dir keeps the model fingerprint)")
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--path", choices=["v1", "generic"], default="v1")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--page-size", type=int, required=True)
    args = ap.parse_args()
    try:
        tv = torchvision_for_import()
        import sglang
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

        from kvtier.connectors.sglang import KVTierStorage

        runner = Runner(args)
    except Exception as err:  # a failed start is reported as data, for the test to show
        reply({"ready": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})
        return 1
    reply(
        {
            "ready": True,
            "sglang": sglang.__version__,
            "torch": torch.__version__,
            "torchvision": tv,
            "backend": type(runner.backend).__name__,
            "is_hicache_storage": isinstance(runner.backend, HiCacheStorage),
            "abstract_left": sorted(getattr(KVTierStorage, "__abstractmethods__", ())),
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply(runner.answer(cmd))
        except Exception as err:  # the tests assert none: the backend never raises into SGLang
            reply({"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
