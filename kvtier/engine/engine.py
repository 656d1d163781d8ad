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

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvtier.cache import Cache
from kvtier.engine.admit import Admission
from kvtier.engine.drafts import Drafting
from kvtier.engine.llama import LlamaModel, SeqInput
from kvtier.engine.onboard import LayerwiseLoad, SlidingWindow
from kvtier.engine.pool import KVPool
from kvtier.engine.publish import Publisher
from kvtier.engine.request import (
    Completion,
    FinishReason,
    PrefetchCounters,
    Request,
    SpeculationCounters,
    StepOutput,
)
from kvtier.engine.resident import ResidentBlocks
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.schedule import oldest_share, prefill_budget, prefill_chunks
from kvtier.engine.speculate import PromptLookup
from kvtier.engine.stopping import Stopping
from kvtier.engine.verify import BlockVerdict, ShadowVerifier, offer_served
from kvtier.keys import KeyedTokens, KeyHasher
from kvtier.model.tokenizer import Tokenizer
from kvtier.tiers.base import TierKind

__all__ = ["Completion", "Engine", "FinishReason", "Request", "StepOutput"]


class _Interrupted(Exception):
    """A forward abandoned between two layers (:meth:`Engine.step`'s ``interrupt``)."""


def _layer_ready(
    onboarding: LayerwiseLoad | None, interrupt: Callable[[], bool] | None
) -> Callable[[int], None] | None:
    """What the forward calls before each layer: wait for that layer's copies, after asking whether to stop."""
    if interrupt is None:
        return onboarding.wait if onboarding is not None else None

    def ready(layer: int) -> None:
        if interrupt():
            raise _Interrupted
        if onboarding is not None:
            onboarding.wait(layer)

    return ready


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        *,
        pool_blocks: int,
        block_size: int,
        cache: Cache | None = None,
        hasher: KeyHasher | None = None,
        keep_resident: bool = True,
        max_batch: int = 16,
        namespace: str = "default",
        prefetch: bool = True,
        layerwise: bool = True,
        max_step_tokens: int = 512,
        speculative: PromptLookup | None = None,
        cache_decoded: bool = True,
        windowed_loads: bool = True,
    ) -> None:
        """``windowed_loads``: a hit leaves out of a model's sliding-window layers the blocks their window never
        reads (:mod:`kvtier.engine.onboard`); off, every hit loads every layer."""
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
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.namespace = namespace
        self.block_size = block_size
        context = model.config.context_length
        self.publisher = Publisher(self.pool, cache, self.resident, block_size=block_size, cache_decoded=cache_decoded)
        self.admission = Admission(
            self.pool,
            cache,
            self.resident,
            self.publisher,
            block_size=block_size,
            context_length=context,
            prefetch=prefetch,
            window=SlidingWindow.of(model.config) if windowed_loads else None,
        )
        self.stopping = Stopping(tokenizer, context)
        self.speculative = speculative  # None: one token per decoding request per step
        self.drafting = Drafting(speculative, self.stopping) if speculative is not None else None
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._ids = itertools.count()
        self._finished: list[Request] = []
        self.prefill_tokens_computed = 0
        self.onboarded_bytes = 0  # copied into the pool from kvtier's host slots
        self.onboarded_full_bytes = 0  # what those loads would have copied with every layer
        # One thread copies fetched KV into the pool, layer by layer, while the forward computes.
        self._onboard = ThreadPoolExecutor(1, thread_name_prefix="kvtier-onboard") if layerwise else None

    # -- what the server reports ----------------------------------------------------------------
    @property
    def prefetch_counters(self) -> PrefetchCounters:
        return self.admission.counters

    @property
    def speculation(self) -> SpeculationCounters:
        return self.drafting.counters if self.drafting is not None else SpeculationCounters()

    @property
    def prefill_tokens_skipped(self) -> int:
        return self.admission.tokens_skipped

    @property
    def verifier(self) -> ShadowVerifier | None:
        """Shadow verification of hits (set by ``make_engine``)."""
        return self.admission.verifier

    @verifier.setter
    def verifier(self, verifier: ShadowVerifier | None) -> None:
        self.admission.verifier = verifier

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
        self.admission.start_fetch(req)
        self._waiting.append(req)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # -- one scheduler step ------------------------------------------------------
    def step(self, *, interrupt: Callable[[], bool] | None = None) -> list[StepOutput]:
        """One forward over the batch; ``interrupt``, asked before each layer, abandons it when True.

        An abandoned forward advances nothing (a table's token count moves
        only once every layer ran; K/V written past it are written again), so
        the step can simply be taken again. The server passes ``interrupt``
        only while the batch is background work (warming a session's next
        turn): a request that arrives then waits for one layer, not one step.
        """
        self.publisher.reap()
        batch = self._running + self._admit()  # admission order: the oldest first
        if not batch:
            return []
        drafts = self.drafting.draft(batch) if self.drafting is not None else {}
        work = self._plan(batch, drafts)
        seqs = [self._input(req, n, drafts.get(req, [])) for req, n in work]
        loads, self.admission.loads = self.admission.loads, []
        onboarding = LayerwiseLoad(self.pool, loads, self._onboard, self.admission.sliding_layers) if loads else None
        started = time.perf_counter()
        try:
            logits = self.model(seqs, self.pool, layer_ready=_layer_ready(onboarding, interrupt))
        except _Interrupted:
            self._running = batch  # admitted and planned, nothing computed: the next step takes them again
            return []
        finally:
            if onboarding is not None:
                onboarding.finish()  # copies already under way land: admission counted them as cached
        if self.verifier is not None:
            offer_served(self.verifier, self.pool, batch)
        now = time.perf_counter()
        if self.cache is not None:
            self.cache.costs.observe_forward([(s.start, len(s.token_ids)) for s in seqs], now - started)
            if onboarding is not None:
                self.cache.costs.observe_fetch(TierKind.HOST, onboarding.nbytes, onboarding.seconds)
                self.onboarded_bytes += onboarding.nbytes
                self.onboarded_full_bytes += onboarding.full_nbytes
        outputs = self._sample(work, drafts, logits, now)
        self._running = [r for r in batch if r.finish_reason is None]
        for req in batch:
            if req.finish_reason is not None:
                self._retire(req)
        return outputs

    def _admit(self) -> list[Request]:
        admitted, refused = self.admission.admit(self._waiting, self.max_batch - len(self._running))
        for req, message in refused:
            self._fail(req, message)
        return admitted

    def _sample(
        self, work: list[tuple[Request, int]], drafts: dict[Request, list[int]], logits: torch.Tensor, now: float
    ) -> list[StepOutput]:
        """Each request's rows of this forward: drafts verified, a next token sampled, or (mid-prompt) nothing."""
        outputs = []
        rows = iter(logits)
        for req, n in work:
            if req in drafts:
                assert self.drafting is not None
                outputs.append(self.drafting.verify(req, drafts[req], [next(rows) for _ in range(n)]))
                continue
            row = next(rows)
            first = req.prefilling
            if first:
                self.prefill_tokens_computed += n
                self.publisher.publish(req)
                if req.table.num_tokens < len(req.prompt_ids):
                    continue  # more chunks to come: this row's logits are not a next token
                if req.params.max_tokens == 0:  # a prefill alone: what it leaves is KV, in the pool and the tiers
                    req.finish_reason = FinishReason.LENGTH
                    outputs.append(StepOutput(req.id, [], "", True, FinishReason.LENGTH, req.cached_tokens))
                    continue
                req.first_token_at = now
            out = self.stopping.advance(req, req.sampler(row))
            outputs.append(dataclasses.replace(out, cached_tokens=req.cached_tokens) if first else out)
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

    # -- shadow verification: what a sampled hit served, recomputed when idle -----------------
    @property
    def verify_pending(self) -> bool:
        return self.verifier is not None and self.verifier.pending

    def verify_idle(self) -> list[BlockVerdict]:
        """One chunk of shadow verification; the server's loop calls it only while no request waits or runs."""
        return [] if self.verifier is None else self.verifier.step()

    # -- ending requests ---------------------------------------------------------------------
    def _fail(self, req: Request, message: str) -> None:
        req.finish_reason = FinishReason.ERROR
        req.error = message
        self._finished.append(req)

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
        self.publisher.retire(req)
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
            self.publisher.reap(wait=True)
            self.cache.worker.drain()

    def close(self) -> None:
        """Give back everything held outside the pool: pending fetches' pins, store references, the copy thread.

        After a failed step too (the server rebuilds its engine then): the
        waiting requests' fetches pin host slots that nobody would release.
        """
        self.admission.cancel_waiting(self._waiting)
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
            stop_sequence=req.stop_sequence,
        )
