"""The cache seam: what the engine, the server and the connectors hold, whichever cache runs underneath.

Two implementations keep the same promises: :class:`~kvtier.manager.CacheManager`
(embedded: the tiers live in this process) and
:class:`~kvtier.service.cache.ServiceCache` (the tiers live in the node's cache
service, reached over a reconnecting :class:`~kvtier.service.link.ServiceLink`).
Code above the cache names only :class:`Cache` and the handles it returns,
never asks which one it has, and :func:`open_cache` is the one place that
picks. What differs between the two is said by the cache itself, not by a
type test: whether this process hears its tiers' block events
(:meth:`Cache.observe`), and which keys the process's own session registry
protects (:meth:`Cache.session_turn`).

Both return the same :class:`~kvtier.stats.CacheStats` (re-exported here),
which is also what the service sends for them and what ``/stats`` and
``/metrics`` read.

A connector inside another engine (vLLM, SGLang, llama.cpp) holds the cache
through this module too, in the form such an engine needs: that engine keeps
its own KV pool and runs its own prefill, so it asks the node's service by
tokens or by names and copies payloads through the shared host slab itself
(:class:`NodeService`), over the same reconnecting link
:class:`~kvtier.service.cache.ServiceCache` runs on (:func:`connect_service`).

The protocols are structural (``typing.Protocol``): an implementation never
inherits from them, so neither implementation's module is imported here
until :func:`open_cache` or :func:`connect_service` runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvtier.stats import CacheStats
from kvtier.tiers.base import TierKind

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    import torch

    from kvtier.breakeven import BreakEvenModel
    from kvtier.config import Config
    from kvtier.events import BlockEventSink, HeldKeys
    from kvtier.explain import Explanation
    from kvtier.index import LookupResult
    from kvtier.keys import BlockKey, KeyedTokens, KeyHasher
    from kvtier.layout import KVLayout
    from kvtier.policy.base import Protection
    from kvtier.service.protocol import LookupReply, Welcome
    from kvtier.store import Payloads
    from kvtier.transfer import JobId, JobStatus, TransferWorker


@dataclass(frozen=True)
class Promotion:
    """What a prefetch did: tokens moved up to host, by the tier they left, and the leading blocks in host now."""

    promoted: dict[TierKind, int]
    host_blocks: int

    @classmethod
    def of(cls, load: Loaded, block_size: int) -> Promotion:
        """A load that pinned a prefix in host: every block it served from below host was promoted on the way."""
        moved: dict[TierKind, int] = {}
        for kind in load.served_from:
            if kind is not TierKind.HOST:
                moved[kind] = moved.get(kind, 0) + block_size
        return cls(moved, len(load.blocks))


class Loaded(Protocol):
    """Cached blocks pinned in host memory for the engine to copy, until :meth:`release`.

    ``blocks[i]`` is block ``first_block + i``'s payload; ``served_from[i]``
    the tier it came from.
    """

    first_block: int
    blocks: list[torch.Tensor]
    served_from: list[TierKind]

    def release(self) -> None: ...

    def __enter__(self) -> Loaded: ...

    def __exit__(self, *exc: object) -> None: ...


class Fetching(Protocol):
    """A fetch started on a request's arrival; the engine takes what landed when it admits the request."""

    first_block: int
    wanted: int
    missed_deadline: bool

    def take(self, extend: Callable[[int, float], float] | None = None) -> Loaded: ...

    def cancel(self) -> None: ...


class TierView(Protocol):
    """A tier the cache runs, as the server's reports name it."""

    @property
    def kind(self) -> TierKind: ...


class Cache(Protocol):
    """Look up, fetch, load and store a request's blocks by its keyed tokens; the operators' calls beside them."""

    layout: KVLayout
    hasher: KeyHasher  # this process's keys: the engine's resident pool and its block events
    costs: BreakEvenModel  # fetch against recompute, fed by this process's forwards
    worker: TransferWorker  # stores run here, off the engine's step

    @property
    def generation(self) -> int:
        """Changes when blocks this process stored may be gone (a clear, a restarted service)."""
        ...

    @property
    def load_chunk(self) -> int:
        """Blocks one load should ask for, so that several loads can be pinned at once."""
        ...

    @property
    def tiers(self) -> Sequence[TierView]: ...

    # -- the data path ----------------------------------------------------------------------------
    def keyed(self, tokens: Sequence[int] | np.ndarray, namespace: str | None = None) -> KeyedTokens: ...

    def lookup(self, prompt: KeyedTokens, *, first_block: int = 0) -> LookupResult: ...

    def probe(self, prompt: KeyedTokens) -> LookupResult:
        """A lookup that changes nothing (no recency, no counters): for operators and explain."""
        ...

    def load(self, result: LookupResult, *, start: int | None = None, max_blocks: int | None = None) -> Loaded: ...

    def fetch(
        self,
        result: LookupResult,
        *,
        start: int | None = None,
        max_blocks: int | None = None,
        deadline_s: float | None = None,
    ) -> Fetching: ...

    def store(
        self, prompt: KeyedTokens, payloads: Payloads, *, first_block: int = 0, num_blocks: int | None = None
    ) -> int: ...

    def poll(self, job: JobId) -> JobStatus: ...

    def wait(self, job: JobId) -> Any: ...

    # -- sessions, explain ------------------------------------------------------------------------
    def session_turn(self, prompt: KeyedTokens, session_id: str) -> Sequence[BlockKey]:
        """A session spoke ``prompt``; returns the keys this process's session registry should protect.

        Embedded: the prompt's own keys (this process's host tier keeps
        them). Service: none here; the service keys the transcript and
        protects it in the host tier it runs.
        """
        ...

    def protect(self, protection: Callable[[int], Protection] | None) -> None:
        """Steer this process's host eviction by live sessions (a service's tier is steered there)."""
        ...

    def prefetch(self, prompt: KeyedTokens, *, session_id: str | None = None) -> Promotion:
        """Promote ``prompt``'s cached blocks to host memory now (the session's tool call is returning)."""
        ...

    def explain(
        self, prompt: KeyedTokens, *, own_namespaces: Sequence[str] = (), diverged_at: int | None = None
    ) -> Explanation | None: ...

    # -- operators --------------------------------------------------------------------------------
    def observe(self, sink: BlockEventSink) -> bool:
        """Tell ``sink`` of every key entering or leaving this process's tiers; False when they are not here."""
        ...

    def follow(self, held: HeldKeys) -> bool:
        """:meth:`observe` for a :class:`~kvtier.events.HeldKeys`, which lists the tiers' keys from them when asked."""
        ...

    def pin_for(self, prompt: KeyedTokens, ttl_s: float, *, tier: TierKind = TierKind.HOST) -> int:
        """Keep ``prompt``'s full blocks out of ``tier``'s eviction for ``ttl_s`` seconds (0: unpin); how many.

        ``tier``: host memory, or disk (the owned tier under it); a pin on a
        tier the cache does not run pins nothing and answers 0.
        """
        ...

    def ttl_pinned(self) -> int:
        """Keys under a live TTL pin of any tier (cached or not)."""
        ...

    def clear(self, kind: TierKind | None = None, namespace: str | None = None) -> int:
        """Drop every unpinned block of one local tier (None: all), or only ``namespace``'s; returns how many."""
        ...

    def stats(self) -> CacheStats: ...

    def close(self, flush_s: float | None = None) -> None: ...


def open_cache(config: Config, layout: KVLayout, *, model_fingerprint: str) -> Cache:
    """The cache ``config`` asks for: embedded, or a client of the node's service (``cache.service``)."""
    socket_path = config.cache.service_socket
    if socket_path is None:
        from kvtier.manager import CacheManager

        return CacheManager(config, layout, model_fingerprint=model_fingerprint)
    from kvtier.service.cache import ServiceCache

    return ServiceCache(socket_path, config, layout, model_fingerprint=model_fingerprint)


# -- the cache as a connector inside another engine holds it ----------------------------------------


class NamedBlocks(Protocol):
    """Blocks by name (SGLang's pages, llama.cpp's saved states): what a connector with its own keys asks for."""

    def named_exists(self, names: Sequence[bytes], namespace: str) -> list[bool]: ...

    def named_load(self, names: Sequence[bytes], namespace: str) -> Loaded:
        """Pin the leading held ``names``: ``blocks[i]`` is name ``i``'s payload, until released."""
        ...

    def named_store_from(
        self, names: Sequence[bytes], fill: Callable[[int, torch.Tensor], object], namespace: str
    ) -> int:
        """Store the ``names`` not held: ``fill(i, out)`` writes name ``i``'s payload into its slot; how many."""
        ...


class NodeService(NamedBlocks, Protocol):
    """The node's cache service, by tokens (it computes the keys with the deployment's secret) or by names.

    Loads are views of the shared host slab and stores fill slots of it,
    so the engine copies between its own pool and the slab once, with no
    payload on the socket.
    """

    welcome: Welcome  # what the service said at connect: its slab's size and slot size among it

    def lookup(self, tokens: Sequence[int] | np.ndarray, namespace: str, *, first_block: int = 0) -> LookupReply: ...

    def load(
        self,
        tokens: Sequence[int] | np.ndarray,
        namespace: str,
        *,
        start: int = 0,
        max_blocks: int | None = None,
        deadline_s: float | None = None,
    ) -> Loaded: ...

    def store_from(
        self,
        tokens: Sequence[int] | np.ndarray,
        fill: Callable[[int, torch.Tensor], object],
        namespace: str,
        *,
        first_block: int = 0,
        num_blocks: int | None = None,
    ) -> int: ...

    def stats(self) -> CacheStats | None: ...


class ServiceConnection(Protocol):
    """A link to the node's service that connects again by itself: a service away is a miss, never an error."""

    def client(self) -> NodeService | None:
        """The live service; None (a miss) while it is away or until the next try is due."""
        ...

    def unreported_failures(self) -> int:
        """Failures of the live connection not yet counted (counted when the link drops it)."""
        ...

    def close(self) -> None: ...


def connect_service(
    socket: str | Path,
    layout: KVLayout,
    fingerprint: str,
    *,
    count_failures: Callable[[int], None],
    miss_message: str = "serving misses",
) -> ServiceConnection:
    """A connector's link to the node's service: :class:`~kvtier.service.cache.ServiceCache`'s own link type."""
    from kvtier.service.link import ServiceLink

    return ServiceLink(socket, layout, fingerprint, count_failures=count_failures, miss_message=miss_message)


__all__ = [
    "Cache",
    "CacheStats",
    "Fetching",
    "Loaded",
    "NamedBlocks",
    "NodeService",
    "Promotion",
    "ServiceConnection",
    "TierView",
    "connect_service",
    "open_cache",
]
