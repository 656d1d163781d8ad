"""Which backend gets a request: the policies of ``route.policy``, each an ordering of the candidates.

A policy answers with every live backend in order of preference: the first
gets the request, the next ones get it if that one fails before the first
byte (:mod:`kvtier.route.proxy`). Policies read the candidates and never
touch the network or the index (ask before acting); the only state they
keep is their own (a rotation, the sessions' backends).

The ``kvtier`` policy predicts, in tokens to prefill, how long a request
would wait for its first token on each backend, and picks the least:

    cost = its own prefill there (uncached tokens, plus cached blocks x block_size x tier weight)
           + queue_weight x (prefill tokens already queued there
                             + requests of other clients there x route.load_tokens)

A block in the engine's own pool costs nothing; one in host memory a copy;
one on disk a read; one in the remote tier a network fetch: each a small
fraction of recomputing it, in that order. Load is counted in the same unit
as the miss, prefill tokens, not requests: a request queued behind a hot
prefix's tail (a few tokens) costs far less than recomputing the prefix
elsewhere, and a backend prefilling a long cold prompt costs more than one
running many short hits. A hot prefix therefore stays where it is cached
until what is queued there outweighs recomputing it elsewhere: balance and
cache are one measure, so neither overrides the other blindly (Dynamo's KV
router likewise weighs a worker's prefill against its active blocks).
``route.max_imbalance`` remains as a backstop in requests, for what tokens
do not show: decoding requests, others' requests of unknown size.

Session affinity breaks ties: a session goes back to its last backend when
no other is cheaper, so its turns stay together while its prefix is still
unannounced or absent everywhere.

A new session (no backend yet, its prompt cached nowhere) goes to the
backend that hosts the fewest sessions, the cost breaking ties. Its first
turn costs the same everywhere but for the queue of the moment, which is
gone a second later; its later turns will follow it, so what it is placed
by is the load it will add to: picking by the transient queue piled four
of eight sessions on one backend of three in `kvtier bench route`.
"""

from __future__ import annotations

import enum
import itertools
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
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
    load: int  # requests running or queued there, this router's and other clients'
    cached: tuple[TierKind | None, ...] = ()  # fastest tier of each leading block it holds; None: a guess
    queued_tokens: int = 0  # prefill this router sent there that has not yet produced its first token
    foreign: int = 0  # of ``load``, requests other clients sent there: their prefill is unknown


@dataclass(frozen=True)
class Ask:
    tokens: int  # prompt length
    session: str | None = None


class Reason(enum.StrEnum):
    """Why the first backend was first: counted in ``/stats``."""

    ROTATION = "rotation"
    LEAST_LOADED = "least_loaded"
    CHEAPEST = "cheapest"
    SESSION = "session"  # the session's last backend, no other cheaper
    SPILLED = "spilled"  # not where the most of the prompt, or the session, is: its queue or the guard moved it


@dataclass(frozen=True)
class Ranking:
    order: list[str]  # every candidate, preferred first
    reason: Reason
    predicted_cached_tokens: int  # what the first one is expected to skip


def prefill_cost(tokens: int, cached: Sequence[TierKind | None], block_size: int) -> float:
    """Tokens worth of work before the first token: the uncached ones, plus the reload of the cached ones."""
    skipped = min(len(cached) * block_size, tokens)
    reload = sum(GUESS_WEIGHT if tier is None else TIER_WEIGHT[tier] for tier in cached) * block_size
    return tokens - skipped + reload


class Chooser(ABC):
    """One ``route.policy``, as code: ranks the live backends for a request.

    Named a chooser, not a policy, so that "policy" in kvtier means one
    thing: what a tier evicts (:mod:`kvtier.policy`).
    """

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


class RoundRobin(Chooser):
    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        return Ranking([c.name for c in self._rotated(candidates)], Reason.ROTATION, 0)


class LeastLoaded(Chooser):
    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        order = sorted(self._rotated(candidates), key=lambda c: c.load)  # stable: rotation breaks ties
        return Ranking([c.name for c in order], Reason.LEAST_LOADED, 0)


class CacheAware(Chooser):
    def __init__(self, block_size: int, load_tokens: int, max_imbalance: int, queue_weight: float = 1.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.load_tokens = load_tokens
        self.max_imbalance = max_imbalance
        self.queue_weight = queue_weight
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> its last backend
        self._hosted: Counter[str] = Counter()  # backend -> sessions whose last backend it is

    def queued(self, c: Candidate) -> float:
        """Prefill ahead of a new request on ``c``: what this router queued there, others' at a flat guess."""
        return c.queued_tokens + c.foreign * self.load_tokens

    def cost(self, ask: Ask, c: Candidate) -> float:
        return prefill_cost(ask.tokens, c.cached, self.block_size) + self.queue_weight * self.queued(c)

    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        floor = min(c.load for c in candidates)
        fit = [c for c in candidates if c.load <= floor + self.max_imbalance]
        over = sorted((c for c in candidates if c.load > floor + self.max_imbalance), key=lambda c: c.load)
        sticky = self._sessions.get(ask.session) if ask.session is not None else None
        new_session = ask.session is not None and sticky is None and not any(c.cached for c in candidates)

        def key(c: Candidate) -> tuple[float, float]:
            if new_session:  # placed by the sessions it will join there (see above), the cost breaking ties
                return (self._hosted[c.name], self.cost(ask, c))
            return (self.cost(ask, c), c.name != sticky)

        order = sorted(self._rotated(fit), key=key) + over
        first = order[0]
        self._remember(ask.session, first.name)
        cached = min(len(first.cached) * self.block_size, ask.tokens)
        return Ranking([c.name for c in order], _reason(first, sticky, candidates), cached)

    def _remember(self, session: str | None, backend: str) -> None:
        if session is None:
            return
        before = self._sessions.get(session)
        if before != backend:
            if before is not None:
                self._hosted[before] -= 1
            self._hosted[backend] += 1
        self._sessions[session] = backend
        self._sessions.move_to_end(session)
        while len(self._sessions) > MAX_SESSIONS:
            _, gone = self._sessions.popitem(last=False)
            self._hosted[gone] -= 1

    def forget(self, backend: str) -> None:
        """A dead backend's sessions go wherever the cost says next."""
        for session in [s for s, b in self._sessions.items() if b == backend]:
            del self._sessions[session]
        del self._hosted[backend]


def _reason(first: Candidate, sticky: str | None, candidates: Sequence[Candidate]) -> Reason:
    """Why ``first`` won: its session's backend; or not where the prompt or session is (spilled); or cheapest."""
    if first.name == sticky:
        return Reason.SESSION
    most = max(len(c.cached) for c in candidates)
    if len(first.cached) < most or any(c.name == sticky for c in candidates):
        return Reason.SPILLED
    return Reason.CHEAPEST


def make_chooser(config: RouteConfig, block_size: int) -> Chooser:
    if config.policy is RoutePolicy.ROUND_ROBIN:
        return RoundRobin()
    if config.policy is RoutePolicy.LEAST_LOADED:
        return LeastLoaded()
    return CacheAware(block_size, config.load_tokens, config.max_imbalance, config.queue_weight)
