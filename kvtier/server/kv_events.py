"""``GET /v1/kv-events``: this instance's block events, for a router (``kvtier route``) to know what it holds.

The stream is JSON lines (:mod:`kvtier.events`): a hello that says what keys
mean here, a snapshot of every key each tier holds, then each change as it
happens, and a ping whenever nothing happened for a while. Every new
subscription starts with a snapshot, so a router that lost its stream
resynchronizes by simply subscribing again: no sequence numbers to replay.

Tiers change on the engine thread and on the manager's threads; events are
handed to each subscriber's event loop with ``call_soon_threadsafe``. A
subscriber that falls too far behind is cut off (its next subscription
starts from a fresh snapshot) rather than allowed to hold memory here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvtier.events import (
    ENCODER,
    EVENTS_VERSION,
    PING_S,
    Cleared,
    Event,
    Hello,
    Ping,
    Removed,
    Snapshot,
    Stored,
    hexkeys,
)
from kvtier.keys import BlockKey
from kvtier.tiers.base import TierKind

MAX_BACKLOG = 10_000  # lines queued for one subscriber before it is cut off


@dataclass(eq=False)
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[bytes | None]
    lagging: bool = False


class EventFeed:
    """The keys each tier holds (kept from the events themselves) and the streams that want to hear of changes."""

    def __init__(self, block_size: int, root: BlockKey) -> None:
        self._hello = Hello(EVENTS_VERSION, block_size, bytes(root).hex(), [])
        self._held: dict[TierKind, set[BlockKey]] = {}
        self._subs: list[_Subscriber] = []
        self._lock = threading.Lock()

    # -- the BlockEventSink side (any thread) ---------------------------------------------------
    def stored(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._held.setdefault(tier, set()).update(keys)
            if keys:
                self._send(Stored(tier, hexkeys(keys)))

    def removed(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._held.setdefault(tier, set()).difference_update(keys)
            if keys:
                self._send(Removed(tier, hexkeys(keys)))

    def cleared(self, tier: TierKind) -> None:
        with self._lock:
            self._held[tier] = set()
            self._send(Cleared(tier))

    def _send(self, event: Event) -> None:
        line = ENCODER.encode(event) + b"\n"
        for sub in self._subs:
            if sub.lagging:
                continue
            if sub.queue.qsize() >= MAX_BACKLOG:
                sub.lagging = True
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, None)
                continue
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, line)

    # -- the stream side (an event loop) -----------------------------------------------------------
    def _subscribe(self) -> tuple[_Subscriber, list[bytes]]:
        """A new subscriber and its first lines, taken together so that no event falls between them."""
        sub = _Subscriber(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            tiers = {tier: hexkeys(list(keys)) for tier, keys in self._held.items()}
            hello = Hello(self._hello.version, self._hello.block_size, self._hello.root, sorted(tiers))
            first = [ENCODER.encode(hello) + b"\n", ENCODER.encode(Snapshot(tiers)) + b"\n"]
            self._subs.append(sub)
        return sub, first

    def _unsubscribe(self, sub: _Subscriber) -> None:
        with self._lock:
            self._subs.remove(sub)

    async def stream(self, ping_s: float = PING_S) -> AsyncIterator[bytes]:
        sub, first = self._subscribe()
        try:
            for line in first:
                yield line
            ping = ENCODER.encode(Ping()) + b"\n"
            while True:
                try:
                    line = await asyncio.wait_for(sub.queue.get(), ping_s)
                except TimeoutError:
                    line = ping
                if line is None:
                    return  # fell behind: the subscriber resynchronizes from a new snapshot
                yield line
        finally:
            self._unsubscribe(sub)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return len(self._subs)
