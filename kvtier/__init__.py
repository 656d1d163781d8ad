"""kvtier: a tiered KV cache that lets an LLM engine prefill only what is new.

The data path, one module per step: ``keys`` (① name blocks) → ``index``
(② longest confirmed cached prefix) → ``manager`` + ``transfer`` (③ fetch,
⑤ store and evict) over ``tiers`` (host, disk) ranked by ``policy``.
"""

from kvtier import openmp  # noqa: F401  (first: loads torch, whose OpenMP runtime reads its settings once)

# isort: split
from kvtier.config import Config, load_config
from kvtier.index import LookupResult, MissReason
from kvtier.keys import BlockKey, KeyHasher, Secret
from kvtier.layout import KVLayout
from kvtier.manager import CacheManager, LoadHandle, StorePlan
from kvtier.tiers import TierKind

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
