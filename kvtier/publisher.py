"""Publishing this node's block events in vLLM's format over ZMQ (:mod:`kvtier.vllm_events`), for any router.

``kvtier serve`` and the cache service each run one when ``kv_events.endpoint``
is set. The publisher is a :class:`~kvtier.events.BlockEventSink` of the
node's :class:`~kvtier.events.HeldKeys`: tiers change on the engine thread and
on the manager's threads, which only append to a list here and wake the
publisher's thread through a pipe. That thread owns both ZMQ sockets (a ZMQ
socket is not thread-safe): it turns whatever is pending into one batch, one
sequence number, one PUB message, keeps the last ``buffer_batches`` for the
ROUTER to replay, answers a request the buffer no longer covers with a
snapshot, and sends an empty batch when nothing happened for ``heartbeat_s``.

Consecutive changes of one kind to one tier are merged into one event.
``HeldKeys.cleared(tier)`` has no vLLM event of its own (``AllBlocksCleared``
clears every medium), so it is published as ``AllBlocksCleared`` followed by
what the other tiers still hold, i.e. a snapshot.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvtier.events import PING_S
from kvtier.keys import BlockKey
from kvtier.tiers.base import TierKind
from kvtier.vllm_events import (
    ENCODER,
    END_SEQ,
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

log = logging.getLogger("kvtier.events")

Snapshot = Callable[[], Mapping[TierKind, Sequence[BlockKey]]]


class _Op(Enum):
    STORED = 1
    REMOVED = 2
    CLEARED = 3


@dataclass
class _Change:
    op: _Op
    tier: TierKind
    keys: list[BlockKey]


@dataclass(frozen=True)
class PublisherReport:
    """What ``/stats`` shows of a publisher."""

    endpoint: str
    replay_endpoint: str | None
    incarnation: int
    last_seq: int
    replays: int
    snapshots: int


class EventPublisher:
    """A PUB socket of vLLM-format KV event batches and a ROUTER that replays them; see the module docstring."""

    def __init__(
        self,
        endpoint: str,
        *,
        block_size: int,
        root: BlockKey,
        snapshot: Snapshot,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_batches: int = 10_000,
        heartbeat_s: float = PING_S,
    ) -> None:
        import zmq  # the publisher's own dependency: the connectors' engines import kvtier without it

        self.incarnation = secrets.randbits(63)
        self._zmq = zmq
        self._block_size = block_size
        self._root = bytes(root)
        self._snapshot = snapshot
        self._topic = topic.encode()
        self._heartbeat_s = heartbeat_s
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = -1
        self.replays = self.snapshots = 0
        self._pending: list[_Change] = []
        self._lock = threading.Lock()
        self._closing = False  # no more changes taken: close() was called, or the thread stopped
        self._closed = False
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # a port of 0 or * resolved
        self._replay = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._woken = False
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    # -- the BlockEventSink side (any thread, under HeldKeys' lock) ----------------------------------
    def stored(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        self._put(_Op.STORED, tier, keys)

    def removed(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        self._put(_Op.REMOVED, tier, keys)

    def cleared(self, tier: TierKind) -> None:
        self._put(_Op.CLEARED, tier, ())

    def _put(self, op: _Op, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            if self._closing:
                return  # closed, or its thread stopped: nothing would take these
            last = self._pending[-1] if self._pending else None
            if last is not None and last.op is op is not _Op.CLEARED and last.tier is tier:
                last.keys.extend(keys)
            else:
                self._pending.append(_Change(op, tier, list(keys)))
            wake, self._woken = not self._woken, True
        if wake:
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
            os.write(self._wake_w, b"\0")

    # -- the publisher's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            self._publish([])  # a restarted node says so at once
            beat = time.monotonic() + self._heartbeat_s
            while True:
                ready = dict(poller.poll(max(0.0, beat - time.monotonic()) * 1000))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                with self._lock:
                    changes, self._pending, self._woken = self._pending, [], False
                    closing = self._closing
                if changes or time.monotonic() >= beat:
                    self._publish(self._events(changes))
                    beat = time.monotonic() + self._heartbeat_s
                if self._replay is not None and self._replay in ready:
                    self._answer_replays()
                if closing:
                    return
        except Exception:  # events are best effort for routers; the node serves on without them
            log.exception("the KV event publisher stopped")
            with self._lock:
                self._closing, self._pending = True, []
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            self._context.term()
            os.close(self._wake_r)

    def _events(self, changes: list[_Change]) -> list[KVEvent]:
        events: list[KVEvent] = []
        for change in changes:
            medium = MEDIUM[change.tier]
            if change.op is _Op.STORED:
                events.append(self._stored(change.keys, medium))
            elif change.op is _Op.REMOVED:
                events.append(BlockRemoved([bytes(k) for k in change.keys], medium))
            else:
                events += self._whole_state()
        return events

    def _stored(self, keys: Sequence[BlockKey], medium: str) -> BlockStored:
        return BlockStored([bytes(k) for k in keys], None, [], self._block_size, None, medium, None)

    def _whole_state(self) -> list[KVEvent]:
        state = self._snapshot()
        return [AllBlocksCleared(), *(self._stored(keys, MEDIUM[tier]) for tier, keys in state.items() if keys)]

    def _payload(self, events: list[KVEvent]) -> bytes:
        return ENCODER.encode(KVEventBatch(time.time(), events, 0, self.incarnation, self._root))

    def _publish(self, events: list[KVEvent]) -> None:
        self._seq += 1
        payload = self._payload(events)
        self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
        self._buffer.append((self._seq, payload))

    def _answer_replays(self) -> None:
        """Every waiting request: the buffered batches from its sequence number on, or a snapshot, then the end."""
        while self._replay.poll(0):  # type: ignore[union-attr]
            frames = self._replay.recv_multipart()  # type: ignore[union-attr]
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("a KV event replay request of %d frames ignored", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            held = self._buffer[0][0] if self._buffer else self._seq + 1
            if held <= start <= self._seq + 1:
                self.replays += 1
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._send(client, (self._topic, seq.to_bytes(8, "big"), payload))
            else:  # older than the buffer, from another incarnation, or SNAPSHOT: the whole state
                self.snapshots += 1
                payload = self._payload(self._whole_state())
                self._send(client, (self._topic, self._seq.to_bytes(8, "big"), payload))
            self._send(client, (b"", END_SEQ, b""))

    def _send(self, client: bytes, frames: tuple[bytes, bytes, bytes]) -> None:
        self._replay.send_multipart((client, b"", *frames))  # type: ignore[union-attr]

    # -- the owner's side ------------------------------------------------------------------------------
    def report(self) -> PublisherReport:
        return PublisherReport(
            self.endpoint, self.replay_endpoint, self.incarnation, self._seq, self.replays, self.snapshots
        )

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is pending, then close the sockets; again: nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._closing = True
        self._wake()
        self._thread.join(timeout_s)
        os.close(self._wake_w)


__all__ = ["EventPublisher", "PublisherReport"]
