"""The cache manager: what an engine calls, combining keys, index, tiers, policies and transfers.

Engines talk to kvtier through this class (steps ②, ③ and ⑤ of the data
path), with a request's :class:`~kvtier.keys.KeyedTokens` made once by
:meth:`CacheManager.keyed`: :meth:`CacheManager.lookup` says how many
leading tokens are cached and where; :meth:`CacheManager.fetch` and
:meth:`CacheManager.load` promote them to host memory and pin them for the
engine to copy; :meth:`CacheManager.store` offers new full blocks.

The jobs live beside it, one module each, sharing one :class:`TierSet`
(the tiers and their lock): :mod:`kvtier.promote` moves blocks up,
:mod:`kvtier.store` writes new ones (two-phase), :mod:`kvtier.evict` makes
room and demotes, :mod:`kvtier.pins` says what must stay. This class looks
things up and wires the rest.

Invariants:

* Metadata (tier indexes, policies, pins) changes only under the tier set's
  lock. Payload copies in and out of host slots run outside it; a slot being
  read is pinned (ref-counted) so eviction cannot free it, and a slot being
  filled is reserved and invisible until committed.
* Host is the tier every block passes through: a fetch pins blocks there
  for the engine to copy into its own pool (the device tier, which the
  engine indexes itself), and a store commits there before anything below
  gets a copy. Which tiers below get one, and when, is
  :class:`~kvtier.writes.WritePolicy`'s to say.
* The remote tier (``self.remote``, shared with other nodes) is consulted
  last, only for the blocks after the local run, and never holds the lock
  while it talks to the network. It has no policy of ours: Redis expires its
  blocks by TTL. Blocks go out to it behind the request (its own writer
  thread), on store or on host eviction (``remote.write_on``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvtier.breakeven import BreakEvenModel
from kvtier.cache import Promotion
from kvtier.config import Config
from kvtier.events import BlockEventSink, HeldKeys
from kvtier.evict import Eviction
from kvtier.explain import EvictionLog, Explanation, diagnose
from kvtier.fetch import Fetch, LoadHandle
from kvtier.index import LookupResult, MissReason
from kvtier.keys import BlockKey, KeyedTokens, KeyHasher, NamedDigests, Secret
from kvtier.layout import KVLayout
from kvtier.lookup import Lookups
from kvtier.pins import Pins
from kvtier.policy import make_policy
from kvtier.policy.base import Protection
from kvtier.promote import Promoter
from kvtier.stats import CacheStats
from kvtier.store import Fill, Payloads, StorePlan, Stores
from kvtier.tiers.base import Tier, TierKind
from kvtier.tierset import open_tiers
from kvtier.transfer import JobId, JobStatus, TransferWorker
from kvtier.writes import WritePolicy

if TYPE_CHECKING:
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.remote import RemoteTier

log = logging.getLogger("kvtier")
T = TypeVar("T")


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a start-up builds an object per indexed block.

    A reopened disk tier mirrors every record, and the policies get an
    entry per block: millions of objects, none in a cycle, each allocation
    counted towards the next collection, and each full collection walking
    all of them again (a quarter of the start-up over 10^6 blocks, measured by
    ``kvtier bench scale``). Restored as it was, whatever happens.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


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
        with collector_paused():
            self._tiers = open_tiers(config, layout, self.hasher.secret, model_fingerprint, host_file)
        # By name for operators, tests and reports; the data path below walks the tier set's lists.
        self.host = self._tiers.host
        self.disk: DiskTier | None = self._tiers.find(TierKind.DISK)  # type: ignore[assignment]
        self.remote: RemoteTier | None = self._tiers.find(TierKind.REMOTE)  # type: ignore[assignment]
        self.tiers: list[Tier] = self._tiers.local
        self._evicts = frozenset(t.kind for t in self.tiers)  # the tiers a TTL pin can protect
        self._lock = self._tiers.lock
        self._clock = clock
        self._pins = Pins(clock)
        policies = {TierKind.HOST: make_policy(config.host.policy), TierKind.DISK: make_policy(config.disk.policy)}
        remote_on = None if self.remote is None else self.remote.write_on
        self.writes = WritePolicy(config.cache.write_mode, remote_on)
        with collector_paused():  # the policies hear of every block the tiers reopened with
            self.eviction = Eviction(
                self._tiers, policies, self._pins, EvictionLog(config.session.eviction_log), self.writes, clock
            )
        self.worker = TransferWorker(config.transfer.workers)
        self.costs = BreakEvenModel(
            layout.block_size, layout.block_bytes, deadline_slack=config.transfer.deadline_slack
        )
        self.lookups = Lookups(self._tiers, self.eviction, layout.block_size)
        self.promoter = Promoter(self._tiers, self.eviction, self._pins, self.worker, self.costs, layout)
        self.stores = Stores(self._tiers, self.eviction, self._pins, layout, self.writes)
        self._closed = False
        self.generation = 0  # bumped by clear(): what an engine kept resident is no longer known stored here

    def protect(self, protection: Callable[[int], Protection] | None) -> None:
        """Host capacity -> the keys to keep (live agent sessions); None: nothing protected."""
        self.eviction.protect = protection

    def session_turn(self, prompt: KeyedTokens, session_id: str) -> list[BlockKey]:
        """The keys the session registry protects in this process's host tier: the transcript's own."""
        return self._own(prompt).keys

    # -- ① keys, once per request -------------------------------------------------------------------
    def keyed(self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None) -> KeyedTokens:
        """``tokens`` with their block keys, to pass to every call below for the same request."""
        return self.hasher.keyed(tokens, namespace or self.config.cache.namespace)

    def keys(self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None) -> list[BlockKey]:
        return self.hasher.keys(tokens, namespace or self.config.cache.namespace)

    def _own(self, prompt: KeyedTokens) -> KeyedTokens:
        if prompt.hasher is not self.hasher:
            raise ValueError("these keys were made by another hasher (another secret): they could only miss")
        return prompt

    # -- ② lookup ------------------------------------------------------------
    def lookup(self, prompt: KeyedTokens, *, first_block: int = 0) -> LookupResult:
        """How many leading tokens are cached, confirmed against the prompt's tokens, and in which tier.

        ``first_block`` skips blocks the caller already holds (an engine's own
        pool): probing, stats and the result start there.
        """
        return self.lookups.lookup(self._own(prompt), first_block)

    def probe(self, prompt: KeyedTokens, *, first_block: int = 0) -> LookupResult:
        """What :meth:`lookup` would answer, without touching policies or stats.

        For operators (the server's admin ``/lookup``): looking must not alter
        the cache looked at. Hits are confirmed and the remote tier asked, as
        a lookup would. Also for a load that follows a lookup made elsewhere
        (the cache service's, after a client's scheduler looked up): that
        lookup counted the traffic once already.
        """
        return self.lookups.probe(self._own(prompt), first_block)

    def explain(
        self, prompt: KeyedTokens, *, own_namespaces: Sequence[str] = (), diverged_at: int | None = None
    ) -> Explanation:
        """What a request would hit and why the run stops (see :mod:`kvtier.explain`); a probe, not traffic.

        ``own_namespaces`` are the caller's other namespaces, the only ones
        probed besides the prompt's: another tenant's must never be asked.
        Each is keyed anew, since the namespace enters every key.
        """
        others = [self.probe(self.keyed(prompt.tokens, ns)) for ns in own_namespaces if ns != prompt.namespace]
        result = self.probe(prompt)
        return diagnose(result, self.eviction.log, others=others, diverged_at=diverged_at, now=self._clock())

    def prefetch(self, prompt: KeyedTokens, *, session_id: str | None = None) -> Promotion:
        """Promote the cached blocks of ``prompt`` to host memory now.

        For a session about to speak again (its tool call is returning): the
        reads happen during the pause instead of in its next turn's TTFT.
        Nothing stays pinned; every block the load pinned was in host when it
        ended, so that run is ``host_blocks``, with no second lookup. The
        session (``session_id``) is this process's registry's business, made
        live before this call.
        """
        with self.load(self.lookup(prompt)) as handle:
            return Promotion.of(handle, self.layout.block_size)

    # -- ③ fetch and load ----------------------------------------------------------
    def load(self, result: LookupResult, *, start: int | None = None, max_blocks: int | None = None) -> LoadHandle:
        """:meth:`fetch` run to the end on this thread: cached blocks ``start ..`` pinned in host memory.

        The handle stops at the first block that can no longer be served: the
        engine recomputes from there. Release it with :meth:`complete_load`
        (or the handle's ``with``).
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
        """Start pinning blocks ``start ..`` in host memory (:meth:`Promoter.fetch`); take them with ``Fetch.take``."""
        return self.promoter.fetch(result, start=start, max_blocks=max_blocks, deadline_s=deadline_s, inline=inline)

    @property
    def load_chunk(self) -> int:
        """Blocks one load should ask for so that several can be pinned at once (a larger prefix goes in pieces)."""
        return max(1, self.host.capacity_blocks // 4)

    def complete_load(self, handle: LoadHandle) -> None:
        """Unpin a load's blocks; after this their host slots may be evicted and reused."""
        self.promoter.release(handle)

    def pinned(self, key: BlockKey) -> int:
        with self._lock:
            return self._pins.count(key)

    def pin_for(self, prompt: KeyedTokens, ttl_s: float, *, tier: TierKind = TierKind.HOST) -> int:
        """Keep the full blocks of ``prompt`` out of ``tier``'s eviction for ``ttl_s`` seconds (0: unpin); how many.

        Cached or not yet (see :mod:`kvtier.pins`); :meth:`clear` ignores
        them: an explicit clear means clear. A tier this cache does not
        evict (none here, or the remote) pins nothing: 0.

        A promise (``ttl_s > 0``, either tier) is written through: the
        blocks in host now are copied to disk before this returns, whatever
        ``cache.write_mode``, and those stored later as they are stored
        (:class:`~kvtier.writes.Moment` ``RETAINED``). A renewal (every
        request that reuses a kept prefix renews it) copies only the blocks
        no live pin covered before: the others were written then.
        """
        if tier not in self._evicts:
            return 0
        keys = self._own(prompt).keys
        with self._lock:
            fresh = self._pins.keep(keys, ttl_s, tier)
        if fresh:
            self.stores.retain(fresh)
        return len(keys)

    def ttl_pinned(self) -> int:
        """Keys under a live TTL pin (cached or not)."""
        with self._lock:
            return self._pins.kept()

    # -- ⑤ store -----------------------------------------------------------------
    def store(
        self, prompt: KeyedTokens, payloads: Payloads, *, first_block: int = 0, num_blocks: int | None = None
    ) -> int:
        """Store the full blocks ``first_block ..`` of ``prompt`` not yet cached; returns how many were new.

        ``payloads[j]`` is block ``first_block + j``'s payload, or a
        :data:`~kvtier.store.Fill` writing block ``i`` straight into its host
        slot, for ``num_blocks`` blocks (default: to the prompt's last).
        Synchronous: an engine runs it on :attr:`worker` so its step never
        waits, and keeps what it reads unchanged until :meth:`poll` says done.
        """
        return self.stores.store(self._own(prompt), payloads, first_block, num_blocks)

    def prepare_store(self, prompt: KeyedTokens, *, first_block: int = 0, num_blocks: int | None = None) -> StorePlan:
        """Reserve host slots for blocks ``first_block ..`` not yet cached (:meth:`Stores.prepare`); fill, complete."""
        last = prompt.num_blocks if num_blocks is None else min(prompt.num_blocks, first_block + num_blocks)
        return self.stores.prepare(self._own(prompt), first_block, last)

    def complete_store(self, plan: StorePlan, success: bool) -> int:
        """Publish (``success``) or discard the plan's blocks; returns how many were indexed."""
        return self.stores.complete(plan, success)

    def withdraw_store(self, plan: StorePlan) -> list[int]:
        """Discard a plan whose filler may still write into its slots: they stay withheld; their numbers.

        Hand them to :meth:`release_withheld` once that filler can no longer
        write (the cache service: when its client's connection ends).
        """
        return self.stores.withdraw(plan)

    def release_withheld(self, slots: Sequence[int]) -> None:
        self.stores.release(slots)

    def poll(self, job: JobId) -> JobStatus:
        return self.worker.poll(job)

    def wait(self, job: JobId) -> Any:
        return self.worker.wait(job)

    # -- named blocks -----------------------------------------------------------
    # Payloads an engine names itself (a llama.cpp state in chunks, an SGLang
    # page by its own hash): each is one block of ``layout.block_bytes`` in the
    # same tiers, keyed by :meth:`KeyHasher.named`, confirmed by its digest, and
    # independent of every other (no parent: a named block is never part of a chain).
    def _named(self, names: Sequence[bytes], namespace: str) -> tuple[list[BlockKey], NamedDigests]:
        names = [bytes(n) for n in names]
        keys = [self.hasher.named(n, namespace) for n in names]
        return keys, self.hasher.named_digests(keys, names)

    def named_exists(self, names: Sequence[bytes], namespace: str) -> list[bool]:
        """Which of ``names`` some tier holds, confirmed by digest; nothing is pinned or counted.

        Names no local tier holds are asked of the remote tier (one header
        read each, batched): another node may have stored them, and a caller
        that hears "absent" recomputes what it could have fetched.
        """
        return self.lookups.exists(*self._named(names, namespace))

    def named_load(self, names: Sequence[bytes], namespace: str) -> LoadHandle:
        """Pin the leading ``names`` that are held, promoting disk and remote ones; stops at the first absent.

        Leading, like a token load: a caller's names are the chunks of one
        object, and a run with a gap is as useless to it as KV with a hole.
        ``blocks[i]`` is name ``i``'s payload (uint8, ``layout.block_bytes``).
        """
        keys, digests = self._named(names, namespace)
        return self.fetch(self.lookups.named(keys, digests, namespace), inline=True).take()

    def prepare_named_store(self, names: Sequence[bytes], namespace: str) -> StorePlan:
        """Reserve host slots for the ``names`` no tier holds yet, at most half the host tier at once.

        ``plan.block_indices`` are positions in ``names``; ``plan.next_block``
        is the first name the plan did not get to (host full, or the half
        reached): reserve again from there once this plan is completed.
        """
        keys, digests = self._named(names, namespace)
        return self.stores.prepare_named(keys, digests, 0, min(len(keys), self.stores.plan_blocks))

    def named_store_from(self, names: Sequence[bytes], fill: Fill, namespace: str) -> int:
        """Store the ``names`` no tier holds: ``fill(i, out)`` writes name ``i``'s payload into its host slot.

        Synchronous, in plans of at most half the host tier (so an object
        larger than host memory still lands whole, its earlier chunks going
        down to disk). Returns how many were newly stored; a name already
        held is neither reserved nor filled.
        """
        return self.stores.store_named(*self._named(names, namespace), fill)

    # -- operators -------------------------------------------------------------------
    def observe(self, sink: BlockEventSink) -> bool:
        """Tell ``sink`` of every key that enters or leaves a tier from now on (see :meth:`Eviction.observe`)."""
        with self._lock:
            self.eviction.observe(sink)
        return True

    def follow(self, held: HeldKeys) -> bool:
        """``held`` hears of every change to the tiers and lists their keys from the tiers' own indexes when asked."""
        with self._lock:
            self.eviction.observe(held, announce=False)
            held.list_from([tier.kind for tier in self._tiers.local], self._listed)
        return True

    def _listed(self, then: Callable[[dict[TierKind, list[BlockKey]]], T]) -> T:
        """``then`` of every key each local tier holds, under the lock their changes and events happen under."""
        with self._lock:
            return then({tier.kind: tier.keys() for tier in self._tiers.local})

    def clear(self, kind: TierKind | None = None, namespace: str | None = None) -> int:
        """Drop every unpinned block of one tier (or all), or only ``namespace``'s; returns how many.

        The remote tier is shared and never cleared from here.
        """
        root = None if namespace is None else self.hasher.root(namespace)
        with self._lock:
            self.generation += 1
            return self.eviction.clear(kind, root)

    def stats(self) -> CacheStats:
        with self._lock:
            pinned = len(self._pins)
        return CacheStats(tiers=self._tiers.report(), pinned_blocks=pinned, break_even=self.costs.snapshot())

    def flush(self, deadline_s: float | None = None) -> int:
        """Write-back: copy every host block that disk lacks down to disk (see :meth:`Stores.flush`); how many."""
        return self.stores.flush(deadline_s)

    def close(self, flush_s: float | None = None) -> None:
        """Finish pending transfers, flush write-back blocks to disk (for at most ``flush_s``), close the tiers.

        Idempotent: a server closes its cache on shutdown and again on its way out.
        """
        if self._closed:
            return
        self._closed = True
        self.worker.shutdown()
        self.flush(flush_s)
        for tier in self._tiers.every:
            tier.close()

    def __enter__(self) -> CacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(self.config.cache.flush_on_exit_s)


__all__ = ["CacheManager", "KeyedTokens", "LoadHandle", "LookupResult", "MissReason", "StorePlan"]
