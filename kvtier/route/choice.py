"""Which backend gets a request: the policies of ``route.policy``, each an ordering of the candidates.

A policy answers with every live backend in order of preference: the first
gets the request, the next ones get it if that one fails before the first
byte (:mod:`kvtier.route.proxy`). Policies read the candidates and never
touch the network or the index (ask before acting); the only state they
keep is their own (a rotation, the sessions' backends).

The ``kvtier`` policy predicts a backend's cost in tokens to prefill:

    cost = uncached tokens + sum over cached blocks of (block_size x tier weight)
           + load x route.load_tokens

A block in the engine's own pool costs nothing; one in host memory a copy;
one on disk a read; one in the remote tier a network fetch: each a small
fraction of recomputing it, in that order. The balance guard passes over
any backend more than ``route.max_imbalance`` requests above the least
loaded one, so a hot prefix spreads instead of queueing on one backend; a
session sticks to its last backend unless the guard passes it over.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.config import RouteConfig, RoutePolicy
from kvtier.tiers.base import TierKind

TIER_WEIGHT = {TierKind.DEVICE: 0.0, TierKind.HOST: 0.05, TierKind.DISK: 0.15, TierKind.REMOTE: 0.3}
GUESS_WEIGHT = 0.2  # a block the router only believes is there (sent there, no events): cheap if right, full if not
MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class Candidate:
    """A live backend as a policy sees it."""

    name: str
    load: int  # requests running or queued there
    cached: tuple[TierKind | None, ...] = ()  # fastest tier of each leading block it holds; None: a guess


@dataclass(frozen=True)
class Ask:
    tokens: int  # prompt length
    session: str | None = None


class Reason(enum.StrEnum):
    """Why the first backend was first: counted in ``/stats``."""

    ROTATION = "rotation"
    LEAST_LOADED = "least_loaded"
    CHEAPEST = "cheapest"
    SESSION = "session"
    SPILLED = "spilled"  # the guard passed over the backend holding the prompt or the session


@dataclass(frozen=True)
class Ranking:
    order: list[str]  # every candidate, preferred first
    reason: Reason
    predicted_cached_tokens: int  # what the first one is expected to skip


def prefill_cost(tokens: int, cached: Sequence[TierKind | None], block_size: int) -> float:
    skipped = min(len(cached) * block_size, tokens)
    reload = sum(GUESS_WEIGHT if tier is None else TIER_WEIGHT[tier] for tier in cached) * block_size
    return tokens - skipped + reload


class Policy(ABC):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def _rotated(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """Candidates by name, starting one further each call: ties then spread evenly."""
        by_name = sorted(candidates, key=lambda c: c.name)
        k = next(self._turn) % len(by_name)
        return by_name[k:] + by_name[:k]

    @abstractmethod
    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        """``candidates`` is never empty."""


class RoundRobin(Policy):
    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        return Ranking([c.name for c in self._rotated(candidates)], Reason.ROTATION, 0)


class LeastLoaded(Policy):
    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        order = sorted(self._rotated(candidates), key=lambda c: c.load)  # stable: rotation breaks ties
        return Ranking([c.name for c in order], Reason.LEAST_LOADED, 0)


class CacheAware(Policy):
    def __init__(self, block_size: int, load_tokens: int, max_imbalance: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.load_tokens = load_tokens
        self.max_imbalance = max_imbalance
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> its last backend

    def cost(self, ask: Ask, c: Candidate) -> float:
        return prefill_cost(ask.tokens, c.cached, self.block_size) + c.load * self.load_tokens

    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        floor = min(c.load for c in candidates)
        fit = [c for c in candidates if c.load <= floor + self.max_imbalance]
        over = sorted((c for c in candidates if c.load > floor + self.max_imbalance), key=lambda c: c.load)
        order = sorted(self._rotated(fit), key=lambda c: self.cost(ask, c)) + over
        reason = Reason.CHEAPEST
        sticky = self._sessions.get(ask.session) if ask.session is not None else None
        if sticky is not None and any(c.name == sticky for c in fit):
            order.sort(key=lambda c: c.name != sticky)  # stable: the rest keep their cost order
            reason = Reason.SESSION
        elif sticky is not None or self._best_is_over(ask, candidates, over):
            reason = Reason.SPILLED
        first = order[0]
        self._remember(ask.session, first.name)
        cached = min(len(first.cached) * self.block_size, ask.tokens)
        return Ranking([c.name for c in order], reason, cached)

    def _best_is_over(self, ask: Ask, candidates: Sequence[Candidate], over: list[Candidate]) -> bool:
        """Whether the guard moved this request: the backend holding most of it was passed over."""
        if not over:
            return False
        most = max(candidates, key=lambda c: len(c.cached))
        return bool(most.cached) and most in over

    def _remember(self, session: str | None, backend: str) -> None:
        if session is None:
            return
        self._sessions[session] = backend
        self._sessions.move_to_end(session)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def forget(self, backend: str) -> None:
        """A dead backend's sessions go wherever the cost says next."""
        for session in [s for s, b in self._sessions.items() if b == backend]:
            del self._sessions[session]


def make_policy(config: RouteConfig, block_size: int) -> Policy:
    if config.policy is RoutePolicy.ROUND_ROBIN:
        return RoundRobin()
    if config.policy is RoutePolicy.LEAST_LOADED:
        return LeastLoaded()
    return CacheAware(block_size, config.load_tokens, config.max_imbalance)
