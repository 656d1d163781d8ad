"""The "why miss" answer, beside the index: where a request's cached run stops, and why.

:func:`kvtier.index.longest_prefix` says *where* the run stops (absent, or a
key holding other tokens). This module adds *why* a block is absent, from
evidence the manager keeps anyway: a bounded record of recent evictions
(:class:`EvictionLog`), the same tokens probed under the caller's other
namespaces, and the session's previous transcript (the classic agent miss: a
timestamp in the system prompt changes every turn's first block). Only
namespaces the caller owns are ever probed, so the answer never tells one
tenant what another cached.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.index import LookupResult, MissReason
from kvtier.keys import BlockKey
from kvtier.policy.base import PolicyName
from kvtier.tiers.base import TierKind


class ExplainReason(enum.StrEnum):
    """Why the first uncached block of a request is not cached."""

    ALL_CACHED = "all_cached"  # every token would hit
    PARTIAL_TAIL = "partial_tail"  # every full block hits; the rest is less than a block, never cached
    NEVER_STORED = "never_stored"  # no tier holds it, nor remembers evicting it
    EVICTED = "evicted"  # a tier evicted it (``eviction`` says which, when, by which policy)
    OTHER_NAMESPACE = "other_namespace"  # the same tokens are cached under another namespace of the caller's
    OTHER_MODEL = "other_model"  # the request names a model (or KV layout) these blocks were not made for
    HASH_COLLISION = "hash_collision"  # a tier holds the key for other tokens: confirmation rejected it
    SESSION_DIVERGED = "session_diverged"  # the session's previous turn had other tokens from ``divergence`` on


@dataclass(frozen=True)
class Eviction:
    tier: TierKind
    policy: PolicyName
    at: float  # on the manager's clock


class EvictionLog:
    """The last ``capacity`` evictions by block key (newest record per key); bounded, thread-safe.

    Written by the manager under its lock at every eviction, read by explain:
    an LRU map, so a key evicted again moves to the newest end and the
    oldest records fall off first.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._log: OrderedDict[BlockKey, Eviction] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, keys: Sequence[BlockKey], tier: TierKind, policy: PolicyName, at: float) -> None:
        if not self.capacity or not keys:
            return
        entry = Eviction(tier, policy, at)
        with self._lock:
            for key in keys:
                self._log.pop(key, None)
                self._log[key] = entry
            while len(self._log) > self.capacity:
                self._log.popitem(last=False)

    def get(self, key: BlockKey) -> Eviction | None:
        with self._lock:
            return self._log.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._log)


@dataclass(frozen=True)
class Explanation:
    """What a request would hit, and the reason for the first block that would not."""

    result: LookupResult
    reason: ExplainReason
    first_miss_token: int | None  # position of the first token that would be prefilled
    eviction: Eviction | None = None
    other_namespace: str | None = None  # one of the caller's own namespaces, never another tenant's
    divergence: int | None = None  # first token position where the session's previous turn differs
    eviction_age_s: float | None = None  # how long ago ``eviction`` happened


def divergence(previous: np.ndarray, tokens: Sequence[int] | np.ndarray) -> int | None:
    """The first position where ``tokens`` leaves ``previous``, or None when one is a prefix of the other.

    A longer transcript that extends the previous one is the normal next
    turn; only a change inside what was already sent is a divergence.
    """
    now = np.asarray(tokens, dtype=np.int32)
    n = min(len(previous), len(now))
    differ = np.flatnonzero(previous[:n] != now[:n])
    return int(differ[0]) if len(differ) else None


def diagnose(
    result: LookupResult,
    evictions: EvictionLog,
    *,
    others: Sequence[LookupResult] = (),
    diverged_at: int | None = None,
    now: float = 0.0,
) -> Explanation:
    """The reason the run in ``result`` stops, from the strongest evidence to the weakest.

    ``others`` are the same tokens probed under the caller's other
    namespaces; ``diverged_at`` is where the session's previous turn left
    these tokens; ``now`` is the time on the clock evictions were recorded
    by. A collision is certain (a tier said so); an eviction record names the
    very key; a divergence inside the first missing block
    explains why its key is new; another namespace holding the block is a
    hint that the caller changed namespace.
    """
    miss = result.first_miss_block
    if miss is None:
        partial = result.num_tokens > result.cached_tokens
        reason = ExplainReason.PARTIAL_TAIL if partial else ExplainReason.ALL_CACHED
        return Explanation(result, reason, result.cached_tokens if partial else None)
    at = miss * result.block_size
    if result.miss_reason is MissReason.CONFIRM_MISMATCH:
        return Explanation(result, ExplainReason.HASH_COLLISION, at)
    evicted = evictions.get(result.keys[miss])
    if evicted is not None:
        age = max(0.0, now - evicted.at)
        return Explanation(result, ExplainReason.EVICTED, at, evicted, divergence=diverged_at, eviction_age_s=age)
    if diverged_at is not None and diverged_at < at + result.block_size:
        return Explanation(result, ExplainReason.SESSION_DIVERGED, at, divergence=diverged_at)
    other = next((o for o in others if o.cached_blocks > miss), None)
    if other is not None:
        return Explanation(result, ExplainReason.OTHER_NAMESPACE, at, other_namespace=other.namespace)
    return Explanation(result, ExplainReason.NEVER_STORED, at, divergence=diverged_at)
