"""The cache manager: the one module that combines keys, index, tiers, policies and transfers.

Engines talk to kvtier through this class (steps ②, ③ and ⑤ of the data
path): :meth:`CacheManager.lookup` says how many leading tokens are cached and
where; :meth:`CacheManager.load` promotes them to host memory and pins them
for the engine to copy; :meth:`CacheManager.store` offers new full blocks,
asynchronously.

Invariants:

* Metadata (tier indexes, policies, pins) changes only under ``self._lock``.
  Payload copies in and out of host slots run outside it; a slot being read
  is pinned (ref-counted) so eviction cannot free it, and a slot being filled
  is reserved and invisible until committed.
* Stores are two-phase (:meth:`prepare_store` / :meth:`complete_store`); a
  failed store is never indexed.
* Victims come from the tier's policy; a host victim is demoted to disk
  (write-back) unless disk already holds it; a disk victim is dropped.
* The tier list is ordered fastest first, so an engine's own pool (the device
  tier) can be put in front of host without changing any of this.
* The remote tier (``self.remote``, shared with other nodes) is consulted
  last, only for the blocks after the local run, and never holds the lock
  while it talks to the network. It has no policy of ours: Redis expires its
  blocks by TTL. Blocks go out to it behind the request (its own writer
  thread), on store or on host eviction (``remote.write_on``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.breakeven import BreakEvenModel
from kvtier.config import Config, RemoteWriteOn, WriteMode
from kvtier.errors import DiskUnavailableError
from kvtier.events import BlockEventSink, ObservedPolicy
from kvtier.explain import EvictionLog, Explanation, diagnose
from kvtier.fetch import Fetch, LoadHandle
from kvtier.index import LookupResult, MissReason, Probe, longest_prefix
from kvtier.keys import BlockDigests, BlockKey, Digests, KeyHasher, NamedDigests, Secret
from kvtier.layout import KVLayout
from kvtier.policy import EvictionPolicy, make_policy
from kvtier.policy.base import NO_PROTECTION, Protection
from kvtier.stats import TierStats
from kvtier.tiers.base import BlockRecord, Tier, TierKind
from kvtier.tiers.disk import DiskTier, io_mode_for
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RemoteTier
from kvtier.transfer import JobId, JobStatus, TransferWorker


@dataclass(frozen=True)
class Promotion:
    """What a prefetch did: tokens moved up to host, by the tier they left, and the leading blocks in host now."""

    promoted: dict[TierKind, int]
    host_blocks: int


@dataclass
class StorePlan:
    """Host slots reserved for a request's new blocks; fill ``buffers`` then complete."""

    keys: list[BlockKey]
    records: list[BlockRecord]
    block_indices: list[int]  # index of each planned block in the request
    buffers: list[torch.Tensor]
    already_cached: int = 0
    next_block: int = 0  # first block of the request this plan did not cover
    done: bool = field(default=False, repr=False)


PROMOTE_BATCH = 32  # disk blocks per batched read: large enough to stream, small enough to stop on time
HITS_AT_READ = frozenset({TierKind.DISK, TierKind.REMOTE})
"""Tiers whose ``hit_tokens`` count blocks read back and verified, not index hits at lookup.

A disk index hit can still fail its checksum, end short, or never be
fetched (deadline, host full); a remote header can be followed by a value
that expired or fails its check; host memory cannot fail a read, so its
lookup-time hits are what it serves.
"""

log = logging.getLogger("kvtier")


class CacheManager:
    def __init__(
        self,
        config: Config,
        layout: KVLayout,
        *,
        model_fingerprint: str,
        hasher: KeyHasher | None = None,
        host_file: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``host_file``: the host slab in that shared-memory file (the cache service maps it to its clients).

        ``clock`` tells the time TTL pins expire by (tests step it instead of sleeping).
        """
        if layout.block_size != config.cache.block_size:
            raise ValueError(f"layout block size {layout.block_size} != cache.block_size {config.cache.block_size}")
        self.config = config
        self.layout = layout
        self.hasher = hasher or KeyHasher(
            Secret.load_or_ephemeral(config.data_dir, config.cache.secret_file),
            model_fingerprint=model_fingerprint,
            layout_descriptor=layout.descriptor,
            block_size=layout.block_size,
        )
        self.host = HostTier(layout, int(config.host.capacity_bytes), shared_file=host_file)
        self.disk = self._open_disk(model_fingerprint) if config.disk.enabled else None
        self.tiers: list[Tier] = [t for t in (self.host, self.disk) if t is not None]
        self.remote = self._open_remote(model_fingerprint) if config.remote.enabled else None
        self._policies: dict[TierKind, EvictionPolicy] = {
            TierKind.HOST: make_policy(config.host.policy),
            TierKind.DISK: make_policy(config.disk.policy),
        }
        for tier in self.tiers:
            for key, record in tier.entries():
                self._policies[tier.kind].on_insert(key, record.parent)
        self._pins: Counter[BlockKey] = Counter()
        self._ttl_pins: dict[BlockKey, float] = {}  # key -> expiry on self._clock; see pin_for
        self._clock = clock
        self._lock = threading.RLock()
        self.evictions = EvictionLog(config.session.eviction_log)  # what explain says was evicted
        self.protect: Callable[[int], Protection] | None = None  # host capacity -> keys to keep (sessions)
        self.worker = TransferWorker(config.transfer.workers)
        self.write_mode = config.cache.write_mode
        self.costs = BreakEvenModel(
            layout.block_size, layout.block_bytes, deadline_slack=config.transfer.deadline_slack
        )
        self._closed = False

    def _open_disk(self, model_fingerprint: str) -> DiskTier | None:
        """The disk tier, or None (said once in the log) where its directory cannot be created or written.

        A read-only or unwritable disk path costs persistence, not service:
        host memory still caches. A disk tier held by another process, or
        damaged under ``disk.on_corrupt: error``, still stops the start.
        """
        cfg = self.config.disk
        try:
            return DiskTier(
                self.config.disk_path,
                self.layout,
                int(cfg.capacity_bytes),
                model_fingerprint=model_fingerprint,
                file_bytes=int(cfg.file_bytes),
                fsync=cfg.fsync,
                on_mismatch=cfg.on_mismatch,
                on_corrupt=cfg.on_corrupt,
                io_mode=io_mode_for(cfg.io),
            )
        except DiskUnavailableError as err:
            log.warning("%s; running without the disk tier (host memory only)", err)
            return None

    def _open_remote(self, model_fingerprint: str) -> RemoteTier:
        """The shared tier; a Redis that is down at start costs misses (and a breaker), never the start."""
        if not self.hasher.secret.persistent:
            log.warning("the remote tier needs a key secret every node shares; this one is process-local")
        return RemoteTier.open(self.config.remote, self.layout, self.hasher.secret, model_fingerprint)

    @property
    def _every_tier(self) -> list[Tier]:
        """The local tiers, fastest first, then the remote one."""
        return self.tiers if self.remote is None else [*self.tiers, self.remote]

    # -- ② lookup ------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None) -> list[BlockKey]:
        return self.hasher.keys(tokens, namespace or self.config.cache.namespace)

    def lookup(
        self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None, *, first_block: int = 0
    ) -> LookupResult:
        """How many leading tokens are cached, confirmed against ``tokens``, and in which tier.

        ``first_block`` skips blocks the caller already holds (an engine's own
        pool): probing, stats and the result start there.
        """
        ns = namespace or self.config.cache.namespace
        keys = self.hasher.keys(tokens, ns)
        digests = self.hasher.digests(keys, tokens)
        bs = self.layout.block_size
        with self._lock:
            probe = longest_prefix(keys, digests, self.tiers, start=first_block)
        if self.remote is not None and probe.reason is MissReason.ABSENT:
            probe = self._probe_remote(self.remote, keys, digests, probe, first_block)
        with self._lock:
            served = Counter(probe.tiers)
            for key, kind in zip(keys[first_block:], probe.tiers, strict=False):
                if kind in self._policies:
                    self._policies[kind].on_access(key)
        remaining = len(keys) - first_block  # blocks that reached this tier: not served by a faster one
        for tier in self._every_tier:
            hit = served[tier.kind]
            counted = 0 if tier.kind in HITS_AT_READ else hit
            tier.stats.add(lookups=1, hit_tokens=counted * bs, miss_tokens=max(0, remaining - hit) * bs)
            remaining -= hit
        if probe.mismatched is not None:
            self._stats(probe.mismatched).add(confirm_mismatch=1)
            if probe.mismatched is TierKind.REMOTE:
                self._stats(TierKind.REMOTE).add(foreign_tokens=1)
        return LookupResult(ns, bs, len(tokens), tuple(keys), tuple(probe.tiers), probe.reason, first_block)

    def _probe_remote(
        self, remote: RemoteTier, keys: list[BlockKey], digests: Digests, local: Probe, first_block: int
    ) -> Probe:
        """Extend the local run with blocks the remote holds: headers read (no lock held), then confirmed.

        The remote's records are confirmed against the request's digests
        like any tier's, so a value of other tokens ends the run here.
        """
        at = first_block + len(local.tiers)
        remote.probe_run(keys[at:])
        with self._lock:
            rest = longest_prefix(keys, digests, self._every_tier, start=at)
        return Probe([*local.tiers, *rest.tiers], rest.reason, rest.mismatched)

    def probe(self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None) -> LookupResult:
        """What :meth:`lookup` would answer, without touching policies or stats.

        For operators (the server's admin ``/lookup``): asking must not change
        what is evicted next nor count as traffic, or looking would alter the
        cache being looked at. Hits are confirmed against ``tokens`` all the same.
        Past the local tiers the remote one is asked too, as a lookup would
        (its headers read, confirmed the same way), so the answer says which
        blocks a fetch would take from the shared tier.
        """
        ns = namespace or self.config.cache.namespace
        keys = self.hasher.keys(tokens, ns)
        digests = self.hasher.digests(keys, tokens)
        with self._lock:
            found = longest_prefix(keys, digests, self.tiers)
        if self.remote is not None and found.reason is MissReason.ABSENT:
            found = self._probe_remote(self.remote, keys, digests, found, 0)
        return LookupResult(ns, self.layout.block_size, len(tokens), tuple(keys), tuple(found.tiers), found.reason)

    def explain(
        self,
        tokens: Sequence[int] | np.ndarray,
        namespace: str,
        *,
        own_namespaces: Sequence[str] = (),
        diverged_at: int | None = None,
    ) -> Explanation:
        """What a request would hit and why the run stops (see :mod:`kvtier.explain`); a probe, not traffic.

        ``own_namespaces`` are the caller's other namespaces, the only ones
        probed besides ``namespace``: another tenant's must never be asked.
        """
        others = [self.probe(tokens, ns) for ns in own_namespaces if ns != namespace]
        result = self.probe(tokens, namespace)
        return diagnose(result, self.evictions, others=others, diverged_at=diverged_at, now=self._clock())

    def prefetch(self, tokens: Sequence[int] | np.ndarray, namespace: str) -> Promotion:
        """Promote the cached blocks of ``tokens`` to host memory now.

        For a session about to speak again (its tool call is returning): the
        disk or remote reads happen during the pause instead of in its next
        turn's TTFT. Blocks already in host count as hits (their recency is
        refreshed); nothing stays pinned afterwards. Every block the load
        pinned was in host when it ended, so that run is the answer's
        ``host_blocks``, with no second lookup.
        """
        with self.load(self.lookup(tokens, namespace)) as handle:
            moved: dict[TierKind, int] = {}
            for kind in handle.served_from:
                if kind is not TierKind.HOST:
                    moved[kind] = moved.get(kind, 0) + self.layout.block_size
            return Promotion(moved, len(handle.blocks))

    # -- ③ fetch and load ----------------------------------------------------------
    def load(self, result: LookupResult, *, start: int | None = None, max_blocks: int | None = None) -> LoadHandle:
        """Pin cached blocks ``start ..`` (default: the result's first) in host memory, promoting disk blocks.

        Blocks are taken in order and the handle stops at the first block that
        can no longer be served (evicted since the lookup, failed its checksum,
        no host slot free): the engine recomputes from there, never around a
        gap. A prefix larger than host memory is loaded in pieces: ask for
        ``max_blocks`` at a time (see :meth:`load_chunk`), copy, release, go on.
        Release with :meth:`complete_load` (or use the handle's ``with``).
        This is :meth:`fetch` run to the end on the calling thread.
        """
        return self.fetch(result, start=start, max_blocks=max_blocks, inline=True).take()

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
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        fetch = Fetch(result.namespace, result.block_size, first, len(keys), deadline, self.complete_load)
        landed = self._pin_host_run(keys, fetch)
        rest = keys[landed:]
        if not rest or (self.disk is None and self.remote is None):
            fetch.finish()
        elif inline:
            self._promote_into(fetch, rest)
        else:
            self.worker.spawn(lambda: self._promote_into(fetch, rest), "promoting lower-tier blocks to host")
        return fetch

    def _pin_host_run(self, keys: list[BlockKey], fetch: Fetch) -> int:
        """Pin the leading run of ``keys`` that host already holds, at once; how many."""
        started = time.perf_counter()
        views: list[torch.Tensor] = []
        with self._lock:
            for key in keys:
                view = self.host.view(key)
                if view is None:
                    break
                self._pins[key] += 1
                self._policies[TierKind.HOST].on_access(key)
                views.append(view)
        if views:
            fetch.land(keys[: len(views)], views, [TierKind.HOST] * len(views))
            self.host.stats.observe_load(time.perf_counter() - started)
        return len(views)

    def _promote_into(self, fetch: Fetch, keys: list[BlockKey]) -> None:
        """Promote ``keys`` in order, a batch at a time, until one fails or nobody waits any more."""
        try:
            for at in range(0, len(keys), PROMOTE_BATCH):
                if fetch.stopped:
                    break
                batch = keys[at : at + PROMOTE_BATCH]
                views, kinds = self._promote_many(batch)
                if not fetch.land(batch[: len(views)], views, kinds):
                    self._unpin(batch[: len(views)])  # taken meanwhile: too late to be used
                    break
                if len(views) < len(batch):
                    break
        finally:
            fetch.finish()

    def _promote_many(self, keys: list[BlockKey]) -> tuple[list[torch.Tensor], list[TierKind]]:
        """Pin the leading ``keys`` that can be served, copying lower-tier blocks to host in one batch per tier."""
        views: list[torch.Tensor] = []
        kinds: list[TierKind] = []
        reads: list[tuple[int, BlockKey, BlockRecord, Tier]] = []  # (position in views, key, record, from)
        with self._lock:
            self._make_room(self.host, sum(not self.host.contains(k) for k in keys))
            for key in keys:
                view = self.host.view(key)  # stored or promoted by someone else since the lookup
                if view is not None:
                    self._pins[key] += 1
                    views.append(view)
                    kinds.append(TierKind.HOST)
                    continue
                found = self._below_host(key)
                if found is None:
                    break  # gone since the lookup
                tier, record = found
                slot = self.host.reserve(key, record)
                if slot is None and self._make_room(self.host, 1):  # an eviction above made this one a miss
                    slot = self.host.reserve(key, record)
                if slot is None:
                    break  # host is pinned full
                reads.append((len(views), key, record, tier))
                views.append(slot)
                kinds.append(tier.kind)
        if not reads:
            return views, kinds
        good = self._read_below(reads, views)
        bad = next((i for i, _, _, _ in reads if not good[i]), len(views))
        self._count_served(reads, good, bad)
        with self._lock:
            for i, key, record, tier in reads:
                if i >= bad or not good[i]:
                    self.host.abort(key)
                    continue
                self.host.commit(key)
                self._policies[TierKind.HOST].on_insert(key, record.parent)
                if tier.kind in self._policies:
                    self._policies[tier.kind].on_access(key)
                self._pins[key] += 1
            for key, kind in zip(keys[bad : len(views)], kinds[bad:], strict=True):
                if kind is TierKind.HOST:  # pinned above, but after the failed block: useless
                    self._unpin_locked(key)
        return views[:bad], kinds[:bad]

    def _below_host(self, key: BlockKey) -> tuple[Tier, BlockRecord] | None:
        """The fastest tier under host that holds ``key`` (disk, then what the remote's probe saw), with its record."""
        for tier in (self.disk, self.remote):
            record = None if tier is None else tier.record(key)
            if record is not None:
                return tier, record  # type: ignore[return-value]
        return None

    def _read_below(
        self, reads: list[tuple[int, BlockKey, BlockRecord, Tier]], views: list[torch.Tensor]
    ) -> dict[int, bool]:
        """One batched read per lower tier into the reserved slots; which positions came back verified."""
        good: dict[int, bool] = {}
        for tier in (self.disk, self.remote):
            mine = [(i, key) for i, key, _, t in reads if t is tier]
            if tier is None or not mine:
                continue
            started = time.perf_counter()
            ok = tier.get_many([k for _, k in mine], [views[i] for i, _ in mine])
            seconds = time.perf_counter() - started
            tier.stats.observe_load(seconds)
            self.costs.observe_fetch(tier.kind, sum(ok) * self.layout.block_bytes, seconds)
            good.update((i, o) for (i, _), o in zip(mine, ok, strict=True))
        return good

    def _count_served(
        self, reads: list[tuple[int, BlockKey, BlockRecord, Tier]], good: dict[int, bool], bad: int
    ) -> None:
        """Hits: blocks read, verified and before any gap (what the engine gets); misses: failed reads."""
        bs = self.layout.block_size
        for tier in (self.disk, self.remote):
            mine = [i for i, _, _, t in reads if t is tier]
            if tier is None or not mine:
                continue
            served = sum(i < bad and good[i] for i in mine)
            failed = sum(not good[i] for i in mine)
            tier.stats.add(hit_tokens=served * bs, miss_tokens=failed * bs)

    @property
    def load_chunk(self) -> int:
        """Blocks one load should ask for so that several loads can be pinned at once."""
        return max(1, self.host.capacity_blocks // 4)

    def complete_load(self, handle: LoadHandle) -> None:
        """Unpin a load's blocks; after this their host slots may be evicted and reused."""
        if handle.released:
            return
        handle.released = True
        self._unpin(handle.keys)

    def _unpin(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for key in keys:
                self._unpin_locked(key)

    def _unpin_locked(self, key: BlockKey) -> None:
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]

    def pinned(self, key: BlockKey) -> int:
        with self._lock:
            return self._pins.get(key, 0)

    def pin_for(self, tokens: Sequence[int] | np.ndarray, namespace: str | None, ttl_s: float) -> list[BlockKey]:
        """Keep the full blocks of ``tokens`` out of host eviction for ``ttl_s`` seconds; returns their keys.

        A TTL pin is a retention promise, apart from the read pins above (which
        guard bytes being copied): an operator keeps a shared system prompt
        warm whatever the traffic. Keys are pinned whether or not they are
        cached yet, so a prefix stored later is protected too. Pinning again
        sets a new expiry (``ttl_s=0`` unpins). Expiry is lazy: an expired pin
        is dropped the next time eviction or :meth:`ttl_pinned` looks at it.
        Only host eviction honours TTL pins; :meth:`clear` does not (an
        explicit clear means clear).
        """
        if ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")
        keys = self.hasher.keys(tokens, namespace or self.config.cache.namespace)
        until = self._clock() + ttl_s
        with self._lock:
            self._ttl_pins.update(dict.fromkeys(keys, until))
            self._expire_ttl_pins()
        return keys

    def ttl_pinned(self) -> int:
        """Keys under a live TTL pin (cached or not)."""
        with self._lock:
            self._expire_ttl_pins()
            return len(self._ttl_pins)

    def _expire_ttl_pins(self) -> None:
        now = self._clock()
        for key in [k for k, until in self._ttl_pins.items() if until <= now]:
            del self._ttl_pins[key]

    def _host_exclude(self) -> Container[BlockKey]:
        """Host keys eviction must skip: read pins, then live TTL pins (call with the lock held)."""
        if not self._ttl_pins:
            return self._pins
        self._expire_ttl_pins()
        return self._pins.keys() | self._ttl_pins.keys()

    # -- ⑤ store -----------------------------------------------------------------
    def prepare_store(
        self,
        tokens: Sequence[int] | np.ndarray,
        namespace: str | None = None,
        *,
        first_block: int = 0,
        num_blocks: int | None = None,
    ) -> StorePlan:
        """Reserve host slots for the full blocks ``first_block ..`` of ``tokens`` not yet cached.

        The plan stops early when host memory cannot make room (everything
        pinned, or the range is larger than the tier) or at a block whose key
        holds other tokens: ``plan.next_block`` says where, and later blocks
        are useless without the missing one anyway.
        """
        keys = self.hasher.keys(tokens, namespace or self.config.cache.namespace)
        last = len(keys) if num_blocks is None else min(len(keys), first_block + num_blocks)
        return self._prepare(keys, self.hasher.digests(keys, tokens), first_block, last)

    def _prepare(self, keys: list[BlockKey], digests: BlockDigests, start: int, stop: int) -> StorePlan:
        plan = StorePlan([], [], [], [], next_block=start)
        with self._lock:
            new = sum(not self.host.contains(keys[i]) for i in range(start, stop))
            self._make_room(self.host, new)  # one batch of evictions (and demotions) for the plan
            for i in range(start, stop):
                existing = self.host.record(keys[i])
                if existing is not None:
                    if not existing.matches(digests[i]):
                        self.host.stats.add(confirm_mismatch=1)
                        break
                    plan.already_cached += 1
                    plan.next_block = i + 1
                    continue
                record = BlockRecord(digests[i], keys[i - 1] if i else None)
                buf = self.host.reserve(keys[i], record)
                if buf is None:
                    break
                plan.keys.append(keys[i])
                plan.records.append(record)
                plan.block_indices.append(i)
                plan.buffers.append(buf)
                plan.next_block = i + 1
        return plan

    def complete_store(self, plan: StorePlan, success: bool) -> int:
        """Publish (``success``) or discard the plan's blocks; returns how many were indexed."""
        if plan.done:
            raise RuntimeError("store plan completed twice")
        plan.done = True
        with self._lock:
            if not success:
                for key in plan.keys:
                    self.host.abort(key)
                return 0
            for key, record in zip(plan.keys, plan.records, strict=True):
                self.host.commit(key)
                self._policies[TierKind.HOST].on_insert(key, record.parent)
            if self.remote is not None and self.remote.write_on is RemoteWriteOn.STORE and plan.keys:
                views = [self.host.view(k) for k in plan.keys]  # copied onto the remote's queue here, under the lock
                self.remote.put_many(plan.keys, views, plan.records)  # type: ignore[arg-type]
            through = self.write_mode is WriteMode.WRITE_THROUGH and self.disk is not None and plan.keys
            if through:
                self._pins.update(plan.keys)  # keep the slots alive while disk reads them, lock released
        if through:
            try:
                self._write_through(plan.keys, plan.records)
            finally:
                with self._lock:
                    self._pins.subtract(plan.keys)
                    self._pins += Counter()  # drop zero counts
        return len(plan.keys)

    def _write_through(self, keys: list[BlockKey], records: list[BlockRecord]) -> None:
        """Copy freshly committed host blocks to disk without holding the manager lock during I/O."""
        disk = self.disk
        assert disk is not None
        with self._lock:
            new = [(k, r) for k, r in zip(keys, records, strict=True) if not disk.contains(k)]
            self._make_room(disk, min(len(new), disk.capacity_blocks))
        if not new:
            return
        ok = disk.put_many([k for k, _ in new], [self.host.view(k) for k, _ in new], [r for _, r in new])
        with self._lock:
            self._index_disk(new, ok)

    def store_now(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Sequence[torch.Tensor] | torch.Tensor,
        namespace: str | None = None,
        *,
        first_block: int = 0,
    ) -> int:
        """Synchronous store: ``blocks[j]`` is the payload of block ``first_block + j``.

        Runs as a series of plans of at most half the host tier each, so a
        request larger than host memory still lands whole: its own earlier
        blocks become evictable (and, write-back, go down to disk) once committed.
        """
        want = self.layout.block_bytes
        for j, block in enumerate(blocks):
            if block.numel() * block.element_size() != want:
                raise ValueError(
                    f"block {first_block + j}: payload of {block.numel() * block.element_size()} B, "
                    f"layout wants {want} B"
                )
        return self._store_blocks(
            tokens,
            namespace,
            first_block,
            len(blocks),
            lambda i, out: out.copy_(blocks[i - first_block].reshape(-1).view(torch.uint8)),
        )

    def _store_blocks(
        self,
        tokens: Sequence[int] | np.ndarray,
        namespace: str | None,
        first_block: int,
        num_blocks: int,
        fill: Callable[[int, torch.Tensor], object],
    ) -> int:
        """Store blocks ``first_block ..`` as plans of at most half the host tier; ``fill(i, out)`` writes block i."""
        keys = self.hasher.keys(tokens, namespace or self.config.cache.namespace)
        digests = self.hasher.digests(keys, tokens)
        last = min(len(keys), first_block + num_blocks)
        chunk = max(1, self.host.capacity_blocks // 2)
        stored, i = 0, first_block
        while i < last:
            plan = self._prepare(keys, digests, i, min(last, i + chunk))
            try:
                for buf, b in zip(plan.buffers, plan.block_indices, strict=True):
                    fill(b, buf)
            except BaseException:
                self.complete_store(plan, success=False)
                raise
            stored += self.complete_store(plan, success=True)
            if plan.next_block == i:
                break  # no progress: host is pinned full, or a key holds other tokens
            i = plan.next_block
        return stored

    def store(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Sequence[torch.Tensor] | torch.Tensor,
        namespace: str | None = None,
        *,
        first_block: int = 0,
    ) -> JobId:
        """Asynchronous :meth:`store_now` on the transfer worker; the engine's step never waits.

        ``blocks`` must stay unchanged until :meth:`poll` reports the job done.
        """
        tokens = np.array(tokens, dtype=np.int32)  # the caller may reuse its list
        return self.worker.submit(lambda: self.store_now(tokens, blocks, namespace, first_block=first_block))

    def store_from(
        self,
        tokens: Sequence[int] | np.ndarray,
        fill: Callable[[int, torch.Tensor], object],
        namespace: str | None = None,
        *,
        first_block: int = 0,
        num_blocks: int,
    ) -> JobId:
        """Asynchronous store whose payloads are copied on the transfer thread by ``fill(i, out)``.

        ``fill`` writes block ``i``'s payload straight into its reserved host
        slot ``out``: an engine passes a copy out of its own pool, so storing
        costs its step no copy at all. Whatever ``fill`` reads must stay
        unchanged until :meth:`poll` reports the job done.
        """
        tokens = np.array(tokens, dtype=np.int32)
        return self.worker.submit(lambda: self._store_blocks(tokens, namespace, first_block, num_blocks, fill))

    # -- named blocks -----------------------------------------------------------
    # Payloads an engine names itself (a llama.cpp state in chunks, an SGLang
    # page by its own hash): each is one block of ``layout.block_bytes`` in the
    # same tiers, keyed by :meth:`KeyHasher.named`, confirmed by its digest, and
    # independent of every other (no parent: a named block is never part of a chain).
    def _named(self, names: Sequence[bytes], namespace: str) -> tuple[list[BlockKey], NamedDigests]:
        names = [bytes(n) for n in names]
        keys = [self.hasher.named(n, namespace) for n in names]
        return keys, self.hasher.named_digests(keys, names)

    def _record(self, key: BlockKey) -> BlockRecord | None:
        """The record of the fastest tier that holds ``key`` (call with the lock held)."""
        for tier in self.tiers:
            record = tier.record(key)
            if record is not None:
                return record
        return None

    def named_exists(self, names: Sequence[bytes], namespace: str) -> list[bool]:
        """Which of ``names`` some tier holds, confirmed by digest; nothing is pinned or counted.

        Names no local tier holds are asked of the remote tier (one header
        read each, batched): another node may have stored them, and a caller
        that hears "absent" recomputes what it could have fetched.
        """
        keys, digests = self._named(names, namespace)
        with self._lock:
            records = [self._record(key) for key in keys]
        absent = [i for i, r in enumerate(records) if r is None]
        if self.remote is not None and absent:
            for i, record in zip(absent, self.remote.probe([keys[i] for i in absent]), strict=True):
                records[i] = record
        return [r is not None and r.matches(digests[i]) for i, r in enumerate(records)]

    def named_load(self, names: Sequence[bytes], namespace: str) -> LoadHandle:
        """Pin the leading ``names`` that are held, promoting disk and remote ones; stops at the first absent.

        Leading, like a token load: a caller's names are the chunks of one
        object, and a run with a gap is as useless to it as KV with a hole.
        ``blocks[i]`` is name ``i``'s payload (uint8, ``layout.block_bytes``).
        """
        keys, digests = self._named(names, namespace)
        with self._lock:
            probe = longest_prefix(keys, digests, self.tiers)
        if self.remote is not None and probe.reason is MissReason.ABSENT:
            probe = self._probe_remote(self.remote, keys, digests, probe, 0)
        with self._lock:
            for key, kind in zip(keys, probe.tiers, strict=False):
                if kind in self._policies:
                    self._policies[kind].on_access(key)
        if probe.mismatched is not None:
            self._stats(probe.mismatched).add(confirm_mismatch=1)
        result = LookupResult(namespace, self.layout.block_size, 0, tuple(keys), tuple(probe.tiers), probe.reason)
        return self.fetch(result, inline=True).take()

    def prepare_named_store(self, names: Sequence[bytes], namespace: str) -> StorePlan:
        """Reserve host slots for the ``names`` no tier holds yet, at most half the host tier at once.

        ``plan.block_indices`` are positions in ``names``; ``plan.next_block``
        is the first name the plan did not get to (host full, or the half
        reached): reserve again from there once this plan is completed.
        """
        keys, digests = self._named(names, namespace)
        stop = min(len(keys), max(1, self.host.capacity_blocks // 2))
        return self._prepare_named(keys, digests, 0, stop)

    def _prepare_named(self, keys: list[BlockKey], digests: NamedDigests, start: int, stop: int) -> StorePlan:
        plan = StorePlan([], [], [], [], next_block=start)
        with self._lock:
            # Held for this name, or (a 128-bit collision) for another: either way never reserved again.
            held = [self._record(keys[i]) is not None for i in range(start, stop)]
            self._make_room(self.host, held.count(False))
            for i, present in zip(range(start, stop), held, strict=True):
                if not present:
                    record = BlockRecord(digests[i], None)
                    buf = self.host.reserve(keys[i], record)
                    if buf is None:
                        break
                    plan.keys.append(keys[i])
                    plan.records.append(record)
                    plan.block_indices.append(i)
                    plan.buffers.append(buf)
                else:
                    plan.already_cached += 1
                plan.next_block = i + 1
        return plan

    def named_store_from(
        self, names: Sequence[bytes], fill: Callable[[int, torch.Tensor], object], namespace: str
    ) -> int:
        """Store the ``names`` no tier holds: ``fill(i, out)`` writes name ``i``'s payload into its host slot.

        Synchronous, in plans of at most half the host tier (so an object
        larger than host memory still lands whole, its earlier chunks going
        down to disk). Returns how many were newly stored; a name already
        held is neither reserved nor filled.
        """
        keys, digests = self._named(names, namespace)
        chunk = max(1, self.host.capacity_blocks // 2)
        stored, i = 0, 0
        while i < len(keys):
            plan = self._prepare_named(keys, digests, i, min(len(keys), i + chunk))
            try:
                for buf, b in zip(plan.buffers, plan.block_indices, strict=True):
                    fill(b, buf)
            except BaseException:
                self.complete_store(plan, success=False)
                raise
            stored += self.complete_store(plan, success=True)
            if plan.next_block == i:
                break  # host is pinned full
            i = plan.next_block
        return stored

    def poll(self, job: JobId) -> JobStatus:
        return self.worker.poll(job)

    def wait(self, job: JobId) -> Any:
        return self.worker.wait(job)

    # -- eviction and demotion (call with the lock held) -----------------------
    def _make_room(self, tier: Tier, n: int) -> bool:
        """Evict (demoting host victims) until ``n`` slots are free or nothing more may go."""
        short = n - tier.free_blocks()
        if short <= 0:
            return True
        exclude = self._host_exclude() if tier.kind is TierKind.HOST else frozenset()
        protect = self.protect if tier is self.host else None
        policy = self._policies[tier.kind]
        victims = policy.ranked_victims(short, exclude, protect(tier.capacity_blocks) if protect else NO_PROTECTION)
        self.evictions.record(victims, tier.kind, policy.name, self._clock())
        if tier is self.host:
            self._demote(victims)
        tier.remove_many(victims)
        for key in victims:
            policy.on_remove(key)
        tier.stats.add(evictions=len(victims))
        return len(victims) == short

    def _demote(self, victims: list[BlockKey]) -> None:
        """Write-back: host victims go down to disk unless disk already has them (and to the remote, by config).

        This runs under the lock (the victims' slots are about to be freed, so
        they cannot be pinned and written later); it is the one place where
        disk I/O holds the lock, and only when host memory is full. The
        remote gets copies on its queue, never a network call here.
        """
        remote = self.remote
        if remote is not None and remote.write_on is RemoteWriteOn.HOST_EVICTION and victims:
            out = [(k, r) for k in victims if (r := self.host.record(k)) is not None]
            remote.put_many([k for k, _ in out], [self.host.view(k) for k, _ in out], [r for _, r in out])  # type: ignore[misc]
        disk = self.disk
        if disk is None or self.write_mode is not WriteMode.WRITE_BACK:
            return
        down = [(k, r) for k in victims if not disk.contains(k) and (r := self.host.record(k)) is not None]
        if not down:
            return
        self._make_room(disk, min(len(down), disk.capacity_blocks))
        ok = disk.put_many([k for k, _ in down], [self.host.view(k) for k, _ in down], [r for _, r in down])
        self._index_disk(down, ok)
        self.host.stats.add(demotions=sum(ok))

    def _index_disk(self, written: list[tuple[BlockKey, BlockRecord]], ok: list[bool]) -> None:
        policy = self._policies[TierKind.DISK]
        for (key, record), stored in zip(written, ok, strict=True):
            if stored and key not in policy:
                policy.on_insert(key, record.parent)

    # -- block events ----------------------------------------------------------
    def observe(self, sink: BlockEventSink) -> None:
        """Tell ``sink`` of every key that enters or leaves a tier from now on, after the keys held now.

        The policies hear of every insert and removal already, so the sink
        listens beside them (:class:`ObservedPolicy`); under the lock, so no
        change slips between the keys reported now and the first event.
        """
        with self._lock:
            for tier in self.tiers:
                sink.stored(tier.kind, [k for k, _ in tier.entries()])
                self._policies[tier.kind] = ObservedPolicy(self._policies[tier.kind], tier.kind, sink)

    # -- admin -------------------------------------------------------------------
    def clear(self, kind: TierKind | None = None) -> int:
        """Drop every unpinned block of one tier (or all); returns how many."""
        dropped = 0
        with self._lock:
            for tier in self.tiers:
                if kind is not None and tier.kind is not kind:
                    continue
                keys = [k for k, _ in tier.entries() if not (tier is self.host and k in self._pins)]
                dropped += tier.remove_many(keys)
                for key in keys:
                    self._policies[tier.kind].on_remove(key)
        return dropped

    def _stats(self, kind: TierKind) -> TierStats:
        return next(t.stats for t in self._every_tier if t.kind is kind)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for tier in self.tiers:
            snap = tier.stats.snapshot()
            snap.update(
                capacity_bytes=tier.capacity_blocks * tier.slot_bytes,
                used_bytes=(tier.capacity_blocks - tier.free_blocks()) * tier.slot_bytes,
                blocks=len(tier),
                capacity_blocks=tier.capacity_blocks,
            )
            out[tier.kind.value] = snap
        if self.remote is not None:
            sizes = {"capacity_bytes": 0, "used_bytes": 0, "capacity_blocks": 0, "blocks": 0}  # a shared store's
            out["remote"] = {**self.remote.snapshot(), **sizes}
        with self._lock:
            out["pinned_blocks"] = len(self._pins)
        out["break_even"] = self.costs.snapshot()
        return out

    def flush(self, deadline_s: float | None = None) -> int:
        """Write-back: copy every host block that disk lacks down to disk; returns how many were written.

        Host memory dies with the process; this is what makes a write-back
        cache survive a clean shutdown (a crash loses only the unflushed
        blocks, which are then misses, never wrong KV). The most recently
        stored blocks go first, and no new batch starts after ``deadline_s``
        seconds (None: no limit): a supervisor's stop timeout must not turn a
        planned restart into a SIGKILL halfway through the index.
        """
        disk = self.disk
        if disk is None or self.write_mode is not WriteMode.WRITE_BACK:
            return 0
        until = None if deadline_s is None else time.monotonic() + deadline_s
        with self._lock:
            dirty = [(k, r) for k, r in self.host.entries() if not disk.contains(k)][::-1]
            self._pins.update(k for k, _ in dirty)
        try:
            written = 0
            for start in range(0, len(dirty), 64):
                if until is not None and time.monotonic() >= until:
                    break
                batch = dirty[start : start + 64]
                with self._lock:
                    self._make_room(disk, min(len(batch), disk.capacity_blocks))
                ok = disk.put_many([k for k, _ in batch], [self.host.view(k) for k, _ in batch], [r for _, r in batch])
                with self._lock:
                    self._index_disk(batch, ok)
                written += sum(ok)
        finally:
            with self._lock:
                self._pins.subtract(k for k, _ in dirty)
                self._pins += Counter()
        return written

    def close(self, flush_s: float | None = None) -> None:
        """Finish pending transfers, flush write-back blocks to disk (for at most ``flush_s``), close the tiers.

        Idempotent: a server closes its cache on shutdown and again on its way out.
        """
        if self._closed:
            return
        self._closed = True
        self.worker.shutdown()
        self.flush(flush_s)
        for tier in self._every_tier:
            tier.close()

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(self.config.cache.flush_on_exit_s)


__all__ = ["CacheManager", "LoadHandle", "LookupResult", "MissReason", "StorePlan"]
