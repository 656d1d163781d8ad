"""The built-in engine's cache when it lives in the node's cache service (``cache.service: unix:///path``).

One of the two implementations of :class:`kvtier.cache.Cache` (the other is
the embedded :class:`~kvtier.manager.CacheManager`), so two ``kvtier
serve`` instances on one machine share one cache: turn 2 of a session sent
to the second instance finds the blocks the first one stored.

What differs, and why:

* A fetch started on arrival is one ``Load`` round trip on a second
  connection, run by a thread of this process, so the engine's own
  connection stays free for lookups and the engine thread never waits on the
  disk: the service promotes what it can before the fetch's deadline and
  answers with what landed; admission takes that answer.
* The engine's own resident-pool index keys blocks with a process-local
  secret: those keys never leave the process, and the service computes the
  shared ones from the tokens, keeping the deployment secret to itself.
* The reload-vs-recompute model is the engine's own: it is fed by this
  process's forwards.
* Both connections are :class:`~kvtier.service.link.ServiceLink` s: a
  service that is not up yet, or restarts, is a miss until it answers, and
  is used again from the first call after that; this process never needs a
  restart for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvtier.breakeven import BreakEvenModel
from kvtier.cache import Promotion
from kvtier.config import Config
from kvtier.events import BlockEventSink, HeldKeys
from kvtier.explain import Eviction, ExplainReason, Explanation
from kvtier.index import LookupResult, MissReason
from kvtier.keys import KeyedTokens, KeyHasher
from kvtier.layout import KVLayout
from kvtier.policy.base import PolicyName, Protection
from kvtier.service import protocol as p
from kvtier.service.client import CacheClient, ClientLoad
from kvtier.service.link import ServiceLink
from kvtier.service.protocol import to_wire
from kvtier.stats import CacheStats, LinkSnapshot
from kvtier.store import Payloads
from kvtier.tiers.base import TierKind
from kvtier.transfer import JobId, JobStatus, TransferWorker


@dataclass(frozen=True)
class ServiceLookup(LookupResult):
    """A lookup answered by the service, carrying the prompt whose tokens a load of it must send again."""

    prompt: KeyedTokens | None = None


@dataclass(frozen=True)
class ServiceTier:
    """A tier the service runs, named for the server's reports (the bytes are the service's)."""

    kind: TierKind


class ServiceFetch:
    """A fetch in flight at the service: what :class:`~kvtier.fetch.Fetch` offers the engine, over one round trip."""

    def __init__(self, future: Future[ClientLoad], first_block: int, wanted: int) -> None:
        self._future = future
        self.first_block = first_block
        self.wanted = wanted
        self.missed_deadline = False

    def take(self, extend: Callable[[int, float], float] | None = None) -> ClientLoad:
        """The blocks the service pinned before the deadline it was given (it, not this process, keeps the time)."""
        load = self._future.result()
        self.missed_deadline = len(load.blocks) < self.wanted
        return load

    def cancel(self) -> None:
        """Nobody will copy these blocks: release them now, or as soon as the service answers."""
        self._future.add_done_callback(lambda f: f.result().release())


def _lookup_of(r: p.LookupReply | p.Explained) -> tuple[tuple[TierKind, ...], MissReason]:
    """A reply's tiers and miss reason as the core's enums."""
    return tuple(p.all_to(TierKind, r.tiers)), to_wire(MissReason, r.miss_reason)


def _nothing(first_block: int) -> ClientLoad:
    return ClientLoad(first_block, [], [], lambda: None)


class ServiceCache:
    def __init__(
        self,
        socket_path: Path,
        config: Config,
        layout: KVLayout,
        *,
        model_fingerprint: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Connects at once (a refusal raises: another model or layout); a service not up yet is a miss until it is.

        ``clock`` tells when a failed connection is tried again (tests step it).
        """
        self.config = config
        self.layout = layout
        self._failures = 0
        self._count_lock = threading.Lock()

        def link() -> ServiceLink:
            retry = config.cache.service_retry_s
            fp, count = model_fingerprint, self._count
            return ServiceLink(socket_path, layout, fp, count_failures=count, retry_s=retry, clock=clock)

        self.link = link()
        self._prefetcher = link()  # a second connection: fetches run on it while the engine looks things up
        self.link.open()
        self._fetches = ThreadPoolExecutor(1, thread_name_prefix="kvtier-service-fetch")
        self.hasher = KeyHasher.process_local(layout.descriptor, layout.block_size)
        self.costs = BreakEvenModel(
            layout.block_size, layout.block_bytes, deadline_slack=config.transfer.deadline_slack
        )
        self.worker = TransferWorker(1)  # stores run off the engine's step, as embedded
        self._welcome: p.Welcome | None = None
        self._cleared = 0
        self._last_stats = CacheStats()
        self.stats()

    def _count(self, n: int) -> None:
        with self._count_lock:
            self._failures += n

    def _client(self) -> CacheClient | None:
        """The engine connection's live client (None: a miss); remembers what the service said it is."""
        client = self.link.client()
        if client is not None:
            self._welcome = client.welcome
        return client

    @property
    def generation(self) -> int:
        """Changes when the blocks this process stored may be gone: a new connection (a restarted service), a clear.

        A restarted service lost the old one's host slab (its disk tier may
        have kept some), so the engine offers its resident blocks again and
        the service takes those it lacks (:mod:`kvtier.engine.resident`).
        """
        return self.link.connects + self._cleared

    @property
    def tiers(self) -> list[ServiceTier]:
        """The tiers the service ran when it last answered."""
        return [ServiceTier(kind) for kind in (TierKind.HOST, TierKind.DISK) if kind.value in self._last_stats.tiers]

    @property
    def load_chunk(self) -> int:
        """Blocks one load asks for, so that several loads can hold pins at once (as embedded)."""
        w = self._welcome
        return 1 if w is None else max(1, w.slab_bytes // w.slot_bytes // 4)

    def keyed(self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None) -> KeyedTokens:
        """``tokens`` keyed for this process (its resident pool); the service keys them again with its own secret."""
        return self.hasher.keyed(tokens, namespace or self.config.cache.namespace)

    # -- the data path ------------------------------------------------------------------------------
    def lookup(self, prompt: KeyedTokens, *, first_block: int = 0) -> ServiceLookup:
        c = self._client()
        r = (
            p.LookupReply(first_block, [], p.Miss.ABSENT)
            if c is None
            else c.lookup(prompt.tokens, prompt.namespace, first_block=first_block)
        )
        bs, ns = self.layout.block_size, prompt.namespace
        tiers, miss = _lookup_of(r)
        return ServiceLookup(ns, bs, len(prompt), tuple(prompt.keys), tiers, miss, first_block, prompt=prompt)

    def probe(self, prompt: KeyedTokens) -> LookupResult:
        c = self._client()
        r = p.LookupReply(0, [], p.Miss.ABSENT) if c is None else c.probe(prompt.tokens, prompt.namespace)
        bs, ns = self.layout.block_size, prompt.namespace
        return LookupResult(ns, bs, len(prompt), tuple(prompt.keys), *_lookup_of(r))

    def load(self, result: LookupResult, *, start: int | None = None, max_blocks: int | None = None) -> ClientLoad:
        assert isinstance(result, ServiceLookup) and result.prompt is not None
        first = result.first_block if start is None else start
        c = self._client()
        if c is None:
            return _nothing(first)
        return c.load(result.prompt.tokens, result.namespace, start=first, max_blocks=max_blocks)

    def fetch(
        self,
        result: LookupResult,
        *,
        start: int | None = None,
        max_blocks: int | None = None,
        deadline_s: float | None = None,
    ) -> ServiceFetch:
        """Start pinning blocks ``start ..`` at the service; the engine takes them at admission."""
        assert isinstance(result, ServiceLookup) and result.prompt is not None
        tokens, ns = result.prompt.tokens, result.namespace
        first = result.first_block if start is None else start
        stop = result.cached_blocks if max_blocks is None else min(result.cached_blocks, first + max_blocks)

        def pin() -> ClientLoad:
            c = self._prefetcher.client()
            if c is None:
                return _nothing(first)
            return c.load(tokens, ns, start=first, max_blocks=stop - first, deadline_s=deadline_s)

        return ServiceFetch(self._fetches.submit(pin), first, stop - first)

    def store(
        self, prompt: KeyedTokens, payloads: Payloads, *, first_block: int = 0, num_blocks: int | None = None
    ) -> int:
        """:meth:`CacheManager.store` at the service: slots reserved there, filled here, committed by checksum."""
        c = self._client()
        if c is None:
            return 0
        ids, ns = prompt.tokens, prompt.namespace
        if callable(payloads):
            return c.store_from(ids, payloads, ns, first_block=first_block, num_blocks=num_blocks)
        return c.store(ids, list(payloads), ns, first_block=first_block)

    def poll(self, job: JobId) -> JobStatus:
        return self.worker.poll(job)

    def wait(self, job: JobId) -> Any:
        return self.worker.wait(job)

    # -- agent sessions and explain: the service's tiers, the service's evidence -----------------------
    def session_turn(self, prompt: KeyedTokens, session_id: str) -> tuple[()]:
        """The session spoke: the service keys its transcript and protects it in the host tier it runs.

        So this process's registry protects nothing itself (no keys back).
        """
        c = self._client()
        if c is not None:
            c.session_turn(prompt.namespace, session_id, prompt.tokens)
        return ()

    def protect(self, protection: Callable[[int], Protection] | None) -> None:
        """Nothing to steer here: the service's host tier is steered by its own session registry."""

    def prefetch(self, prompt: KeyedTokens, *, session_id: str | None = None) -> Promotion:
        """:meth:`CacheManager.prefetch` at the service; with ``session_id`` it also makes the session live there."""
        c = self._client()
        if c is None:
            return Promotion({}, 0)
        if session_id is None:
            with self.load(self.lookup(prompt)) as handle:
                return Promotion.of(handle, self.layout.block_size)
        reply = c.session_prefetch(prompt.namespace, session_id, prompt.tokens)
        return Promotion({to_wire(TierKind, k): n for k, n in reply.promoted.items()}, reply.host_blocks)

    def explain(
        self, prompt: KeyedTokens, *, own_namespaces: Sequence[str] = (), diverged_at: int | None = None
    ) -> Explanation | None:
        """:meth:`kvtier.manager.CacheManager.explain`, answered by the service; None while it is unreachable."""
        ns = prompt.namespace
        c = self._client()
        r = None if c is None else c.explain(prompt.tokens, ns, own_namespaces=own_namespaces, diverged_at=diverged_at)
        if r is None:
            return None
        result = LookupResult(ns, self.layout.block_size, len(prompt), tuple(prompt.keys), *_lookup_of(r))
        evicted = None
        if r.eviction_tier is not None and r.eviction_policy is not None:
            tier, policy = to_wire(TierKind, r.eviction_tier), to_wire(PolicyName, r.eviction_policy)
            evicted = Eviction(tier, policy, at=0.0)  # the service's clock: the age says when
        reason = to_wire(ExplainReason, r.reason)
        return Explanation(
            result,
            reason,
            r.first_miss_token,
            evicted,
            r.other_namespace,
            diverged_at if reason in (ExplainReason.SESSION_DIVERGED, ExplainReason.EVICTED) else None,
            r.eviction_age_s,
        )

    # -- operators --------------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        """The service's figures; while it is unreachable, the last ones it gave (its failures are counted).

        The cost model is this process's own: it is what sizes this engine's fetches.
        """
        c = self._client()
        fresh = None if c is None else c.stats()
        if fresh is not None:
            self._last_stats = fresh
        with self._count_lock:
            failures = self._failures
        unreported = self.link.unreported_failures() + self._prefetcher.unreported_failures()
        link = LinkSnapshot(connected=fresh is not None, connects=self.link.connects, failures=failures + unreported)
        return msgspec.structs.replace(self._last_stats, service=link, break_even=self.costs.snapshot())

    def ttl_pinned(self) -> int:
        return self._last_stats.ttl_pinned_blocks

    def pin_for(self, prompt: KeyedTokens, ttl_s: float, *, tier: TierKind = TierKind.HOST) -> int:
        c = self._client()
        return 0 if c is None else c.pin(prompt.tokens, prompt.namespace, ttl_s, tier=tier)

    def observe(self, sink: BlockEventSink) -> bool:
        """The tiers are the service's, shared by every client: this process has no events of its own to tell."""
        return False

    def follow(self, held: HeldKeys) -> bool:
        return False

    def clear(self, kind: TierKind | None = None, namespace: str | None = None) -> int:
        c = self._client()
        self._cleared += 1
        return 0 if c is None else c.clear(kind, namespace)

    def close(self, flush_s: float | None = None) -> None:
        """Finish this process's stores; flushing the tiers is the service's job when it stops."""
        self.worker.drain()
        self.worker.shutdown()
        self._fetches.shutdown(wait=True)
        self._prefetcher.close()
        self.link.close()
