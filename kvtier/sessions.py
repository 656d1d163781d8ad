"""Agent sessions: which transcripts are live, and what protecting them means for eviction.

An agent resends its whole growing transcript every turn and pauses between
turns for tool calls; under plain LRU other agents' turns evict its blocks
during that pause. A request names its session (the server takes the
OpenAI ``user`` field or an ``X-Session-ID`` header), and while the session
is live (last turn within ``session.ttl_s``) its transcript blocks form a
:class:`~kvtier.policy.base.Protection` class for host eviction. The policy
ranks by it; this module only says which keys and in which class.

Which live sessions are protected when their transcripts together outgrow
the share they may hold: the oldest ones, by the turn each began with, and a
session keeps its place for as long as it stays live. Not the most recently
active: in an agent loop the session that just spoke has started a tool call
and is the one furthest from its next turn, and ranking by recency is LRU's
own order, which a round of more agents than the tier holds turns into a
miss for every one of them. A stable set keeps that many agents hitting
every turn; the rest fall to the normal policy, as anonymous blocks do.

Bounds, so that no session pins memory forever: a session expires after
its TTL (lazily, on the registry's injected clock, so tests step time
instead of sleeping); at most ``max_sessions`` are remembered (the idlest is
forgotten); protection covers live sessions only until their blocks reach
``max_protected_share`` of the tier; and protected blocks still leave when
nothing else can (the youngest protected session first).

Sessions are keyed by (namespace, id): the namespace is the tenant's, so two
tenants naming the same session id never see each other's session.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.config import SessionConfig
from kvtier.keys import BlockKey
from kvtier.policy.base import NO_PROTECTION, Protection

SessionKey = tuple[str, str]
"""(namespace, session id as the client gave it)."""


@dataclass
class Session:
    """One session's last transcript (leading tokens, bounded) and its counters; never shown as text."""

    namespace: str
    session_id: str
    last_turn: float
    began: float  # the first turn's time: a session's seniority for protection
    tokens: np.ndarray  # int32, the leading ``max_transcript_tokens`` of the last turn's prompt
    keys: tuple[BlockKey, ...]  # the full blocks of ``tokens``
    previous: np.ndarray | None = None  # the same of the turn before (explain compares the two)
    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefetched_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class SessionCounts:
    """What /stats may show of a session: counts, never tokens or text."""

    session: str  # the id as given (to its own tenant) or its keyed hash (to everyone else)
    turns: int
    transcript_tokens: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    idle_s: float


@dataclass
class _Cached:
    protection: Protection = NO_PROTECTION
    version: int = -1
    capacity: int = -1
    expires: float = float("inf")
    protected_blocks: int = 0


class SessionRegistry:
    """Live sessions by (namespace, id); thread-safe (routes and the manager's eviction both ask).

    The manager calls :meth:`protection` under its own lock, and this class
    never calls back into the manager, so the lock order is fixed (manager,
    then registry). The protection map is rebuilt only when a turn was
    recorded or a session expired since the last build: eviction asks on
    every host store that needs room.
    """

    def __init__(self, config: SessionConfig, block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.block_size = block_size
        self._clock = clock
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # idlest first
        self._lock = threading.Lock()
        self._version = 0
        self._cached = _Cached()
        self.expired = 0

    def turn(
        self, namespace: str, session_id: str, tokens: Sequence[int] | np.ndarray, keys: Sequence[BlockKey]
    ) -> Session:
        """Record a turn: the session is live again and its transcript is ``tokens`` (leading part kept)."""
        ids = np.asarray(tokens, dtype=np.int32)[: self.config.max_transcript_tokens].copy()
        kept = tuple(keys[: len(ids) // self.block_size])
        with self._lock:
            self._expire()
            key = (namespace, session_id)
            session = self._sessions.pop(key, None)
            if session is None:
                now = self._clock()
                session = Session(namespace, session_id, now, now, ids, kept)
            else:
                session.previous = session.tokens
            session.last_turn, session.tokens, session.keys = self._clock(), ids, kept
            session.turns += 1
            self._sessions[key] = session
            while len(self._sessions) > self.config.max_sessions:
                self._sessions.popitem(last=False)
            self._version += 1
            return session

    def served(self, namespace: str, session_id: str, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a finished turn's prompt and how much of it the cache served (the session's hit rate)."""
        with self._lock:
            session = self._sessions.get((namespace, session_id))
            if session is not None:
                session.prompt_tokens += prompt_tokens
                session.cached_tokens += cached_tokens

    def touch(self, namespace: str, session_id: str) -> Session | None:
        """The session is about to speak (its tool call is returning): live again, and the newest to protect."""
        with self._lock:
            self._expire()
            session = self._sessions.pop((namespace, session_id), None)
            if session is not None:
                session.last_turn = self._clock()
                self._sessions[(namespace, session_id)] = session
                self._version += 1
            return session

    def get(self, namespace: str, session_id: str) -> Session | None:
        """The live session, or None (never seen, forgotten, or expired)."""
        with self._lock:
            self._expire()
            return self._sessions.get((namespace, session_id))

    def _expire(self) -> None:
        """Drop sessions whose last turn is older than the TTL (call with the lock held)."""
        horizon = self._clock() - self.config.ttl_s
        while self._sessions:
            key, session = next(iter(self._sessions.items()))
            if session.last_turn > horizon:
                break
            del self._sessions[key]
            self.expired += 1
            self._version += 1

    def protection(self, capacity_blocks: int) -> Protection:
        """The live sessions' blocks as a protection class, oldest sessions first, up to the share.

        A session whose transcript does not fit in what is left of the share
        is passed over, and younger ones may still fit. A block's class is its
        session's seniority (a block in two sessions takes the older's): when
        protected blocks must go, the youngest protected session's go first.
        """
        with self._lock:
            self._expire()
            c = self._cached
            if c.version == self._version and c.capacity == capacity_blocks:
                return c.protection
            budget = int(capacity_blocks * self.config.max_protected_share)
            rank: dict[BlockKey, float] = {}
            for session in sorted(self._sessions.values(), key=lambda s: s.began):
                new = [k for k in session.keys if k not in rank]
                if len(rank) + len(new) <= budget:
                    rank.update(dict.fromkeys(new, -session.began))
            self._cached = _Cached(Protection(rank) if rank else NO_PROTECTION, self._version, capacity_blocks)
            self._cached.protected_blocks = len(rank)
            return self._cached.protection

    def counts(self, namespace: str | None, name: Callable[[Session], str]) -> list[SessionCounts]:
        """Every live session of ``namespace`` (None: all), idlest first, named by ``name``."""
        with self._lock:
            self._expire()
            now = self._clock()
            return [
                SessionCounts(
                    name(s), s.turns, len(s.tokens), s.prompt_tokens, s.cached_tokens, s.hit_rate, now - s.last_turn
                )
                for s in self._sessions.values()
                if namespace is None or s.namespace == namespace
            ]

    @property
    def protected_blocks(self) -> int:
        """Blocks in the last protection map built (what eviction honoured last)."""
        with self._lock:
            return self._cached.protected_blocks

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._sessions)
