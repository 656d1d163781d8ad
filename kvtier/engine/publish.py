"""Step ⑤ for the built-in engine: a request's new full blocks offered to kvtier and kept in the pool.

A block is published as soon as a chunk computes it (a request sharing that
prefix attaches it instead of computing it again) and when its request
ends (blocks made of generated tokens too, because an agent's next turn
resends prompt + reply). Keys depend on token ids only, so a block gets
the same key whether its tokens came from a prompt or from generation.
While a running request is about to compute a prompt block, it is that
block's producer: another request sharing the prefix waits for it.
"""

from __future__ import annotations

import logging

import torch

from kvtier.cache import Cache
from kvtier.engine.pool import KVPool
from kvtier.engine.request import Request
from kvtier.engine.resident import ResidentBlocks
from kvtier.keys import BlockKey
from kvtier.transfer import JobId, JobStatus

log = logging.getLogger("kvtier.engine.engine")


class Publisher:
    def __init__(
        self,
        pool: KVPool,
        cache: Cache | None,
        resident: ResidentBlocks | None,
        *,
        block_size: int,
        cache_decoded: bool,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.cache = cache
        self.resident = resident
        self.cache_decoded = cache_decoded  # False: only prefill-computed blocks are stored or kept (DecodedKV)
        self.storing: list[tuple[JobId, list[int]]] = []  # stores reading pool blocks, which they hold a ref on
        # Prompt blocks a running request is about to compute: a request sharing that prefix waits for them.
        self.producing: dict[BlockKey, Request] = {}

    def claim(self, req: Request) -> None:
        """Just admitted: ``req`` produces its prompt blocks not yet shared (if the pool publishes blocks at all)."""
        if self.resident is not None:
            for key in req.keys[req.shared_blocks :]:
                self.producing.setdefault(key, req)

    def publish(self, req: Request) -> None:
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
            ids = req.table.block_ids[first:full]
            partial = frozenset(i - first for i in req.partial_blocks if first <= i < full)
            self.resident.keep(
                req.keys[first:full], ids, req.blocks[first:full], self.generation, partial, req.prompt.root
            )
        self._unclaim(req, req.keys[first:full])
        req.shared_blocks = full

    def retire(self, req: Request) -> None:
        """At its end: store what it computed and keep its cacheable blocks resident (reply included)."""
        self._unclaim(req, req.keys[req.shared_blocks :])
        self._store_new_blocks(req)
        if self.resident is not None:
            full = self.cacheable_blocks(req)
            chain = req.keyed_through(full)
            partial = frozenset(i for i in req.partial_blocks if i < full)
            ids = req.table.block_ids[:full]
            self.resident.keep(chain.keys[:full], ids, chain.blocks[:full], self.generation, partial, chain.root)

    @property
    def generation(self) -> int:
        """The cache's generation, which blocks kept now are stored in (see :mod:`kvtier.engine.resident`)."""
        return 0 if self.cache is None else self.cache.generation

    def _unclaim(self, req: Request, keys: list[BlockKey]) -> None:
        for key in keys:
            if self.producing.get(key) is req:
                del self.producing[key]

    def _store_new_blocks(self, req: Request) -> None:
        """Offer kvtier the request's full blocks it does not have yet, copied out of the pool off this thread.

        The store job copies each pool block into its host slot on a
        transfer thread (on a GPU, out of one gather made here:
        :meth:`KVPool.payload_reader`). Until it is done the engine holds an extra
        reference on those blocks (:meth:`reap` drops it), so they can be
        neither freed nor reused under the copy; full blocks are never
        written again, so nothing changes them either.
        """
        full = self.cacheable_blocks(req)
        cache = self.cache
        if cache is None or full <= req.stored_blocks:
            return
        first = req.stored_blocks
        assert not any(first <= i < full for i in req.partial_blocks), "a partial block would be stored"
        ids = req.table.block_ids[first:full]
        self.pool.share(ids)
        read, chain = self.pool.payload_reader(ids), req.keyed_through(full)

        def fill(block: int, out: torch.Tensor) -> None:
            read(block - first, out)

        job = cache.worker.submit(lambda: cache.store(chain, fill, first_block=first, num_blocks=full - first))
        self.storing.append((job, ids))
        req.stored_blocks = full

    def cacheable_blocks(self, req: Request) -> int:
        """Leading full blocks of ``req`` whose KV may be cached: all, or (``cache_decoded`` off) the prompt's.

        Positions past the prompt were computed by decode steps (or a
        speculative verify), with other kernels than a prefill of the same
        tokens; a block holding any of them is left out when reuse must be
        exact by construction.
        """
        bs = self.block_size
        full = req.table.num_tokens // bs
        return full if self.cache_decoded else min(full, len(req.prompt_ids) // bs)

    def reap(self, *, wait: bool = False) -> None:
        """Drop the pool references of finished stores; a failed store is logged (its blocks are misses later)."""
        if self.cache is None or not self.storing:
            return
        pending = []
        for job, ids in self.storing:
            if not wait and self.cache.poll(job) is JobStatus.PENDING:
                pending.append((job, ids))
                continue
            try:
                self.cache.wait(job)
            except Exception:
                log.exception("storing %d blocks failed; they will be recomputed when asked for", len(ids))
            self.pool.free(ids)
        self.storing = pending
