"""The device tier: finished requests' full blocks kept in the engine's own pool.

When a request ends, its full blocks stay in the pool, indexed by block key,
instead of returning to the free list: the next turn of the same agent finds
its transcript already resident and shares those pool blocks (no copy at
all). Blocks are reference-counted by the pool; this index holds one
reference per block and gives it up, least recently used first, when a new
request needs room. Every hit is confirmed against the request's tokens, like
every other tier.

A resident block was stored in kvtier when it was computed, so a request
that shares it need not store it again, as long as the cache is the one it
was stored in. Each block remembers the cache's generation when it was kept
(:attr:`kvtier.cache.Cache.generation`): after a cache service
restarted empty, or a clear, the blocks kept before are stored again by the
next request that shares them; without that, a hot prefix resident here
would never reach the new cache, and since keys chain, nothing after it
would be found there by any other engine.

A block loaded for a model with sliding-window layers may hold only its
global layers (:mod:`kvtier.engine.onboard`): it is kept as *partial*, and
:meth:`ResidentBlocks.match` shares it only with a request whose window
starts after it, which never reads those layers there. A complete copy of
the same block, kept later, takes its place.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from kvtier.engine.onboard import SlidingWindow
from kvtier.engine.pool import KVPool
from kvtier.events import BlockEventSink
from kvtier.index import longest_prefix
from kvtier.keys import BlockKey
from kvtier.tiers.base import TierKind


@dataclass(frozen=True)
class _Resident:
    block_id: int
    tokens: np.ndarray
    generation: int  # the cache's, when this block was kept (stored there)
    partial: bool = False  # its sliding-window layers were never loaded
    root: BlockKey | None = None  # its chain's root: the namespace it belongs to (a tenant's clear)

    def matches(self, tokens: np.ndarray) -> bool:
        """The confirmation every tier makes, here on the block's tokens themselves (the pool holds them anyway)."""
        return np.array_equal(self.tokens, tokens)


class ResidentBlocks:
    """The pool's finished blocks by key: a holder :func:`kvtier.index.longest_prefix` walks like any tier."""

    kind = TierKind.DEVICE

    def __init__(self, pool: KVPool) -> None:
        self._pool = pool
        self._blocks: OrderedDict[BlockKey, _Resident] = OrderedDict()  # least recently used first
        self.events: BlockEventSink | None = None  # told of every key kept, released or cleared (a router's view)

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, key: BlockKey) -> _Resident | None:
        return self._blocks.get(key)

    def confirm(self, key: BlockKey, tokens: np.ndarray) -> bool | None:
        resident = self._blocks.get(key)
        return None if resident is None else resident.matches(tokens)

    def match(self, keys: list[BlockKey], blocks: np.ndarray, window: SlidingWindow | None = None) -> list[int]:
        """Pool block ids of the longest confirmed run of ``keys`` held here (they become most recent).

        A prefix's first block is made the most recent of all, its last the
        least: evicting from the end of a chain keeps the rest of it useful.
        ``window``: the model's sliding layers, whose blocks inside the window
        before the run's end must be complete.
        """
        hits = keys[: self.peek(keys, blocks, window)]
        for key in reversed(hits):
            self._blocks.move_to_end(key)
        return [self._blocks[key].block_id for key in hits]

    def peek(self, keys: list[BlockKey], blocks: np.ndarray, window: SlidingWindow | None = None) -> int:
        """How many leading ``keys`` :meth:`match` would share now, without touching recency."""
        n = len(longest_prefix(keys, blocks, [self]).tiers)
        while window is not None and n > 0:
            inside = range(window.first_block(n * self._pool.layout.block_size, self._pool.layout.block_size), n)
            partial = [i for i in inside if self._blocks[keys[i]].partial]
            if not partial:
                break
            n = partial[0]  # end the run before it; the window moves back, check again
        return n

    def partial(self, keys: list[BlockKey]) -> list[bool]:
        """Which of ``keys`` (all held) are partial."""
        return [self._blocks[key].partial for key in keys]

    def keep(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        blocks: np.ndarray,
        generation: int = 0,
        partial: frozenset[int] = frozenset(),
        root: BlockKey | None = None,
    ) -> None:
        """Hold a reference to each full block of a finished request not already held.

        ``generation``: the cache's, in which these blocks are stored (those
        already held are stored there again, so they take it too).
        ``partial``: indices into ``keys`` of blocks whose sliding layers were
        never loaded; a complete block replaces a partial one held.
        ``root``: the chain's root, which names the namespace of every one of ``keys``.
        """
        new: list[BlockKey] = []
        for i, (key, block_id, tokens) in reversed(list(enumerate(zip(keys, block_ids, blocks, strict=False)))):
            held = self._blocks.get(key)
            complete = i not in partial
            upgrade = held is not None and held.partial and complete and held.block_id != block_id
            if held is not None and not upgrade:
                if held.generation != generation:
                    self._blocks[key] = replace(held, generation=generation)
                self._blocks.move_to_end(key)
                continue
            if held is not None:  # a partial copy held, a complete one offered: hold that instead
                self._pool.free([held.block_id])
            self._pool.share([block_id])
            self._blocks[key] = _Resident(block_id, np.array(tokens, dtype=np.int32), generation, not complete, root)
            if held is None:
                new.append(key)
        if new and self.events is not None:
            self.events.stored(TierKind.DEVICE, new)

    def stored_in(self, keys: list[BlockKey], generation: int) -> int:
        """How many leading held ``keys`` were stored in the cache of ``generation`` (the rest: store again)."""
        n = 0
        for key in keys:
            held = self._blocks.get(key)
            if held is None or held.generation != generation:
                break
            n += 1
        return n

    def evictable(self) -> int:
        """Blocks that would return to the pool's free list if released now (held by nobody else)."""
        return sum(self._pool.ref_count(r.block_id) == 1 for r in self._blocks.values())

    def release(self, n: int) -> int:
        """Give up references, least recently used first, until ``n`` pool blocks became free."""
        gone: list[BlockKey] = []
        for key in list(self._blocks):
            if len(gone) >= n:
                break
            resident = self._blocks[key]
            if self._pool.ref_count(resident.block_id) != 1:
                continue  # a running request shares it; releasing would free nothing
            del self._blocks[key]
            self._pool.free([resident.block_id])
            gone.append(key)
        if gone and self.events is not None:
            self.events.removed(TierKind.DEVICE, gone)
        return len(gone)

    def clear(self, root: BlockKey | None = None) -> int:
        """Give up every block held, or only those of the chains from ``root`` (a namespace's); returns how many."""
        if root is None:
            n = len(self._blocks)
            for resident in self._blocks.values():
                self._pool.free([resident.block_id])
            self._blocks.clear()
            if self.events is not None:
                self.events.cleared(TierKind.DEVICE)
            return n
        gone = [key for key, resident in self._blocks.items() if resident.root == root]
        for key in gone:
            self._pool.free([self._blocks.pop(key).block_id])
        if gone and self.events is not None:
            self.events.removed(TierKind.DEVICE, gone)
        return len(gone)
