"""The built-in engine: continuous batching over a paged pool, prefilling only what is new.

One :meth:`Engine.step` admits waiting requests (each: block keys → the
resident pool blocks → kvtier lookup and load of the rest → allocate the
remainder), then runs ONE forward over every admitted request's uncached
tail and every running request's next token, samples, and retires finished
requests. A request's new full blocks are offered to kvtier right after its
prefill (prompt blocks) and when it ends (blocks made of generated tokens),
because an agent's next turn resends prompt + reply. Keys depend on token ids
only, so a block gets the same key whether its tokens came from a prompt or
from generation.

Admission reserves pool blocks for the prompt plus ``max_tokens`` up front,
so a running request never runs out of pages mid-decode (no preemption);
resident blocks of finished requests are released, least recent first, to
make that room.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvtier.breakeven import FetchPlan
from kvtier.engine.llama import LlamaModel, SeqInput
from kvtier.engine.onboard import LayerwiseLoad
from kvtier.engine.pool import BlockTable, KVPool, blocks_for
from kvtier.engine.resident import ResidentBlocks
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.fetch import Fetch, LoadHandle
from kvtier.keys import BlockKey, KeyHasher, block_tokens
from kvtier.manager import CacheManager
from kvtier.model.tokenizer import StreamDecoder, Tokenizer
from kvtier.tiers.base import TierKind
from kvtier.transfer import JobId, JobStatus

log = logging.getLogger(__name__)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ERROR = "error"


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str
    sampler: Sampler
    decoder: StreamDecoder
    arrival: float
    table: BlockTable = field(default_factory=BlockTable)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    served_from: dict[TierKind, int] = field(default_factory=dict)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    stored_blocks: int = 0  # leading blocks known to be in kvtier already
    fetch: Fetch | None = None  # started on arrival, taken on admission
    fetch_plan: FetchPlan | None = None  # what the break-even model decided on arrival

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


@dataclass
class PrefetchCounters:
    """What the arrival-time fetches did, since the engine started (the server reports them in /stats)."""

    started: int = 0  # fetches started on arrival
    blocks_planned: int = 0  # blocks the break-even model chose to fetch
    blocks_used: int = 0  # blocks that landed in time and were copied into the pool
    deadline_missed: int = 0  # fetches cut short by their deadline (the rest was recomputed)
    recompute_chosen: int = 0  # requests whose cached blocks were cheaper to recompute than to fetch
    cancelled: int = 0  # fetches dropped because the pool already held the prefix


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    token_ids: list[int]  # new this step
    text: str  # new this step (stop strings already cut)
    finished: bool
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    served_from: dict[TierKind, int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft_s: float
    total_s: float


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        *,
        pool_blocks: int,
        block_size: int,
        cache: CacheManager | None = None,
        hasher: KeyHasher | None = None,
        keep_resident: bool = True,
        max_batch: int = 16,
        namespace: str = "default",
        prefetch: bool = True,
        layerwise: bool = True,
    ) -> None:
        want = model.kv_layout(block_size)
        if cache is not None and cache.layout != want:
            raise ValueError(f"cache layout {cache.layout.descriptor} != the model's {want.descriptor}")
        if hasher is None and cache is not None:
            hasher = cache.hasher
        if keep_resident and hasher is None:
            raise ValueError("keeping blocks resident needs block keys: pass a cache or a hasher")
        self.model = model
        self.tokenizer = tokenizer
        self.pool: KVPool = model.make_pool(block_size, pool_blocks)
        self.cache = cache
        self.hasher = hasher
        self.resident = ResidentBlocks(self.pool) if keep_resident else None
        self.max_batch = max_batch
        self.namespace = namespace
        self.block_size = block_size
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._ids = itertools.count()
        self._finished: list[Request] = []
        self.prefill_tokens_computed = 0
        self.prefill_tokens_skipped = 0
        self.prefetch = prefetch and cache is not None
        self.prefetch_counters = PrefetchCounters()
        # One thread copies fetched KV into the pool, layer by layer, while the forward computes.
        self._onboard = ThreadPoolExecutor(1, thread_name_prefix="kvtier-onboard") if layerwise else None
        self._loads: list[tuple[LoadHandle, list[int]]] = []  # fetched this step, copied during its forward
        self._storing: list[tuple[JobId, list[int]]] = []  # stores reading pool blocks, which they hold a ref on

    # -- requests --------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        namespace: str | None = None,
        request_id: str | None = None,
    ) -> str:
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        limit = self.model.config.context_length
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit the context of {limit}")
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(
            rid,
            list(prompt_ids),
            params,
            namespace or self.namespace,
            Sampler(params),
            self.tokenizer.decode_stream(),
            time.perf_counter(),
        )
        self._start_fetch(req)
        self._waiting.append(req)
        return rid

    def _start_fetch(self, req: Request) -> None:
        """On arrival: look the prompt up and start moving the blocks worth fetching up to host memory.

        The break-even model sizes the fetch and sets its deadline, so the
        disk reads run while the request still waits for a batch slot, and
        admission takes whatever landed in time.
        """
        if not self.prefetch or self.cache is None or self.hasher is None:
            return
        usable = (len(req.prompt_ids) - 1) // self.block_size
        if usable <= 0:
            return
        first = 0
        if self.resident is not None:
            keys = self.hasher.keys(req.prompt_ids, req.namespace)[:usable]
            first = self.resident.peek(keys, block_tokens(req.prompt_ids, self.block_size))
        if first >= usable:
            return
        result = self.cache.lookup(req.prompt_ids, req.namespace, first_block=first)
        end = min(result.cached_blocks, usable)
        if end <= first or end - first > self.cache.load_chunk:
            return  # nothing below, or more than host can pin at once: admission loads it in pieces
        plan = self.cache.costs.plan(result.tiers[: end - first], first, len(req.prompt_ids))
        req.fetch_plan = plan
        counters = self.prefetch_counters
        if not plan.blocks:
            counters.recompute_chosen += 1
            return
        req.fetch = self.cache.fetch(result, start=first, max_blocks=plan.blocks, deadline_s=plan.deadline_s)
        counters.started += 1
        counters.blocks_planned += plan.blocks

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # -- one scheduler step ------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._reap_stores()
        admitted = self._admit()
        batch = admitted + self._running
        if not batch:
            return []
        seqs = [self._seq_input(r) for r in batch]
        loads, self._loads = self._loads, []
        onboarding = LayerwiseLoad(self.pool, loads, self._onboard) if loads else None
        started = time.perf_counter()
        try:
            logits = self.model(seqs, self.pool, layer_ready=onboarding.wait if onboarding else None)
        finally:
            if onboarding is not None:
                onboarding.finish()
        now = time.perf_counter()
        if self.cache is not None:
            self.cache.costs.observe_forward([(s.start, len(s.token_ids)) for s in seqs], now - started)
            if onboarding is not None:
                self.cache.costs.observe_fetch(TierKind.HOST, onboarding.nbytes, onboarding.seconds)
        outputs = []
        fresh = {id(r) for r in admitted}
        for req, row in zip(batch, logits, strict=True):
            if id(req) in fresh:
                req.first_token_at = now
                self._store_new_blocks(req)
            outputs.append(self._advance(req, req.sampler(row)))
        self._running = [r for r in batch if r.finish_reason is None]
        for req in batch:
            if req.finish_reason is not None:
                self._retire(req)
        return outputs

    def _seq_input(self, req: Request) -> SeqInput:
        start = req.table.num_tokens
        return SeqInput(req.all_ids[start:], start, req.table)

    # -- admission: resident pool blocks, then kvtier, then fresh blocks ----------
    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        while self._waiting and len(self._running) + len(admitted) < self.max_batch:
            req = self._waiting[0]
            total = min(len(req.prompt_ids) + req.params.max_tokens, self.model.config.context_length)
            need = blocks_for(total, self.block_size)
            if need > self.pool.num_blocks:
                self._waiting.popleft()
                self._fail(req, f"request needs {need} KV blocks; the pool has {self.pool.num_blocks}")
                continue
            usable = (len(req.prompt_ids) - 1) // self.block_size  # at least one prompt token is computed
            keys = self.hasher.keys(req.prompt_ids, req.namespace)[:usable] if self.hasher is not None else []
            self._attach_resident(req, keys)  # first, so making room cannot release this request's own prefix
            if not self._make_room(need - len(req.table.block_ids)):
                self.pool.release(req.table)
                req.served_from.clear()
                break  # wait for running requests (or stores still reading the pool) to finish
            self._waiting.popleft()
            if self.cache is not None and len(req.table.block_ids) < usable:
                self._load_from_cache(req, usable, len(req.table.block_ids))
            elif req.fetch is not None:
                req.fetch.cancel()  # the pool already holds what it would bring
                self.prefetch_counters.cancelled += 1
            req.fetch = None
            req.table.num_tokens = req.cached_tokens = len(req.table.block_ids) * self.block_size
            req.stored_blocks = len(req.table.block_ids)
            self.pool.grow(req.table, total)
            self.prefill_tokens_skipped += req.cached_tokens
            self.prefill_tokens_computed += len(req.prompt_ids) - req.cached_tokens
            admitted.append(req)
        return admitted

    def _make_room(self, need: int) -> bool:
        short = need - self.pool.num_free
        if short > 0 and self._storing:
            self._reap_stores(wait=True)  # blocks a store still reads come back once it is done
            short = need - self.pool.num_free
        if short > 0 and self.resident is not None:
            self.resident.release(short)
        return self.pool.num_free >= need

    def _attach_resident(self, req: Request, keys: list[BlockKey]) -> None:
        """Share the pool blocks of the longest confirmed prefix still resident (no copy at all)."""
        if self.resident is None or not keys:
            return
        ids = self.resident.match(keys, block_tokens(req.prompt_ids, self.block_size))
        self.pool.share(ids)
        req.table.block_ids = list(ids)
        if ids:
            req.served_from[TierKind.DEVICE] = len(ids) * self.block_size

    def _load_from_cache(self, req: Request, usable: int, first: int) -> None:
        """Give the request pool blocks for kvtier's blocks ``first ..``; their KV arrives during the forward.

        A fetch started on arrival is taken (waiting at most until its
        deadline) and its blocks are copied layer by layer under this step's
        forward. Without one (a prefix larger than host can pin at once, or
        the resident prefix changed since arrival), blocks are loaded and
        copied here, one host-sized chunk at a time.
        """
        assert self.cache is not None
        fetch, plan = req.fetch, req.fetch_plan
        if plan is not None and plan.blocks == 0 and (fetch is None or fetch.first_block == first):
            return  # the break-even model chose to recompute
        if fetch is not None and fetch.first_block == first:
            costs, total = self.cache.costs, len(req.prompt_ids)
            handle = fetch.take(lambda landed, t: costs.extension_s(first, fetch.wanted, landed, t, total))
            self.prefetch_counters.blocks_used += len(handle.blocks)
            self.prefetch_counters.deadline_missed += fetch.missed_deadline
            if handle.blocks:
                fresh = self.pool.allocate(len(handle.blocks))
                self._loads.append((handle, fresh))
                req.table.block_ids.extend(fresh)
                self._count_served(req, handle)
            else:
                handle.release()
            return
        if fetch is not None:
            fetch.cancel()
            self.prefetch_counters.cancelled += 1
        result = self.cache.lookup(req.prompt_ids, req.namespace, first_block=first)
        end = min(result.cached_blocks, usable)
        at = first
        while at < end:
            with self.cache.load(result, start=at, max_blocks=min(self.cache.load_chunk, end - at)) as handle:
                if not handle.blocks:
                    break  # evicted since the lookup, or a failed read: recompute from here
                fresh = self.pool.allocate(len(handle.blocks))
                LayerwiseLoad(self.pool, [(handle, fresh)]).finish()  # synchronous: the handle is reused
                self._count_served(req, handle)
            req.table.block_ids.extend(fresh)
            at += len(fresh)

    def _count_served(self, req: Request, handle: LoadHandle) -> None:
        for kind in handle.served_from:
            req.served_from[kind] = req.served_from.get(kind, 0) + self.block_size

    # -- sampling and stopping ------------------------------------------------------
    def _advance(self, req: Request, token: int) -> StepOutput:
        req.output_ids.append(token)
        p = req.params
        reason: FinishReason | None = None
        if token in self.tokenizer.eos_ids and not p.ignore_eos:
            piece, reason = req.decoder.finish(), FinishReason.STOP
        else:
            piece = req.decoder.push(token)
            if len(req.output_ids) >= p.max_tokens or len(req.all_ids) >= self.model.config.context_length:
                piece, reason = piece + req.decoder.finish(), FinishReason.LENGTH
        piece, stopped = self._cut_at_stop(req, piece)
        if stopped:
            reason = FinishReason.STOP
        req.text += piece
        req.finish_reason = reason
        return StepOutput(req.id, [token], piece, reason is not None, reason)

    @staticmethod
    def _cut_at_stop(req: Request, piece: str) -> tuple[str, bool]:
        """Cut ``piece`` where a stop string first completes (the stop string itself is not returned)."""
        if not req.params.stop or not piece:
            return piece, False
        longest = max(map(len, req.params.stop))
        head = req.text[-(longest - 1) :] if longest > 1 else ""
        window = head + piece
        cuts = [i for i in (window.find(s) for s in req.params.stop) if i >= 0]
        if not cuts:
            return piece, False
        return piece[: max(0, min(cuts) - len(head))], True

    def _fail(self, req: Request, message: str) -> None:
        req.finish_reason = FinishReason.ERROR
        req.error = message
        self._finished.append(req)

    # -- retiring: store new blocks, keep them resident, free the rest -----------------
    def _store_new_blocks(self, req: Request) -> None:
        """Offer kvtier the request's full blocks it does not have yet, copied out of the pool off this thread.

        The store job copies each pool block straight into its host slot on
        a transfer thread. Until it is done the engine holds an extra
        reference on those blocks (:meth:`_reap_stores` drops it), so they
        can be neither freed nor reused under the copy; full blocks are never
        written again, so nothing changes them either.
        """
        full = req.table.num_tokens // self.block_size
        if self.cache is None or full <= req.stored_blocks:
            return
        first = req.stored_blocks
        ids = req.table.block_ids[first:full]
        self.pool.share(ids)
        pool = self.pool

        def fill(block: int, out: torch.Tensor) -> None:
            pool.read_block_to_payload(ids[block - first], out)

        job = self.cache.store_from(
            req.all_ids[: full * self.block_size], fill, req.namespace, first_block=first, num_blocks=full - first
        )
        self._storing.append((job, ids))
        req.stored_blocks = full

    def _reap_stores(self, *, wait: bool = False) -> None:
        """Drop the pool references of finished stores; a failed store is logged (its blocks are misses later)."""
        if self.cache is None or not self._storing:
            return
        pending = []
        for job, ids in self._storing:
            if not wait and self.cache.poll(job) is JobStatus.PENDING:
                pending.append((job, ids))
                continue
            try:
                self.cache.wait(job)
            except Exception:
                log.exception("storing %d blocks failed; they will be recomputed when asked for", len(ids))
            self.pool.free(ids)
        self._storing = pending

    def _retire(self, req: Request) -> None:
        self._store_new_blocks(req)
        if self.resident is not None and self.hasher is not None:
            full = req.table.num_tokens // self.block_size
            ids = req.all_ids[: full * self.block_size]
            self.resident.keep(
                self.hasher.keys(ids, req.namespace), req.table.block_ids[:full], block_tokens(ids, self.block_size)
            )
        self.pool.release(req.table)
        req.finished_at = time.perf_counter()
        self._finished.append(req)

    # -- running to completion ---------------------------------------------------------
    def collect_finished(self) -> list[Request]:
        """Requests that ended since the last call (the server and ``generate`` read results here)."""
        done, self._finished = self._finished, []
        return done

    def drain_stores(self) -> None:
        """Wait until every block offered to kvtier is stored (tests and benchmarks need a settled cache)."""
        if self.cache is not None:
            self._reap_stores(wait=True)
            self.cache.worker.drain()

    def close(self) -> None:
        """Give back everything held outside the pool: pending fetches' pins, store references, the copy thread.

        After a failed step too (the server rebuilds its engine then): the
        waiting requests' fetches pin host slots that nobody would release.
        """
        for req in self._waiting:
            if req.fetch is not None:
                req.fetch.cancel()
                req.fetch = None
        for handle, _ in self._loads:
            handle.release()
        self._loads = []
        self.drain_stores()
        if self._onboard is not None:
            self._onboard.shutdown(wait=True)

    def generate(
        self,
        prompts: Iterable[Sequence[int]],
        params: SamplingParams,
        *,
        namespace: str | None = None,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> list[Completion]:
        """Run ``prompts`` together (continuously batched) and return them in order."""
        order = [self.add_request(p, params, namespace=namespace) for p in prompts]
        results: dict[str, Request] = {}
        while len(results) < len(order):
            for out in self.step():
                if on_step is not None:
                    on_step(out)
            results.update((r.id, r) for r in self.collect_finished())
        return [self._completion(results[rid]) for rid in order]

    @staticmethod
    def _completion(req: Request) -> Completion:
        if req.finish_reason is FinishReason.ERROR:
            raise ValueError(req.error)
        assert req.finish_reason is not None and req.first_token_at is not None
        return Completion(
            request_id=req.id,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            served_from=dict(req.served_from),
            token_ids=list(req.output_ids),
            text=req.text,
            finish_reason=req.finish_reason,
            ttft_s=req.first_token_at - req.arrival,
            total_s=(req.finished_at or time.perf_counter()) - req.arrival,
        )
