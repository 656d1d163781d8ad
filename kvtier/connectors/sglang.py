"""kvtier inside SGLang: a HiCache L3 storage backend over the node's cache service.

Load it with SGLang's dynamic backend::

    --enable-hierarchical-cache --page-size 64 --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage",
        "interface_v1": 1, "socket": "/path/to/cache.sock"}'

and run ``kvtier cache serve --model <the same model> --dtype <SGLang's KV
dtype> --block-size <SGLang's --page-size>`` beside it. ``interface_v1``
makes SGLang call the zero-copy forms (:meth:`KVTierStorage.batch_get_v1`,
:meth:`KVTierStorage.batch_set_v1`), which copy straight between its host
pool's pages and the service's shared slab, once each way; without it SGLang
goes through a flat staging page per key (:meth:`~KVTierStorage.batch_get`,
:meth:`~KVTierStorage.batch_set`), one more copy, done by SGLang. Other extra
config keys: ``model`` (the model's GGUF file or Hugging Face directory,
whose fingerprint the service was started with; default SGLang's model name
when that is a path), ``config`` (a kvtier YAML file), ``namespace``
(default kvtier's).

What is stored: one SGLang page (``page_size`` tokens, every layer of this
rank, K and V) is one kvtier *named block* in kvtier's layer-major order,
named by SGLang's own page key (a hash chained over the tokens; see
:mod:`kvtier.connectors.sglang_pages`). The block's layout comes from
SGLang's host pool itself and the fingerprint from the model's files; the
service's handshake refuses a client whose pages are not its blocks.

What is supported: MHA models with K and V heads of one size, host layouts
``layer_first``, ``page_first``, ``page_first_direct`` and ``page_head``, KV
in float32, bfloat16 or float16. Refused when the backend attaches, with the
reason: MLA (its latent cache is another format), hybrid models whose extra
pools (Mamba, SWA, DSA) go through the v2 calls, ``page_unified`` and
``page_first_kv_split``, fp8 KV. Under tensor (or pipeline, context)
parallelism each rank's page holds only its own heads (layers, tokens): the
rank goes into the namespace, and the service must be one for that per-rank
block (the layout a single rank's pool has).

A cache is never a reason for SGLang to fail: a service that is down, goes
away or refuses this client makes every call a miss (``False``, ``None``,
``0``), logged once and counted; the backend reconnects at most every
``kvtier.service.link.RECONNECT_S`` seconds. A block that fails its checksum on the way up from
disk ends the load there: SGLang gets fewer pages, never wrong bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.cache import NodeService, ServiceConnection, connect_service
from kvtier.config import load_config
from kvtier.connectors.sglang_pages import HostPages, Shard, host_pages, page_names, page_namespace, page_starts
from kvtier.identity import kv_identity_for

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settings:
    """What the extra config and SGLang's storage config say, read once when SGLang creates the backend."""

    socket: Path
    namespace: str
    model: Path
    data_dir: Path
    shard: Shard

    @classmethod
    def from_sglang(cls, storage_config: HiCacheStorageConfig) -> Settings:
        extra = dict(storage_config.extra_config or {})
        config = load_config(extra.get("config"))
        model = extra.get("model") or storage_config.model_name
        if not model or not Path(model).exists():
            raise ValueError(
                "kvtier keys SGLang's pages by the model's files: give the model's GGUF file or Hugging Face"
                f" directory as 'model' in --hicache-storage-backend-extra-config (SGLang's model name: {model!r})"
            )
        shard = Shard(
            storage_config.tp_rank,
            storage_config.tp_size,
            storage_config.pp_rank,
            storage_config.pp_size,
            storage_config.attn_cp_rank,
            storage_config.attn_cp_size,
        )
        return cls(
            socket=Path(extra.get("socket") or config.service_socket),
            namespace=page_namespace(str(extra.get("namespace") or config.cache.namespace), shard),
            model=Path(model),
            data_dir=config.data_dir,
            shard=shard,
        )


class KVTierStorage(HiCacheStorage):
    """SGLang's L3 storage: pages as named blocks in kvtier's cache service (see the module docstring).

    SGLang calls it from its prefetch and backup threads at once; the client
    serializes round trips, and a lock guards (re)connecting.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        if storage_config.is_mla_model:
            raise ValueError(
                "kvtier stores MHA KV pages; SGLang's MLA (rank-replicated latent) pages are not supported"
            )
        self.settings = Settings.from_sglang(storage_config)
        self.pages: HostPages | None = None
        self.fingerprint = ""
        self.counters = dict.fromkeys(("loaded_pages", "stored_pages", "service_failures"), 0)
        self._link: ServiceConnection | None = None  # once the host pool says what a block is

    # -- set-up ------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang's host pool: its geometry is the block layout; the model's files give the fingerprint."""
        super().register_mem_pool_host(mem_pool_host)
        pages = host_pages(mem_pool_host)  # ValueError (the attach fails, with the reason) for a pool kvtier can't hold
        g = pages.geometry
        _, self.fingerprint = kv_identity_for(self.settings.model, g.dtype, g.page_size, self.settings.data_dir)
        self.pages = pages
        self._link = connect_service(
            self.settings.socket, pages.layout, self.fingerprint, count_failures=self._count_failures,
            miss_message="every page is a miss until it answers",
        )  # fmt: skip
        log.info(
            "kvtier: SGLang %s pages as %s blocks, namespace %s, service %s",
            g.layout.value,
            pages.layout.descriptor,
            self.settings.namespace,
            self.settings.socket,
        )

    def on_host_pools_registered(self) -> None:
        others = [
            name for name, pool in getattr(self, "registered_pools", {}).items() if pool is not self.mem_pool_host
        ]
        if others:
            raise ValueError(f"kvtier stores SGLang's KV pages only; this model also has host pools {others}")

    def _count_failures(self, n: int) -> None:
        self.counters["service_failures"] += n

    def _service(self) -> NodeService | None:
        """The live client; None (a miss) before the host pool is registered or while the service is away."""
        return None if self._link is None else self._link.client()

    # -- lookups -----------------------------------------------------------------------------------
    def _exists(self, keys: Sequence[str]) -> list[bool]:
        client = self._service()
        return client.named_exists(page_names(keys), self.settings.namespace) if client else [False] * len(keys)

    def exists(self, key: str) -> bool:
        return self._exists([key])[0]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the service holds: SGLang prefetches only a leading run."""
        flags = self._exists(keys)
        return flags.index(False) if False in flags else len(flags)

    # -- loads: the service's slab -> SGLang's host pool -----------------------------------------------
    def _load(self, keys: Sequence[str], into: Any) -> int:
        """Copy the leading held pages into ``into(i)`` (a block-ordered view); how many were copied."""
        client = self._service()
        if client is None or not keys:
            return 0
        layout = self.pages.layout
        with client.named_load(page_names(keys), self.settings.namespace) as got:
            for i, block in enumerate(got.blocks):
                into(i).copy_(layout.as_blocks(block))
            loaded = len(got.blocks)
        self.counters["loaded_pages"] += loaded
        return loaded

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Each page straight from the shared slab into its host pool slots: the one copy of a load."""
        starts = self._starts(keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        loaded = self._load(keys, lambda i: self.pages.page(starts[i]))
        return [i < loaded for i in range(len(keys))]

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """SGLang's staging form: each page into a flat page (``target_locations[i]``, made here when absent)."""
        if self.pages is None:
            return [None] * len(keys)
        g = self.pages.geometry
        numel = torch.Size(g.page_shape).numel()
        targets = list(target_locations) if target_locations else [torch.empty(numel, dtype=g.dtype) for _ in keys]
        loaded = self._load(keys, lambda i: g.flat_page(targets[i]))
        return [t if i < loaded else None for i, t in enumerate(targets)]

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    # -- stores: SGLang's host pool -> the service's slab ------------------------------------------------
    def _store(self, keys: Sequence[str], page_of: Any) -> list[bool]:
        """Store each page ``page_of(i)`` (block-ordered) the service lacks; per key, whether it now holds it."""
        client = self._service()
        if client is None or not keys:
            return [False] * len(keys)
        layout = self.pages.layout
        names = page_names(keys)
        stored = client.named_store_from(
            names, lambda i, out: layout.as_blocks(out).copy_(page_of(i)), self.settings.namespace
        )
        self.counters["stored_pages"] += stored
        if stored == len(keys):
            return [True] * len(keys)
        return client.named_exists(names, self.settings.namespace)  # some were held already, or the service left

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Each page straight from its host pool slots into a reserved slot of the shared slab, then committed."""
        starts = self._starts(keys, host_indices)
        if starts is None:
            return [False] * len(keys)
        return self._store(keys, lambda i: self.pages.page(starts[i]))

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """SGLang's staging form: ``values[i]`` is a flat page (``get_data_page``); True when all are held."""
        if self.pages is None or values is None:
            return False
        g = self.pages.geometry
        flats = [v.reshape(-1) for v in values]
        return all(self._store(keys, lambda i: g.flat_page(flats[i])))

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def _starts(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[int] | None:
        if self.pages is None:
            return None
        starts = page_starts(host_indices, len(keys), self.pages.geometry.page_size)
        if starts is None:
            log.warning("kvtier: %d host slots for %d pages; the batch is a miss", host_indices.numel(), len(keys))
        return starts

    # -- the rest --------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Left undone on purpose: the service's blocks are shared with every engine on the node.

        A stale page is harmless (its name binds its tokens, the model and
        the layout), and the service evicts what it has no room for.
        """
        log.warning("kvtier: SGLang asked to clear its L3 storage; kvtier's cache service is shared, nothing cleared")

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
