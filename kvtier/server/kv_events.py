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
from collections.abc import AsyncIterator, Sequence

from kvtier.events import (
    ENCODER,
    EVENTS_VERSION,
    PING_S,
    Cleared,
    Event,
    HeldKeys,
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


class _Subscriber:
    """One stream's sink: each change as a line, handed to the stream's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.lagging = False

    def stored(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        self._send(Stored(tier, hexkeys(keys)))

    def removed(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        self._send(Removed(tier, hexkeys(keys)))

    def cleared(self, tier: TierKind) -> None:
        self._send(Cleared(tier))

    def _send(self, event: Event) -> None:
        if self.lagging:
            return
        if self.queue.qsize() >= MAX_BACKLOG:
            self.lagging = True
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)
            return
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ENCODER.encode(event) + b"\n")


class EventFeed(HeldKeys):
    """The keys each tier holds and the streams that want to hear of changes (and any other sink: the ZMQ publisher)."""

    def __init__(self, block_size: int, root: BlockKey) -> None:
        super().__init__()
        self._hello = Hello(EVENTS_VERSION, block_size, bytes(root).hex(), [])
        self._streams = 0

    # -- the stream side (an event loop) -----------------------------------------------------------
    def _subscribe(self) -> tuple[_Subscriber, list[bytes]]:
        """A new subscriber and its first lines, taken together so that no event falls between them."""
        sub = _Subscriber(asyncio.get_running_loop())
        tiers = {tier: hexkeys(keys) for tier, keys in self.listen(sub).items()}
        hello = Hello(self._hello.version, self._hello.block_size, self._hello.root, sorted(tiers))
        self._streams += 1
        return sub, [ENCODER.encode(hello) + b"\n", ENCODER.encode(Snapshot(tiers)) + b"\n"]

    def _unsubscribe(self, sub: _Subscriber) -> None:
        self.unlisten(sub)
        self._streams -= 1

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
        """Open ``/v1/kv-events`` streams."""
        return self._streams
