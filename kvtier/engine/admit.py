"""Admission: where a waiting request's prompt KV comes from before its first forward.

In order of cost: pool blocks still resident from earlier requests (shared,
no copy), then kvtier's tiers (fetched on arrival, copied into fresh pool
blocks layer by layer under the next forward), then fresh blocks to
compute. Admission reserves pool blocks for the prompt plus ``max_tokens``
up front, so a running request never runs out of pages mid-decode (no
preemption); resident blocks of finished requests are released, least
recent first, to make that room.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvtier.cache import Cache, Loaded
from kvtier.engine.onboard import LayerwiseLoad, LoadPart, SlidingWindow
from kvtier.engine.pool import KVPool, blocks_for
from kvtier.engine.publish import Publisher
from kvtier.engine.request import PrefetchCounters, Request
from kvtier.engine.resident import ResidentBlocks
from kvtier.engine.verify import ShadowVerifier
from kvtier.keys import BlockKey
from kvtier.tiers.base import TierKind


class Admission:
    def __init__(
        self,
        pool: KVPool,
        cache: Cache | None,
        resident: ResidentBlocks | None,
        publisher: Publisher,
        *,
        block_size: int,
        context_length: int,
        prefetch: bool,
        window: SlidingWindow | None = None,
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.resident = resident
        self.publisher = publisher
        self.block_size = block_size
        self.context_length = context_length
        self.prefetch = prefetch and cache is not None
        self.counters = PrefetchCounters()
        self.verifier: ShadowVerifier | None = None  # shadow verification of hits (set by make_engine)
        self.window = window  # the model's sliding-window layers: loads leave out what their window never reads
        self.sliding_layers = window.layers if window is not None else frozenset()
        self.loads: list[LoadPart] = []  # fetched, copied in the next forward
        self.tokens_skipped = 0  # prompt tokens whose KV came from the pool or kvtier

    # -- on arrival ------------------------------------------------------------------------------
    def start_fetch(self, req: Request) -> None:
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
        counters = self.counters
        if not plan.blocks:
            counters.recompute_chosen += 1
            return
        req.fetch = self.cache.fetch(result, start=first, max_blocks=plan.blocks, deadline_s=plan.deadline_s)
        counters.started += 1
        counters.blocks_planned += plan.blocks

    # -- admission ---------------------------------------------------------------------------------
    def admit(self, waiting: deque[Request], room: int) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Admit up to ``room`` waiting requests, oldest first; also those refused (the pool can never hold them)."""
        admitted: list[Request] = []
        refused: list[tuple[Request, str]] = []
        for req in list(waiting):
            if len(admitted) >= room:
                break
            total = min(len(req.prompt_ids) + req.params.max_tokens, self.context_length)
            need = blocks_for(total, self.block_size)
            if need > self.pool.num_blocks:
                waiting.remove(req)
                refused.append((req, f"request needs {need} KV blocks; the pool has {self.pool.num_blocks}"))
                continue
            usable = (len(req.prompt_ids) - 1) // self.block_size  # at least one prompt token is computed
            self._attach_resident(req, req.keys[:usable])  # first, so making room cannot release its own prefix
            if self._waits_for_producer(req, usable):
                self._detach(req)
                continue  # another request is computing its next blocks: attach them once they exist
            if not self._make_room(need - len(req.table.block_ids)):
                self._detach(req)
                break  # wait for running requests (or stores still reading the pool) to finish
            waiting.remove(req)
            self._fill_from_cache(req, usable)
            req.table.num_tokens = req.cached_tokens = len(req.table.block_ids) * self.block_size
            req.shared_blocks = len(req.table.block_ids)
            req.stored_blocks = self._stored_blocks(req)
            self.pool.grow(req.table, total)
            self.tokens_skipped += req.cached_tokens
            self.publisher.claim(req)
            admitted.append(req)
        return admitted, refused

    def _fill_from_cache(self, req: Request, usable: int) -> None:
        """Past the resident prefix: kvtier's blocks, or (the pool holds it all) the arrival fetch given back."""
        if self.cache is not None and len(req.table.block_ids) < usable:
            first = len(req.table.block_ids)
            self._load_from_cache(req, usable, first)
            self._sample_for_verify(req, first)
        elif req.fetch is not None:
            req.fetch.cancel()  # the pool already holds what it would bring
            self.counters.cancelled += 1
        req.fetch = None

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
        producer = self.publisher.producing.get(req.keys[first])
        if producer is None or producer is req or not np.array_equal(producer.blocks[first], req.blocks[first]):
            return False
        return req.fetch is None or req.fetch.first_block != first

    def _detach(self, req: Request) -> None:
        """Undo :meth:`_attach_resident` for a request that stays waiting."""
        self.pool.release(req.table)
        req.served_from.clear()

    def _make_room(self, need: int) -> bool:
        short = need - self.pool.num_free
        if short > 0 and self.publisher.storing:
            self.publisher.reap(wait=True)  # blocks a store still reads come back once it is done
            short = need - self.pool.num_free
        if short > 0 and self.resident is not None:
            self.resident.release(short)
        return self.pool.num_free >= need

    def _stored_blocks(self, req: Request) -> int:
        """Leading shared blocks the cache holds already: all, unless resident ones predate the cache's generation.

        Blocks loaded from the cache are held there; resident ones were
        stored when kept, in the cache of their generation. From the first
        one kept in an earlier generation (the service restarted empty, or
        was cleared), the request stores its blocks again: the cache takes
        only those it lacks.
        """
        shared = len(req.table.block_ids)
        if self.cache is None or self.resident is None:
            return shared
        attached = req.served_from.get(TierKind.DEVICE, 0) // self.block_size
        current = self.resident.stored_in(req.keys[:attached], self.cache.generation)
        if any(i >= current for i in req.partial_blocks):
            return shared  # a partial block has no sliding layers to store: those stay unstored, never wrong
        return shared if current == attached else current

    def _attach_resident(self, req: Request, keys: list[BlockKey]) -> None:
        """Share the pool blocks of the longest confirmed prefix still resident (no copy at all)."""
        if self.resident is None or not keys:
            return
        ids = self.resident.match(keys, req.blocks, self.window)
        self.pool.share(ids)
        req.table.block_ids = list(ids)
        req.partial_blocks = {i for i, p in enumerate(self.resident.partial(keys[: len(ids)])) if p}
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
            self.counters.blocks_used += len(handle.blocks)
            self.counters.deadline_missed += fetch.missed_deadline
            if handle.blocks:
                fresh = self.pool.allocate(len(handle.blocks))
                req.table.block_ids.extend(fresh)  # the last blocks admission gives it: the request resumes after
                self.loads.append(LoadPart(handle, fresh, self._left_out(req, first, len(fresh))))
                self._count_served(req, handle)
            else:
                handle.release()
            return
        if fetch is not None:
            fetch.cancel()
            self.counters.cancelled += 1
        result = self.cache.lookup(req.prompt, first_block=first)
        end = min(result.cached_blocks, usable)
        at = first
        while at < end:
            with self.cache.load(result, start=at, max_blocks=min(self.cache.load_chunk, end - at)) as handle:
                if not handle.blocks:
                    break  # evicted since the lookup, or a failed read: recompute from here
                fresh = self.pool.allocate(len(handle.blocks))
                LayerwiseLoad(self.pool, [LoadPart(handle, fresh)]).finish()  # synchronous: the handle is reused
                self._count_served(req, handle)
            req.table.block_ids.extend(fresh)
            at += len(fresh)

    def _left_out(self, req: Request, first: int, count: int) -> int:
        """How many of the loaded blocks ``first ..`` the sliding layers skip: those before the window.

        Only the fetch taken whole leaves blocks out: its end is where the
        request resumes. The chunked loads copy as they go, before knowing
        where the last chunk ends, so they copy every layer.
        """
        if self.window is None:
            return 0
        needed = self.window.first_block(len(req.table.block_ids) * self.block_size, self.block_size)
        skip = min(max(needed - first, 0), count)
        req.partial_blocks.update(range(first, first + skip))
        return skip

    def _sample_for_verify(self, req: Request, first: int) -> None:
        """Right after admission loaded blocks ``first ..`` from kvtier: mark the request if the hit is checked."""
        verifier = self.verifier
        end = len(req.table.block_ids)
        if verifier is None or end <= first or first >= verifier.max_blocks or not verifier.sample():
            return
        req.verify_span = (first, min(end, verifier.max_blocks))

    def _count_served(self, req: Request, handle: Loaded) -> None:
        for kind in handle.served_from:
            req.served_from[kind] = req.served_from.get(kind, 0) + self.block_size

    def cancel_waiting(self, waiting: deque[Request]) -> None:
        """Give back the pins of fetches nobody will take, and of loads no forward will copy."""
        for req in waiting:
            if req.fetch is not None:
                req.fetch.cancel()
                req.fetch = None
        for part in self.loads:
            part.handle.release()
        self.loads = []
