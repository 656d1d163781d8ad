"""kvtier inside vLLM: a V1 KV connector over the node's cache service.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/path/to/cache.sock"}}'

and run ``kvtier cache serve --model <the same HF directory> --dtype <vLLM's dtype>
--block-size <vLLM's block size> --kv-order head_major`` beside it. Extra
config keys: ``socket`` (default: kvtier's configured service socket),
``config`` (a kvtier YAML file), ``namespace`` (default: kvtier's).

How it divides the work (vLLM runs the connector twice: in the scheduler and
in each worker):

- **Scheduler.** Asks the service how many leading blocks of the prompt it
  holds, keyed by kvtier's own chain over vLLM's token ids (stable across
  processes and restarts; vLLM's per-process block hashes never leave vLLM),
  in the namespace of the request's ``cache_salt``. It claims whole vLLM
  blocks, never the last prompt token. Each step it tells the workers which
  blocks to load and which newly computed full prompt blocks to save.
- **Worker.** Loads before the forward pass: one round trip pins the blocks
  in the service's shared slab, and each is copied once, straight from that
  mapping into vLLM's paged pool. Saves start after the forward pass, on a
  saver thread, while the next steps run: reserve slots, copy the pool's rows
  into them, commit with their checksums. A running request's computed
  blocks never change, so only its end and a preemption need care: a request
  that has saves keeps its blocks past its end (``request_finished`` says
  so) until the worker reports its saves done (``get_finished``), and a
  preempted request's saves finish before vLLM reuses its blocks
  (``handle_preemptions``).

A block that fails to load (evicted since the lookup, corrupt on disk, the
service gone) is reported through :meth:`get_block_ids_with_load_errors` and
vLLM recomputes it; the connector sets vLLM's ``kv_load_failure_policy`` to
``recompute``, since for a cache a failed load is a miss, never a failed
request. Once recomputed, the block and those after it are saved again, so
the next request hits the whole prefix; what the failing step computed over
the rows that never loaded is never saved (:mod:`kvtier.connectors.vllm_plan`).
A service that is down is a miss for every request; the connector
reconnects at most every ``kvtier.service.link.RECONNECT_S`` seconds.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.model_executor.models.utils import extract_layer_index

from kvtier.cache import NodeService, connect_service
from kvtier.config import load_config
from kvtier.connectors.paged import BlockMap, PagedKV
from kvtier.connectors.vllm_plan import FailedLoads, RequestPlan, Transfer
from kvtier.identity import kv_identity_for
from kvtier.layout import LayoutOrder

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

SHUTDOWN_SAVE_S = 30.0  # how long a closing worker lets its pending saves finish


# -- what the scheduler tells the workers each step -------------------------------------------------
@dataclass
class KVTierConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # their blocks are freed: their saves must finish first


class KVTierConnectorStats(KVConnectorStats):
    """Counters since the last report: loads and saves in blocks and tokens, failures counted, never raised."""

    FIELDS = ("loaded_blocks", "loaded_tokens", "load_failed_blocks", "saved_blocks", "service_failures")

    def reset(self) -> None:
        self.data = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts: int) -> None:
        for k, v in counts.items():
            self.data[k] = self.data.get(k, 0) + v

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        self.add(**other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


VLLM_KV_DTYPES: dict[str | None, torch.dtype | None] = {
    None: None,
    "auto": None,  # the model's dtype
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""vLLM's ``kv_cache_dtype`` settings kvtier carries, and the element type its blocks then hold."""


def kv_cache_dtype(cache: Any) -> torch.dtype | None:
    """The KV element type of vLLM's pages (None: the model's dtype), refusing what kvtier cannot keep exact.

    An 8-bit cache is kept as its bytes, with vLLM's per-tensor scales left
    where they are: that is exact only while every process holds the same
    scales, which the default (``calculate_kv_scales`` off: scales from the
    checkpoint, else 1.0) guarantees and scales measured on the first batch
    do not (a block's bytes would depend on which request came first).
    """
    name = cache.cache_dtype
    if name not in VLLM_KV_DTYPES:
        raise ValueError(f"kvtier carries kv_cache_dtype auto, fp8, fp8_e4m3 and fp8_e5m2, not {name!r}")
    dtype = VLLM_KV_DTYPES[name]
    if dtype is not None and getattr(cache, "calculate_kv_scales", False):
        raise ValueError(
            "kvtier with an fp8 kv_cache_dtype needs fixed scales: calculate_kv_scales measures them on the first "
            "batch, so two processes would write the same tokens as different bytes"
        )
    return dtype


class KVTierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        config = load_config(extra.get("config"))
        self._socket = extra.get("socket") or str(config.service_socket)
        self._namespace = str(extra.get("namespace") or config.cache.namespace)
        engine_block = vllm_config.cache_config.block_size
        kv_block = int(extra.get("block_size") or engine_block)
        self._map = BlockMap(kv_block, engine_block)
        model = vllm_config.model_config
        self._layout, self._fingerprint = kv_identity_for(
            model.model,
            model.dtype,
            kv_block,
            config.data_dir,
            order=LayoutOrder.HEAD_MAJOR,
            kv_dtype=kv_cache_dtype(vllm_config.cache_config),
        )
        self._lock = threading.Lock()  # the counters: the saver thread uses them too
        self._link = connect_service(
            self._socket, self._layout, self._fingerprint, count_failures=lambda n: self._count(service_failures=n)
        )
        self._stats = KVTierConnectorStats()
        self._stats.reset()
        # scheduler side
        self._requests: dict[str, RequestPlan] = {}
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.info("kvtier: kv_load_failure_policy set to 'recompute': a block that fails to load is a miss")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        # worker side
        self._kv: PagedKV | None = None
        self._load_errors: set[int] = set()
        self._failed_loads = FailedLoads()  # their saves hold KV computed over rows that never loaded
        self._saver: ThreadPoolExecutor | None = None
        self._saves: dict[str, list[Future[int]]] = {}  # request -> its saves not yet reported done
        self._ended: set[str] = set()  # requests vLLM finished whose blocks wait on our saves

    # -- the service ---------------------------------------------------------------------------
    def _service(self) -> NodeService | None:
        """The live client; None (a miss) while the service is away (the link connects again by itself)."""
        return self._link.client()

    def _count(self, **counts: int) -> None:
        with self._lock:
            self._stats.add(**counts)

    def _namespace_of(self, request: Request) -> str:
        salt = getattr(request, "cache_salt", None)
        return f"{self._namespace}:salt:{salt}" if salt else self._namespace

    # -- scheduler side --------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self._track(request)

    def _track(self, request: Request) -> RequestPlan:
        r = self._requests.get(request.request_id)
        if r is None:
            r = RequestPlan(list(request.prompt_token_ids or ()), self._namespace_of(request))
            self._requests[request.request_id] = r
        return r

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        r = self._track(request)
        if not r.tokens or getattr(request, "mm_features", None):
            return 0, False  # keys over token ids say nothing of an image's embedding
        if r.cached_blocks is None:
            client = self._service()
            r.cached_blocks = client.lookup(r.tokens, r.namespace).cached_blocks if client else 0
        return max(0, self._map.loadable(r.cached_blocks, len(r.tokens)) - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._track(request).load_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        meta = KVTierConnectorMetadata(preempted=set(so.preempted_req_ids or ()))
        for new in so.scheduled_new_reqs:
            r = self._requests.get(new.req_id)
            if r is None:
                continue
            r.block_table = list(new.block_ids[0])
            self._plan(meta, new.req_id, r, new.num_computed_tokens, so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._requests.get(req_id)
            if r is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_table = list(new_ids[0]) if new_ids else r.block_table  # a resumed request's whole table
            elif new_ids:
                r.block_table.extend(new_ids[0])
            computed = cached.num_computed_tokens[i]
            self._plan(meta, req_id, r, computed, so.num_scheduled_tokens.get(req_id, 0))
        return meta

    def _plan(self, meta: KVTierConnectorMetadata, req_id: str, r: RequestPlan, computed: int, scheduled: int) -> None:
        load, save = r.step(req_id, self._map, computed, scheduled)
        if load is not None:
            meta.loads.append(load)
        if save is not None:
            meta.saves.append(save)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks of a request with saves until the workers report them done (``get_finished``)."""
        r = self._requests.pop(request.request_id, None)
        return (r is not None and r.saving), None

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        try:
            self._kv = PagedKV([t for _, t in ordered], self._layout, self._map.engine_block)
        except ValueError as err:
            log.warning("kvtier: vLLM's KV pool does not match %s (%s); the connector is off", self._layout, err)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        for t in meta.loads:
            self._load(t)

    def _load(self, t: Transfer) -> None:
        by_block = t.by_block()
        loaded = 0
        client = self._service() if self._kv is not None else None
        if client is not None:
            with client.load(t.tokens, t.namespace, start=t.first_block, max_blocks=t.num_blocks) as got:
                for i, payload in enumerate(got.blocks):
                    self._kv.write(payload, by_block[t.first_block + i], t.block_table)
                loaded = len(got.blocks)
        failed = {t.block_table[s.engine_block] for s in t.segments if s.kv_block >= t.first_block + loaded}
        self._load_errors |= failed
        if failed:
            self._failed_loads.failed(t.req_id, t.first_block + loaded)
        self._count(
            loaded_blocks=loaded,
            loaded_tokens=sum(s.tokens for s in t.segments if s.kv_block < t.first_block + loaded),
            load_failed_blocks=t.num_blocks - loaded,
        )
        if failed:
            log.info(
                "kvtier: %d of %d blocks of %s did not load; vLLM recomputes them",
                t.num_blocks - loaded,
                t.num_blocks,
                t.req_id,
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the first layer runs

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # a block is saved whole, all layers at once, in wait_for_save

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVTierConnectorMetadata)
        for req_id in kv_connector_metadata.preempted:
            wait(self._saves.get(req_id, ()))

    def wait_for_save(self) -> None:
        """Hand this step's saves to the saver thread; the forward pass that computed them is over."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierConnectorMetadata)
        for t in meta.saves:
            self._saves.setdefault(t.req_id, [])  # reported done even when not run, so vLLM frees the blocks
        saves = self._failed_loads.admitted(meta.saves)
        if not saves or self._kv is None:
            return
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvtier-save")
        for t in saves:
            self._saves[t.req_id].append(self._saver.submit(self._save, t))

    def _save(self, t: Transfer) -> int:
        kv, client = self._kv, self._service()
        if kv is None or client is None:
            return 0
        by_block = t.by_block()
        stored = client.store_from(
            t.tokens,
            lambda i, out: kv.read(out, by_block[i], t.block_table),
            t.namespace,
            first_block=t.first_block,
            num_blocks=t.num_blocks,
        )
        self._count(saved_blocks=stored)
        return stored

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests vLLM has finished whose saves are all done: their blocks may be freed now."""
        self._failed_loads.forget(finished_req_ids)
        self._ended |= {r for r in finished_req_ids if r in self._saves}
        done = {r for r in self._ended if all(f.done() for f in self._saves[r])}
        for r in done:
            self._ended.discard(r)
            for f in self._saves.pop(r):
                if f.exception() is not None:
                    log.warning("kvtier: a save of %s failed: %s", r, f.exception())
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            out = KVTierConnectorStats(data=dict(self._stats.data))
            self._stats.reset()
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._saver is not None:
            wait([f for fs in self._saves.values() for f in fs], timeout=SHUTDOWN_SAVE_S)
            self._saver.shutdown(wait=False, cancel_futures=True)
        self._link.close()
