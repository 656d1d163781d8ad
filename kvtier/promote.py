"""Step ③'s mechanism: pin what host holds, copy what disk or the remote holds up into host slots.

The manager decides which blocks a request may take (its lookup) and
starts a :class:`~kvtier.fetch.Fetch`; this module fills it. Host blocks are
pinned at once, lower-tier blocks are read a batch at a time into reserved
host slots (one batched read per tier), verified, committed and pinned, in
order, stopping at the first block that cannot be served: an engine
recomputes from there, never around a gap. Metadata changes under the tier
set's lock; the reads themselves run outside it, into slots nobody else can
see until they are committed.
"""

from __future__ import annotations

import time

import torch

from kvtier.breakeven import BreakEvenModel
from kvtier.evict import Eviction
from kvtier.fetch import Fetch, LoadHandle
from kvtier.index import LookupResult
from kvtier.keys import BlockDigest, BlockKey
from kvtier.layout import KVLayout
from kvtier.pins import Pins
from kvtier.tiers.base import BlockRecord, Tier, TierKind
from kvtier.tierset import TierSet
from kvtier.transfer import TransferWorker

PROMOTE_BATCH = 32  # disk blocks per batched read: large enough to stream, small enough to stop on time

_Read = tuple[int, BlockKey, BlockRecord, Tier]  # (position in the batch's views, key, record, from)


class Promoter:
    def __init__(
        self,
        tiers: TierSet,
        eviction: Eviction,
        pins: Pins,
        worker: TransferWorker,
        costs: BreakEvenModel,
        layout: KVLayout,
    ) -> None:
        self.tiers = tiers
        self.eviction = eviction
        self.pins = pins
        self.worker = worker
        self.costs = costs
        self.layout = layout

    def fetch(
        self,
        result: LookupResult,
        *,
        start: int | None = None,
        max_blocks: int | None = None,
        deadline_s: float | None = None,
        inline: bool = False,
    ) -> Fetch:
        """Start pinning blocks ``start ..`` in host memory; take the landed prefix later with :meth:`Fetch.take`.

        Host blocks are pinned before this returns; disk blocks are promoted
        in batches on a transfer thread (or on this one, ``inline``). After
        ``deadline_s`` seconds (None: no deadline) promotion stops and
        ``take`` stops waiting: the rest becomes a miss.
        """
        first = result.first_block if start is None else start
        stop = result.cached_blocks if max_blocks is None else min(result.cached_blocks, first + max_blocks)
        keys = list(result.keys[first:stop])
        digests = [None if result.digests is None else result.digests[i] for i in range(first, stop)]
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        fetch = Fetch(result.namespace, result.block_size, first, len(keys), deadline, self.release)
        landed = self._pin_host_run(keys, digests, fetch)
        rest, wanted = keys[landed:], digests[landed:]
        if not rest or not self.tiers.below_host:
            fetch.finish()
        elif inline:
            self._promote_into(fetch, rest, wanted)
        else:
            self.worker.spawn(lambda: self._promote_into(fetch, rest, wanted), "promoting lower-tier blocks to host")
        return fetch

    def release(self, handle: LoadHandle) -> None:
        """Unpin a load's blocks; after this their host slots may be evicted and reused."""
        if handle.released:
            return
        handle.released = True
        with self.tiers.lock:
            self.pins.unpin(handle.keys)

    def _pin_host_run(self, keys: list[BlockKey], digests: list[BlockDigest | None], fetch: Fetch) -> int:
        """Pin the leading run of ``keys`` that host already holds, at once; how many."""
        started = time.perf_counter()
        host = self.tiers.host
        views: list[torch.Tensor] = []
        with self.tiers.lock:
            for key, digest in zip(keys, digests, strict=True):
                view = host.view(key) if digest is None or host.confirm(key, digest) else None
                if view is None:
                    break
                self.pins.pin((key,))
                self.eviction.accessed(TierKind.HOST, key)
                views.append(view)
        if views:
            fetch.land(keys[: len(views)], views, [TierKind.HOST] * len(views))
            host.stats.observe_load(time.perf_counter() - started)
        return len(views)

    def _promote_into(self, fetch: Fetch, keys: list[BlockKey], digests: list[BlockDigest | None]) -> None:
        """Promote ``keys`` in order, a batch at a time, until one fails or nobody waits any more."""
        try:
            for at in range(0, len(keys), PROMOTE_BATCH):
                if fetch.stopped:
                    break
                batch = keys[at : at + PROMOTE_BATCH]
                views, kinds = self._promote_many(batch, digests[at : at + PROMOTE_BATCH])
                if not fetch.land(batch[: len(views)], views, kinds):
                    with self.tiers.lock:
                        self.pins.unpin(batch[: len(views)])  # taken meanwhile: too late to be used
                    break
                if len(views) < len(batch):
                    break
        finally:
            fetch.finish()

    def _promote_many(
        self, keys: list[BlockKey], digests: list[BlockDigest | None]
    ) -> tuple[list[torch.Tensor], list[TierKind]]:
        """Pin the leading ``keys`` that can be served, copying lower-tier blocks to host in one batch per tier."""
        views, kinds, reads = self._reserve(keys, digests)
        if not reads:
            return views, kinds
        good = self._read_below(reads, views)
        host = self.tiers.host
        with self.tiers.lock:
            for owned in self.tiers.owned:  # a block that failed its checksum was dropped there
                self.eviction.lost(owned, [key for i, key, _, tier in reads if tier is owned and not good[i]])
            # A tier read by key outside the lock: if another prompt's block took the key meanwhile (keys
            # collide; confirmation tells them apart), the bytes read may be that block's, checksums and all.
            # Ours cannot come back under the key while we hold its host reservation, so this check is exact.
            for i, key, record, tier in reads:
                good[i] = good[i] and tier.confirm(key, record.digest) is True
        bad = next((i for i, _, _, _ in reads if not good[i]), len(views))
        self._count_served(reads, good, bad)
        with self.tiers.lock:
            for i, key, record, tier in reads:
                if i >= bad or not good[i]:
                    host.abort(key)
                    continue
                host.commit(key)
                self.eviction.inserted(TierKind.HOST, key, record.parent)
                self.eviction.accessed(tier.kind, key)
                self.pins.pin((key,))
            # Host blocks pinned by _reserve after the failed block: useless now.
            self.pins.unpin(
                k for k, kind in zip(keys[bad : len(views)], kinds[bad:], strict=True) if kind is TierKind.HOST
            )
        return views[:bad], kinds[:bad]

    def _reserve(
        self, keys: list[BlockKey], digests: list[BlockDigest | None]
    ) -> tuple[list[torch.Tensor], list[TierKind], list[_Read]]:
        """Under the lock: pin the host blocks, reserve a host slot for each lower one, up to the first gap.

        Every block is confirmed against the digest the lookup confirmed: since
        then, the key may have gone to another prompt's block (keys collide),
        in host or below it. That is a gap, never a hit.
        """
        host = self.tiers.host
        views: list[torch.Tensor] = []
        kinds: list[TierKind] = []
        reads: list[_Read] = []
        with self.tiers.lock:
            self.eviction.make_room(host, sum(not host.contains(k) for k in keys))
            for key, digest in zip(keys, digests, strict=True):
                held = host.record(key)
                if held is not None:  # stored or promoted by someone else since the lookup
                    view = host.view(key)
                    if not _confirmed(held, digest) or view is None:
                        break
                    self.pins.pin((key,))
                    views.append(view)
                    kinds.append(TierKind.HOST)
                    continue
                found = self.tiers.holder_below_host(key)
                if found is None or not _confirmed(found[1], digest):
                    break  # gone since the lookup, or another prompt's block under the key now
                tier, record = found
                slot = host.reserve(key, record)
                if slot is None and self.eviction.make_room(host, 1):  # an eviction above made this one a miss
                    slot = host.reserve(key, record)
                if slot is None:
                    break  # host is pinned full
                reads.append((len(views), key, record, tier))
                views.append(slot)
                kinds.append(tier.kind)
        return views, kinds, reads

    def _read_below(self, reads: list[_Read], views: list[torch.Tensor]) -> dict[int, bool]:
        """One batched read per lower tier into the reserved slots; which positions came back verified."""
        good: dict[int, bool] = {}
        for tier in self.tiers.below_host:
            mine = [(i, key) for i, key, _, t in reads if t is tier]
            if not mine:
                continue
            started = time.perf_counter()
            ok = tier.get_many([k for _, k in mine], [views[i] for i, _ in mine])
            seconds = time.perf_counter() - started
            tier.stats.observe_load(seconds)
            self.costs.observe_fetch(tier.kind, sum(ok) * self.layout.block_bytes, seconds)
            good.update((i, o) for (i, _), o in zip(mine, ok, strict=True))
        return good

    def _count_served(self, reads: list[_Read], good: dict[int, bool], bad: int) -> None:
        """Hits: blocks read, verified and before any gap (what the engine gets); misses: failed reads."""
        bs = self.layout.block_size
        for tier in self.tiers.below_host:
            mine = [i for i, _, _, t in reads if t is tier]
            if not mine:
                continue
            served = sum(i < bad and good[i] for i in mine)
            failed = sum(not good[i] for i in mine)
            tier.stats.add(hit_tokens=served * bs, miss_tokens=failed * bs)


def _confirmed(record: BlockRecord | None, digest: BlockDigest | None) -> bool:
    """Whether ``record`` is the block of the tokens with ``digest`` (None: nothing to confirm against)."""
    return record is not None and (digest is None or record.matches(digest))
