"""The next turn warmed while the agent runs a tool: a session's next prompt prefilled in the engine's idle time.

When a turn of a session ends, the server knows how its next prompt starts:
this prompt, the reply just generated, and the chat template's opening of
the next message (:func:`kvtier.model.chat.next_turn_ids`). The reply's KV
exists only as decode computed it, which the cache keeps only where it is
bit-equal to a prefill's (``engine.decoded_kv``); otherwise the next turn
prefills the whole reply again, after the tool's result has arrived. Warming
prefills it before: a prefill alone (``max_tokens`` 0) whose blocks land in
the pool and the tiers like any request's, so the next turn prefills only
the tool's result.

Idle time only. The engine thread (:class:`kvtier.server.loop.EngineLoop`)
starts a warm when no request waits or runs, and passes the engine an
``interrupt`` that stops the forward before its next layer once anything
arrives; then every warm in the engine is aborted (what its finished steps
computed is stored, like any aborted request's) and queued again to resume
later, unless the arrival is that session's own next turn. A session's
newer turn replaces its queued warm; a warm not started within the session's
TTL (``session.ttl_s``: the agent did not come back) is dropped.

This module holds both halves: :class:`Warming`, the engine thread's queue
and counters, and :class:`Warmer`, which renders a finished turn's next
prompt on its own thread (the template and the tokenizer are milliseconds
of work that neither the event loop nor the engine thread should wait on).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jinja2

from kvtier.cache import Cache
from kvtier.engine.request import FinishReason
from kvtier.engine.runtime import LoadedModel
from kvtier.keys import KeyedTokens
from kvtier.model import ChatTemplateError
from kvtier.model.chat import next_turn_ids

log = logging.getLogger(__name__)

SessionKey = tuple[str, str]
"""(namespace, session id): a session is its tenant's own."""


@dataclass(frozen=True)
class WarmTurn:
    """One session's next prompt, as far as it is known, to prefill before the session comes back."""

    session: SessionKey
    prompt: KeyedTokens
    until: float  # on the monotonic clock: past it the session is gone (its TTL), and so is the warm


@dataclass
class WarmCounters:
    """Warming since the server started (``/stats`` ``engine.warming``)."""

    queued: int = 0  # turns handed to the engine thread to warm
    started: int = 0  # warm prefills put into the engine
    finished: int = 0  # ... that ran to the end of their prompt
    interrupted: int = 0  # ... stopped by an arriving request (queued again unless superseded)
    superseded: int = 0  # warms dropped because the session's next turn arrived first
    expired: int = 0  # warms dropped because the session's TTL passed before the engine was idle
    failed: int = 0  # warms the engine refused (a prompt past the context or the pool)
    tokens: int = 0  # prompt tokens warm prefills computed
    running: int = 0  # warm prefills in the engine now


class Warming:
    """The engine thread's warm work: queued turns, the ones in the engine, and counters. Engine thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._queued: OrderedDict[SessionKey, WarmTurn] = OrderedDict()  # oldest first
        self._running: dict[str, WarmTurn] = {}  # engine request id -> its turn
        self._dropped: set[str] = set()  # running warms whose session's next turn arrived
        self._ids = itertools.count()
        self.counters = WarmCounters()

    @property
    def pending(self) -> bool:
        return bool(self._queued)

    @property
    def running(self) -> list[str]:
        return list(self._running)

    def queue(self, turn: WarmTurn) -> None:
        """A session's newer turn replaces the one it queued before."""
        self._queued.pop(turn.session, None)
        self._queued[turn.session] = turn
        self.counters.queued += 1

    def next(self) -> tuple[str, WarmTurn] | None:
        """The oldest queued turn still within its session's TTL, with the request id to run it under."""
        now = self._clock()
        while self._queued:
            _, turn = self._queued.popitem(last=False)
            if turn.until <= now:
                self.counters.expired += 1
                continue
            request_id = f"warm-{next(self._ids)}"
            self._running[request_id] = turn
            self.counters.started += 1
            self.counters.running = len(self._running)
            return request_id, turn
        return None

    def arrived(self, session: SessionKey | None) -> list[str]:
        """A request arrived: the warms in the engine to abort now. That session's own warm is moot."""
        if session is not None and self._queued.pop(session, None) is not None:
            self.counters.superseded += 1
        self._dropped.update(rid for rid, turn in self._running.items() if turn.session == session)
        return list(self._running)

    def ended(self, request_id: str, reason: FinishReason | None) -> bool:
        """Whether the request was a warm; if it was aborted, its turn is queued again first (its work so far kept)."""
        turn = self._running.pop(request_id, None)
        if turn is None:
            return False
        self.counters.running = len(self._running)
        if reason is FinishReason.ABORT:
            if request_id in self._dropped:
                self._dropped.discard(request_id)
                self.counters.superseded += 1
            else:
                self.counters.interrupted += 1
                if turn.session not in self._queued:  # a newer turn of the session queued meanwhile wins
                    self._queued[turn.session] = turn
                    self._queued.move_to_end(turn.session, last=False)
        elif reason is FinishReason.ERROR:
            self.counters.failed += 1
        else:
            self.counters.finished += 1
        return True

    def computed(self, tokens: int) -> None:
        self.counters.tokens += tokens

    def lost(self) -> None:
        """The engine was rebuilt after a failed step: the warms in it are gone (counted failed), the queue stays."""
        self.counters.failed += len(self._running)
        self._running.clear()
        self._dropped.clear()
        self.counters.running = 0


class Warmer:
    """The HTTP side: a finished turn's next prompt rendered on a thread of its own and handed to the engine."""

    def __init__(self, loaded: LoadedModel, cache: Cache, ttl_s: float, hand: Callable[[WarmTurn], None]) -> None:
        """``hand``: :meth:`kvtier.server.loop.EngineLoop.warm`."""
        self._loaded = loaded
        self._cache = cache
        self._ttl_s = ttl_s
        self._hand = hand
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-warm")

    def after(self, session: SessionKey, conversation: list[dict[str, str]], reply: str) -> None:
        """Queue the warm of ``session``'s next turn; returns at once."""
        until = time.monotonic() + self._ttl_s
        self._thread.submit(self._render, session, conversation, reply, until)

    def _render(self, session: SessionKey, conversation: list[dict[str, str]], reply: str, until: float) -> None:
        chat = self._loaded.chat
        if chat is None:
            return
        try:
            ids = next_turn_ids(self._loaded.tokenizer, chat, conversation, reply)
        except (ChatTemplateError, jinja2.TemplateError) as err:  # a template we cannot cut: no warm, nothing lost
            log.debug("no warm for a turn: %s", err)
            return
        if ids:
            self._hand(WarmTurn(session, self._cache.keyed(ids, session[0]), until))

    def settle(self) -> None:
        """Wait until every turn given so far is rendered and handed to the engine."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)


__all__ = ["SessionKey", "WarmCounters", "WarmTurn", "Warmer", "Warming"]
