"""The built-in engine: continuous batching over a paged pool, prefilling only what is new.

One :meth:`Engine.step` admits waiting requests (each: block keys → the
resident pool blocks → kvtier lookup and load of the rest → allocate the
remainder), then runs ONE forward over a token budget: every decoding
request's next token, and chunks of the prompts still being prefilled
(chunked prefill), so one long prompt can never hold every other request's
first token hostage. A request's new full blocks are offered to kvtier and
published in the pool as soon as a chunk computes them (a request sharing
that prefix attaches them instead of computing them again) and when it ends
(blocks made of generated tokens), because an agent's next turn resends
prompt + reply. Keys depend on token ids only, so a block gets the same key
whether its tokens came from a prompt or from generation.

Admission reserves pool blocks for the prompt plus ``max_tokens`` up front,
so a running request never runs out of pages mid-decode (no preemption);
resident blocks of finished requests are released, least recent first, to
make that room. :meth:`Engine.abort` ends a request between two steps (its
client went away) and gives its pages back.

With prompt lookup on (``speculative``), a greedy decoding request's step
carries its next token plus drafts found earlier in its context
(:mod:`kvtier.engine.speculate`), each a decode row of the same forward;
the drafts the model agrees with are kept with its own next token, and the
positions of the rest are simply not counted in ``table.num_tokens``: their
pages were reserved at admission anyway, nothing reads past
``num_tokens``, and the next step writes over them.
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

import numpy as np
import torch

from kvtier.breakeven import FetchPlan
from kvtier.engine import quant
from kvtier.engine.llama import LlamaModel, SeqInput
from kvtier.engine.onboard import LayerwiseLoad
from kvtier.engine.pool import BlockTable, KVPool, blocks_for
from kvtier.engine.resident import ResidentBlocks
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.schedule import oldest_share, prefill_budget, prefill_chunks
from kvtier.engine.speculate import PromptLookup
from kvtier.engine.verify import BlockVerdict, Check, ShadowVerifier
from kvtier.fetch import Fetch, LoadHandle
from kvtier.keys import BlockKey, KeyedTokens, KeyHasher
from kvtier.manager import CacheManager
from kvtier.model.tokenizer import StreamDecoder, Tokenizer
from kvtier.service.cache import ServiceCache, ServiceFetch
from kvtier.service.client import ClientLoad
from kvtier.tiers.base import TierKind
from kvtier.transfer import JobId, JobStatus

log = logging.getLogger(__name__)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ERROR = "error"
    ABORT = "abort"  # the caller gave up on it (a client that disconnected); nobody reads its output


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    id: str
    prompt: KeyedTokens  # the prompt with its blocks' keys, hashed once for the request's whole way
    params: SamplingParams
    sampler: Sampler
    decoder: StreamDecoder
    arrival: float
    prompt_ids: list[int] = field(default_factory=list)
    chain: KeyedTokens | None = None  # prompt + reply keyed so far (extended as the reply fills blocks)
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
    shared_blocks: int = 0  # leading prompt blocks published in the pool for other requests to attach
    last_chunk: int | None = None  # prompt tokens the previous step gave it (None: not planned yet)
    fetch: Fetch | ServiceFetch | None = None  # started on arrival, taken on admission
    fetch_plan: FetchPlan | None = None  # what the break-even model decided on arrival
    draft_width: int | None = None  # drafts its next step may carry (prompt lookup; None: not drafted for yet)
    verify_span: tuple[int, int] | None = None  # blocks loaded from kvtier that shadow verification checks

    def __post_init__(self) -> None:
        self.prompt_ids = self.prompt.tokens.tolist()
        self.chain = self.prompt

    @property
    def namespace(self) -> str:
        return self.prompt.namespace

    @property
    def keys(self) -> list[BlockKey]:
        """The prompt's full blocks' keys."""
        return self.prompt.keys

    @property
    def blocks(self) -> np.ndarray:
        """The prompt's full blocks' tokens, ``[n, block_size]``."""
        return self.prompt.blocks

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def keyed_through(self, blocks: int) -> KeyedTokens:
        """Prompt + reply keyed through ``blocks`` full blocks at least: only blocks not keyed yet are hashed."""
        assert self.chain is not None
        if self.chain.num_blocks < blocks:
            self.chain = self.chain.extend(self.all_ids[: blocks * self.prompt.hasher.block_size])
        return self.chain

    @property
    def prefilling(self) -> bool:
        """Admitted, with prompt tokens still to compute (its first token is not sampled yet)."""
        return self.first_token_at is None

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


@dataclass
class SpeculationCounters:
    """What prompt-lookup drafting did, since the engine started (the server reports them in /stats)."""

    verify_steps: int = 0  # request-steps that carried drafts
    drafted: int = 0  # draft tokens run through the model
    accepted: int = 0  # of those, tokens equal to the model's own choice (kept)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


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
        cache: CacheManager | ServiceCache | None = None,
        hasher: KeyHasher | None = None,
        keep_resident: bool = True,
        max_batch: int = 16,
        namespace: str = "default",
        prefetch: bool = True,
        layerwise: bool = True,
        max_step_tokens: int = 512,
        speculative: PromptLookup | None = None,
        cache_decoded: bool = True,
    ) -> None:
        want = model.kv_layout(block_size)
        if cache is not None and cache.layout != want:
            raise ValueError(f"cache layout {cache.layout.descriptor} != the model's {want.descriptor}")
        if hasher is None:
            hasher = cache.hasher if cache is not None else KeyHasher.process_local(want.descriptor, block_size)
        self.model = model
        self.tokenizer = tokenizer
        self.pool: KVPool = model.make_pool(block_size, pool_blocks)
        self.cache = cache
        self.hasher = hasher
        self.resident = ResidentBlocks(self.pool) if keep_resident else None
        self.cache_decoded = cache_decoded  # False: only prefill-computed blocks are stored or kept (DecodedKV)
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
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
        self.verifier: ShadowVerifier | None = None  # shadow verification of hits (set by make_engine)
        # One thread copies fetched KV into the pool, layer by layer, while the forward computes.
        self._onboard = ThreadPoolExecutor(1, thread_name_prefix="kvtier-onboard") if layerwise else None
        self._loads: list[tuple[LoadHandle | ClientLoad, list[int]]] = []  # fetched this step, copied in its forward
        self._storing: list[tuple[JobId, list[int]]] = []  # stores reading pool blocks, which they hold a ref on
        # Prompt blocks a running request is about to compute: a request sharing that prefix waits for them.
        self._producing: dict[BlockKey, Request] = {}
        self.speculative = speculative  # None: one token per decoding request per step
        self.speculation = SpeculationCounters()

    # -- requests --------------------------------------------------------------
    def keyed(self, prompt_ids: Sequence[int] | np.ndarray, namespace: str | None = None) -> KeyedTokens:
        """A prompt keyed by this engine's hasher (its cache's): what :meth:`add_request` takes."""
        return self.hasher.keyed(prompt_ids, namespace or self.namespace)

    def add_request(self, prompt: KeyedTokens, params: SamplingParams, *, request_id: str | None = None) -> str:
        """Queue ``prompt`` (from :meth:`keyed`, made once per request by the caller); returns its id."""
        if prompt.hasher is not self.hasher:
            raise ValueError("the prompt was keyed by another hasher: key it with Engine.keyed")
        if not len(prompt):
            raise ValueError("a prompt needs at least one token")
        limit = self.model.config.context_length
        if len(prompt) >= limit:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {limit}")
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(rid, prompt, params, Sampler(params), self.tokenizer.decode_stream(), time.perf_counter())
        self._start_fetch(req)
        self._waiting.append(req)
        return rid

    def _start_fetch(self, req: Request) -> None:
        """On arrival: look the prompt up and start moving the blocks worth fetching up to host memory.

        The break-even model sizes the fetch and sets its deadline, so the
        disk reads run while the request still waits for a batch slot, and
        admission takes whatever landed in time.
        """
        if not self.prefetch or self.cache is None:
            return
        usable = (len(req.prompt_ids) - 1) // self.block_size
        if usable <= 0:
            return
        first = 0
        if self.resident is not None:
            first = self.resident.peek(req.keys[:usable], req.blocks)
        if first >= usable:
            return
        result = self.cache.lookup(req.prompt, first_block=first)
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
        batch = self._running + self._admit()  # admission order: the oldest first
        if not batch:
            return []
        drafts = self._draft(batch)
        work = self._plan(batch, drafts)
        seqs = [self._input(req, n, drafts.get(req, [])) for req, n in work]
        loads, self._loads = self._loads, []
        onboarding = LayerwiseLoad(self.pool, loads, self._onboard) if loads else None
        started = time.perf_counter()
        try:
            logits = self.model(seqs, self.pool, layer_ready=onboarding.wait if onboarding else None)
        finally:
            if onboarding is not None:
                onboarding.finish()
        self._offer_checks(batch)
        now = time.perf_counter()
        if self.cache is not None:
            self.cache.costs.observe_forward([(s.start, len(s.token_ids)) for s in seqs], now - started)
            if onboarding is not None:
                self.cache.costs.observe_fetch(TierKind.HOST, onboarding.nbytes, onboarding.seconds)
        outputs = []
        rows = iter(logits)
        for req, n in work:
            if req in drafts:
                outputs.append(self._verify(req, drafts[req], [next(rows) for _ in range(n)]))
                continue
            row = next(rows)
            if req.prefilling:
                self.prefill_tokens_computed += n
                self._publish_blocks(req)
                if req.table.num_tokens < len(req.prompt_ids):
                    continue  # more chunks to come: this row's logits are not a next token
                req.first_token_at = now
            outputs.append(self._advance(req, req.sampler(row)))
        self._running = [r for r in batch if r.finish_reason is None]
        for req in batch:
            if req.finish_reason is not None:
                self._retire(req)
        return outputs

    def _plan(self, batch: list[Request], drafts: dict[Request, list[int]]) -> list[tuple[Request, int]]:
        """This step's work: one token (plus drafts) per decoding request, then prompt chunks within the budget."""
        decodes = [(r, 1 + len(drafts.get(r, []))) for r in batch if not r.prefilling]
        prefills = [r for r in batch if r.prefilling]
        budget = prefill_budget(self.max_step_tokens, sum(n for _, n in decodes), self.block_size)
        last = prefills[0].last_chunk if prefills else None
        grants = prefill_chunks(
            [len(r.prompt_ids) - r.table.num_tokens for r in prefills],
            [r.table.num_tokens for r in prefills],
            budget,
            self.block_size,
            oldest_starved=last is not None and last < oldest_share(budget),
        )
        for req, n in zip(prefills, grants, strict=True):
            req.last_chunk = n
        return decodes + [(r, n) for r, n in zip(prefills, grants, strict=True) if n > 0]

    @staticmethod
    def _input(req: Request, n: int, drafts: list[int]) -> SeqInput:
        """The forward's view of one request: its uncomputed tokens, then its drafts (verified row by row)."""
        new = req.all_ids[req.table.num_tokens :][: n - len(drafts)] + drafts
        return SeqInput(new, req.table.num_tokens, req.table, verify=bool(drafts))

    # -- prompt-lookup speculation -----------------------------------------------------
    def _draft(self, batch: list[Request]) -> dict[Request, list[int]]:
        """Drafts for the greedy decoding requests, oldest first, while the step stays a quantized decode step.

        A decode step's rows all go through the GGUF-block matmuls only up to
        :data:`~kvtier.engine.quant.MAX_ROWS`; past that every row would take
        the dense path, slower and rounded differently. A sampled request gets
        none: accepting drafts would need its distribution, not one argmax.
        """
        if self.speculative is None:
            return {}
        decodes = [r for r in batch if not r.prefilling]
        room = quant.MAX_ROWS - len(decodes)
        drafts: dict[Request, list[int]] = {}
        for req in decodes:
            if room <= 0:
                break
            if not req.params.greedy:
                continue
            left = min(req.params.max_tokens - len(req.output_ids), self.model.config.context_length - len(req.all_ids))
            width = req.draft_width or self.speculative.num_draft_tokens
            proposed = self.speculative.propose(req.all_ids, min(left - 1, room, width))  # its own token comes too
            if proposed:
                drafts[req] = proposed
                room -= len(proposed)
        return drafts

    def _verify(self, req: Request, drafts: list[int], rows: list[torch.Tensor]) -> StepOutput:
        """Keep the drafts equal to the model's greedy choice, then its own next token; uncount the rest.

        Row *i* holds the logits after draft *i-1* (row 0: after the last real
        token), so the tokens taken are exactly those one-token steps would
        have produced, up to the first draft the model disagrees with. The K/V
        written for drafts after that one lie past ``num_tokens``, where
        nothing reads them and the next forward writes over them.
        """
        tokens: list[int] = []
        for i, row in enumerate(rows):
            tokens.append(req.sampler(row))
            if i == len(drafts) or tokens[-1] != drafts[i]:
                break
        out = self._advance_all(req, tokens)
        req.table.num_tokens = min(req.table.num_tokens, len(req.all_ids) - 1)  # the last token's K/V is next step's
        counters = self.speculation
        counters.verify_steps += 1
        counters.drafted += len(drafts)
        counters.accepted += len(tokens) - 1
        lookup = self.speculative
        assert lookup is not None  # drafts come from it
        req.draft_width = lookup.adapt(req.draft_width or lookup.num_draft_tokens, len(drafts), len(tokens) - 1)
        return out

    def _advance_all(self, req: Request, tokens: list[int]) -> StepOutput:
        """:meth:`_advance` token by token until the request ends; one output for the lot."""
        outs: list[StepOutput] = []
        for token in tokens:
            outs.append(self._advance(req, token))
            if outs[-1].finished:
                break
        last = outs[-1]
        ids = [t for o in outs for t in o.token_ids]
        return StepOutput(req.id, ids, "".join(o.text for o in outs), last.finished, last.finish_reason)

    # -- admission: resident pool blocks, then kvtier, then fresh blocks ----------
    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        for req in list(self._waiting):
            if len(self._running) + len(admitted) >= self.max_batch:
                break
            total = min(len(req.prompt_ids) + req.params.max_tokens, self.model.config.context_length)
            need = blocks_for(total, self.block_size)
            if need > self.pool.num_blocks:
                self._waiting.remove(req)
                self._fail(req, f"request needs {need} KV blocks; the pool has {self.pool.num_blocks}")
                continue
            usable = (len(req.prompt_ids) - 1) // self.block_size  # at least one prompt token is computed
            self._attach_resident(req, req.keys[:usable])  # first, so making room cannot release its own prefix
            if self._waits_for_producer(req, usable):
                self._detach(req)
                continue  # another request is computing its next blocks: attach them once they exist
            if not self._make_room(need - len(req.table.block_ids)):
                self._detach(req)
                break  # wait for running requests (or stores still reading the pool) to finish
            self._waiting.remove(req)
            if self.cache is not None and len(req.table.block_ids) < usable:
                first = len(req.table.block_ids)
                self._load_from_cache(req, usable, first)
                self._sample_for_verify(req, first)
            elif req.fetch is not None:
                req.fetch.cancel()  # the pool already holds what it would bring
                self.prefetch_counters.cancelled += 1
            req.fetch = None
            req.table.num_tokens = req.cached_tokens = len(req.table.block_ids) * self.block_size
            req.stored_blocks = req.shared_blocks = len(req.table.block_ids)
            self.pool.grow(req.table, total)
            self.prefill_tokens_skipped += req.cached_tokens
            if self.resident is not None:  # only a pool that publishes blocks lets others attach them
                for key in req.keys[req.shared_blocks :]:
                    self._producing.setdefault(key, req)
            admitted.append(req)
        return admitted

    def _waits_for_producer(self, req: Request, usable: int) -> bool:
        """True when the next block ``req`` needs is being computed by a running request right now.

        Waiting is cheaper than computing: the producer computes the block
        anyway, within the same per-step budget, and once it has, attaching
        it costs no compute and no copy. A block the request's own fetch is
        bringing up from kvtier is not waited for, and the tokens must agree
        (a key is only a hint).
        """
        first = len(req.table.block_ids)
        if first >= min(usable, len(req.keys)):
            return False
        producer = self._producing.get(req.keys[first])
        if producer is None or producer is req or not np.array_equal(producer.blocks[first], req.blocks[first]):
            return False
        return req.fetch is None or req.fetch.first_block != first

    def _detach(self, req: Request) -> None:
        """Undo :meth:`_attach_resident` for a request that stays waiting."""
        self.pool.release(req.table)
        req.served_from.clear()

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
        ids = self.resident.match(keys, req.blocks)
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
        result = self.cache.lookup(req.prompt, first_block=first)
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

    # -- shadow verification: keep what a sampled hit served, recompute it when idle ------
    def _sample_for_verify(self, req: Request, first: int) -> None:
        """Right after admission loaded blocks ``first ..`` from kvtier: mark the request if the hit is checked."""
        verifier = self.verifier
        end = len(req.table.block_ids)
        if verifier is None or end <= first or first >= verifier.max_blocks or not verifier.sample():
            return
        req.verify_span = (first, min(end, verifier.max_blocks))

    def _offer_checks(self, batch: list[Request]) -> None:
        """After the forward that onboarded them: copy the sampled hits' pool blocks aside for the verifier."""
        verifier = self.verifier
        for req in batch:
            if verifier is None or req.verify_span is None:
                continue
            (first, end), req.verify_span = req.verify_span, None
            if not verifier.room():
                continue
            served = torch.empty((end - first, self.pool.layout.block_bytes), dtype=torch.uint8)
            for row, block_id in zip(served, req.table.block_ids[first:end], strict=True):
                self.pool.read_block_to_payload(block_id, row)
            tiers = tuple(kind for kind in req.served_from if kind is not TierKind.DEVICE)
            tokens = req.prompt_ids[: end * self.block_size]
            verifier.offer(Check(req.namespace, tokens, first, req.keys[first:end], served, tiers))

    @property
    def verify_pending(self) -> bool:
        return self.verifier is not None and self.verifier.pending

    def verify_idle(self) -> list[BlockVerdict]:
        """One chunk of shadow verification; the server's loop calls it only while no request waits or runs."""
        return [] if self.verifier is None else self.verifier.step()

    def _count_served(self, req: Request, handle: LoadHandle | ClientLoad) -> None:
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
        full = self._cacheable_blocks(req)
        if self.cache is None or full <= req.stored_blocks:
            return
        first = req.stored_blocks
        ids = req.table.block_ids[first:full]
        self.pool.share(ids)
        pool, cache, chain = self.pool, self.cache, req.keyed_through(full)

        def fill(block: int, out: torch.Tensor) -> None:
            pool.read_block_to_payload(ids[block - first], out)

        job = cache.worker.submit(lambda: cache.store(chain, fill, first_block=first, num_blocks=full - first))
        self._storing.append((job, ids))
        req.stored_blocks = full

    def _cacheable_blocks(self, req: Request) -> int:
        """Leading full blocks of ``req`` whose KV may be cached: all, or (``cache_decoded`` off) the prompt's.

        Positions past the prompt were computed by decode steps (or a
        speculative verify), with other kernels than a prefill of the same
        tokens; a block holding any of them is left out when reuse must be
        exact by construction.
        """
        full = req.table.num_tokens // self.block_size
        return full if self.cache_decoded else min(full, len(req.prompt_ids) // self.block_size)

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

    def _publish_blocks(self, req: Request) -> None:
        """After a chunk: offer the new full blocks to kvtier and keep the prompt's ones in the pool for others.

        Requests that share the prefix (parallel sub-agents with one system
        prompt) attach these pool blocks at admission instead of computing them.
        """
        self._store_new_blocks(req)
        full = min(req.table.num_tokens // self.block_size, len(req.keys))
        first = req.shared_blocks
        if full <= first:
            return
        if self.resident is not None:
            self.resident.keep(req.keys[first:full], req.table.block_ids[first:full], req.blocks[first:full])
        for key in req.keys[first:full]:
            if self._producing.get(key) is req:
                del self._producing[key]
        req.shared_blocks = full

    def abort(self, request_id: str) -> bool:
        """End a request between steps (its client went away): pages, pins and fetches are given back.

        What it computed so far is stored and kept resident like any finished
        request's blocks, which is what the client's retry wants. False when
        no such request is waiting or running (it finished meanwhile).
        """
        req = next((r for r in self._waiting if r.id == request_id), None)
        if req is not None:
            self._waiting.remove(req)
            if req.fetch is not None:
                req.fetch.cancel()
                req.fetch = None
            req.finish_reason = FinishReason.ABORT
            req.finished_at = time.perf_counter()
            self._finished.append(req)
            return True
        req = next((r for r in self._running if r.id == request_id), None)
        if req is None:
            return False
        self._running.remove(req)
        req.finish_reason = FinishReason.ABORT
        self._retire(req)
        return True

    def _retire(self, req: Request) -> None:
        for key in req.keys[req.shared_blocks :]:
            if self._producing.get(key) is req:
                del self._producing[key]
        self._store_new_blocks(req)
        if self.resident is not None:
            full = self._cacheable_blocks(req)
            chain = req.keyed_through(full)
            self.resident.keep(chain.keys[:full], req.table.block_ids[:full], chain.blocks[:full])
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
        order = [self.add_request(self.keyed(p, namespace), params) for p in prompts]
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
