"""The eviction-policy contract: policies rank keys, they never move bytes.

A policy tracks the keys resident in one tier and answers one question,
"which keys should leave first?". It never touches tensors or tiers, and
answering never changes its state (ask before acting): the manager calls
:meth:`EvictionPolicy.victims`, evicts what it decides to, then reports each
eviction back through :meth:`EvictionPolicy.on_remove`.

Policies are not thread-safe; the manager calls them under its lock. Their
notion of time is a logical clock (one tick per event), never the wall clock,
so victim order is deterministic and testable.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvtier.keys import BlockKey
from kvtier.tiers.base import BlockRecord


class PolicyName(enum.StrEnum):
    LRU = "lru"
    LFU = "lfu"
    S3FIFO = "s3fifo"
    PREFIX_LRU = "prefix_lru"


@dataclass(frozen=True)
class Protection:
    """Keys held back from eviction, each with a class: a lower class is given up first.

    The manager builds it (a live session's transcript blocks, classed
    by the session's seniority); the policy only ranks by it. Protection is
    a preference, not a pin: when nothing unprotected is left to evict, the
    protected keys go too, lowest class first (the youngest session),
    and within a class in the policy's own order.
    """

    rank: Mapping[BlockKey, float] = field(default_factory=dict)

    def __contains__(self, key: object) -> bool:
        return key in self.rank


NO_PROTECTION = Protection()


class _Either:
    """``a or b`` membership without building a set (``exclude`` may be a large pin table)."""

    def __init__(self, a: Container[BlockKey], b: Container[BlockKey]) -> None:
        self._a, self._b = a, b

    def __contains__(self, key: object) -> bool:
        return key in self._a or key in self._b


@runtime_checkable
class Recency(Protocol):
    """A recency list kept by a tier over the blocks it holds (both local tiers: :mod:`kvtier.tiers.slot_index`).

    The policy says who is on it and where (``enter``, ``touch``, ``leave``);
    the tier only takes a block off when it drops the block. A policy that
    ranks by recency alone can keep its order there instead of holding every
    key again (:class:`~kvtier.policy.lru.LRUPolicy`).
    """

    def enter(self, key: BlockKey) -> None: ...

    def touch(self, key: BlockKey) -> None: ...

    def leave(self, key: BlockKey) -> None: ...

    def ranks(self, key: object) -> bool: ...

    def ranked(self) -> int: ...

    def oldest(self, n: int, skip: int = 0) -> list[BlockKey]: ...


class EvictionPolicy(ABC):
    name: PolicyName

    def load(self, held: Iterable[tuple[BlockKey, BlockRecord]], recency: Recency | None = None) -> None:
        """Hear of the blocks a tier opened with, oldest store first, before any other event.

        ``recency`` is the tier's own recency list when it keeps one, with
        every block held on it in store order. A policy that can rank by it
        takes it instead of ``held``; the others hear of each block as an
        insert.
        """
        for key, record in held:
            self.on_insert(key, record.parent)

    @abstractmethod
    def on_insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        """``key`` entered the tier; ``parent`` is the previous block's key (None for block 0)."""

    @abstractmethod
    def on_access(self, key: BlockKey) -> None:
        """``key`` was hit by a lookup or read. Unknown keys are ignored."""

    @abstractmethod
    def on_remove(self, key: BlockKey) -> None:
        """``key`` left the tier (evicted or removed). Unknown keys are ignored."""

    def on_lost(self, key: BlockKey) -> None:
        """``key`` is gone from the tier already: the tier dropped it by itself (its bytes failed their read).

        A policy ranking by the tier's own recency list no longer holds it
        by now; :class:`~kvtier.events.ObservedPolicy` reports it all the same.
        """
        self.on_remove(key)

    @abstractmethod
    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        """Up to ``n`` keys to evict, first victim first, skipping ``exclude``.

        Must not change any state: calling it twice in a row returns the same
        list, and the policy behaves afterwards as if it had not been called.
        """

    def ranked_victims(
        self, n: int, exclude: Container[BlockKey] = frozenset(), protection: Protection = NO_PROTECTION
    ) -> list[BlockKey]:
        """:meth:`victims` with ``protection`` honoured: unprotected keys first, in this policy's order.

        Defined once here so that every policy honours protection the same
        way and none of them special-cases it. Only when fewer than ``n``
        unprotected keys can go are protected ones added, lowest class first,
        each class in the policy's own order. Pure, like :meth:`victims`.
        """
        if not protection.rank:
            return self.victims(n, exclude)
        first = self.victims(n, _Either(exclude, protection))
        short = n - len(first)
        if short <= 0:
            return first
        order = [k for k in self.victims(len(self), exclude) if k in protection]
        order.sort(key=lambda k: protection.rank[k])  # stable: the policy's order within a class
        return first + order[:short]

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...


_REGISTRY: dict[PolicyName, Callable[[], EvictionPolicy]] = {}


def register(name: PolicyName) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    def deco(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def registered() -> list[PolicyName]:
    return list(_REGISTRY)


def make_policy(name: PolicyName) -> EvictionPolicy:
    try:
        factory = _REGISTRY[PolicyName(name)]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {[p.value for p in _REGISTRY]}") from None
    return factory()
