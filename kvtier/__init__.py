"""kvtier: a tiered KV cache that lets an LLM engine prefill only what is new.

The data path, one module per step: ``keys`` (① name blocks) → ``index``
(② longest confirmed cached prefix) → ``manager`` + ``transfer`` (③ fetch,
⑤ store and evict) over ``tiers`` (host, disk) ranked by ``policy``.

The names below are loaded on first use, not on ``import kvtier``: a
connector inside vLLM or SGLang imports the few modules it uses (the keys,
the service link), not the tiers' Redis and LMDB bindings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier import openmp  # noqa: F401  (first: loads torch, whose OpenMP runtime reads its settings once)

if TYPE_CHECKING:
    from kvtier.config import Config, load_config
    from kvtier.index import LookupResult, MissReason
    from kvtier.keys import BlockKey, KeyHasher, Secret
    from kvtier.layout import KVLayout
    from kvtier.manager import CacheManager, LoadHandle, StorePlan
    from kvtier.tiers import TierKind

_HOME = {
    "BlockKey": "kvtier.keys",
    "CacheManager": "kvtier.manager",
    "Config": "kvtier.config",
    "KVLayout": "kvtier.layout",
    "KeyHasher": "kvtier.keys",
    "LoadHandle": "kvtier.manager",
    "LookupResult": "kvtier.index",
    "MissReason": "kvtier.index",
    "Secret": "kvtier.keys",
    "StorePlan": "kvtier.manager",
    "TierKind": "kvtier.tiers.base",
    "load_config": "kvtier.config",
}
__all__ = [
    "BlockKey",
    "CacheManager",
    "Config",
    "KVLayout",
    "KeyHasher",
    "LoadHandle",
    "LookupResult",
    "MissReason",
    "Secret",
    "StorePlan",
    "TierKind",
    "load_config",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
