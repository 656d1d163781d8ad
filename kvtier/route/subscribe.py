"""Keeping the index: one subscription per backend to its block event stream (``GET /v1/kv-events``),
or, where ``route.kv_events`` names one, to its vLLM-format KV event publisher (ZMQ, :mod:`kvtier.route.vllm`).

Every subscription opens with the backend's hello and a snapshot of all it
holds, so losing a stream costs nothing but the time to subscribe again:
while it is down, the backend's index entries are dropped (they may be
stale) and the router falls back on what it routed there itself
(:class:`~kvtier.route.index.RoutedPrefixes`); the new snapshot replaces
both. A stream that says nothing, not even its ping, for a while is lost.

A line is read up to ``route.max_event_line_bytes``: the router holds no
more of a stream than that line and the chunk in hand, so a backend that
sends bytes without a newline loses its stream (counted, logged once) and
is subscribed to again like any lost one, instead of growing the router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
import msgspec

from kvtier.config import EventSource
from kvtier.events import DECODER, PING_S, Cleared, Hello, Removed, Snapshot, Stored
from kvtier.keys import BlockKey
from kvtier.route.backends import Backend, Fleet
from kvtier.route.prompt import Prompts
from kvtier.route.vllm import VllmKeys
from kvtier.vllm_events import DECODER as BATCHES
from kvtier.vllm_events import END_SEQ, SNAPSHOT, KVEventBatch, split

log = logging.getLogger("kvtier.route")

SILENT_S = 4 * PING_S  # no line for this long: the stream is lost
RETRY_S = 0.5


def _keys(hexes: list[str]) -> list[BlockKey]:
    return [BlockKey(bytes.fromhex(h)) for h in hexes]


class KeyMismatch(Exception):
    """The backend keys blocks differently (another secret, model, dtype or block size)."""


class LineTooLong(Exception):
    """The backend sent more than ``route.max_event_line_bytes`` without ending a line."""


def apply(fleet: Fleet, backend: Backend, prompts: Prompts, line: bytes) -> None:
    """One line of a backend's stream into the index."""
    event = DECODER.decode(line)
    url = backend.url
    if isinstance(event, Hello):
        if not prompts.agrees(event.root, event.block_size):
            raise KeyMismatch(f"{url} keys blocks differently (check the secret file, model, dtype and block size)")
    elif isinstance(event, Snapshot):
        fleet.index.replace(url, {tier: _keys(keys) for tier, keys in event.tiers.items()})
        fleet.guesses.drop(url)
        backend.events_live = True
    elif isinstance(event, Stored):
        fleet.index.stored(url, event.tier, _keys(event.keys))
    elif isinstance(event, Removed):
        fleet.guesses.forget(url, fleet.index.removed(url, event.tier, _keys(event.keys)))
    elif isinstance(event, Cleared):
        fleet.guesses.forget(url, fleet.index.cleared(url, event.tier))


async def _lines(chunks: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """The complete lines of ``chunks``, holding at most ``limit`` bytes of one; raises past them."""
    held = bytearray()
    async for chunk in chunks:
        first, *more = chunk.split(b"\n")
        held += first
        if len(held) > limit or any(len(line) > limit for line in more):
            raise LineTooLong(f"{limit} bytes of block events without the end of a line")
        if more:
            yield bytes(held)
            for line in more[:-1]:
                yield line
            held = bytearray(more[-1])


async def _read(
    fleet: Fleet, backend: Backend, prompts: Prompts, client: httpx.AsyncClient, token: str | None, limit: int
) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    headers["Accept-Encoding"] = "identity"  # raw bytes are what the line bound counts, never a decompressed bomb
    epoch = backend.epoch
    async with client.stream("GET", backend.url + "/v1/kv-events", headers=headers, timeout=SILENT_S) as response:
        if response.status_code != 200:
            raise httpx.HTTPStatusError(f"{response.status_code}", request=response.request, response=response)
        async for line in _lines(response.aiter_raw(), limit):
            if backend.epoch != epoch:
                return  # taken out meanwhile, its index dropped: start again from a snapshot
            if line.strip():
                apply(fleet, backend, prompts, line)


def lost(fleet: Fleet, backend: Backend) -> None:
    """The index of ``backend`` may be stale now: drop it; routing falls back on the routed guesses."""
    backend.events_live = False
    fleet.index.drop(backend.url)


async def follow(
    fleet: Fleet, backend: Backend, prompts: Prompts, client: httpx.AsyncClient, token: str | None, limit: int
) -> None:
    """Subscribe to ``backend``'s events for as long as the router runs, again after every loss.

    ``limit`` is ``route.max_event_line_bytes``.
    """
    await _keep_following(
        fleet,
        backend,
        "block events",
        lambda: _read(fleet, backend, prompts, client, token, limit),
        (httpx.HTTPError, msgspec.DecodeError, ValueError),
    )


async def _keep_following(
    fleet: Fleet,
    backend: Backend,
    what: str,
    read: Callable[[], Awaitable[None]],
    expected: tuple[type[Exception], ...],
) -> None:
    """``read()`` again after every loss, the index dropped meanwhile (routing falls back on the guesses).

    ``expected``: the losses a stream has (logged once it was live); a key
    mismatch waits longer, and anything else is logged once with its trace.
    The loop outlives whatever one backend sends.
    """
    warned = failed = False
    while True:
        try:
            await read()
        except KeyMismatch as err:
            lost(fleet, backend)
            if not warned:
                log.error("%s; routing to it by load only", err)
                warned = True
            await asyncio.sleep(30 * RETRY_S)
            continue
        except LineTooLong as err:
            _overflowed(backend, err)
        except expected as err:
            if backend.events_live:
                log.warning("lost the %s of %s (%s); resubscribing", what, backend.url, type(err).__name__)
        except Exception:  # routing by load meanwhile
            if not failed:
                log.exception("following the %s of %s failed; resubscribing", what, backend.url)
                failed = True
        lost(fleet, backend)
        await asyncio.sleep(RETRY_S)


def _overflowed(backend: Backend, err: LineTooLong) -> None:
    backend.event_overflows += 1
    if backend.event_overflows == 1:
        log.error("dropped the block events of %s: %s (route.max_event_line_bytes); resubscribing", backend.url, err)


# -- vLLM-format events over ZMQ (kvtier.vllm_events): kvtier nodes with kv_events, and vLLM --------------
class _Resync(Exception):
    """The replay socket did not answer in time: start again."""


@dataclass
class _Position:
    """Where a follower stands in a publisher's stream."""

    incarnation: int | None = None
    expected: int | None = None  # the next sequence number to apply


async def follow_zmq(fleet: Fleet, backend: Backend, prompts: Prompts, source: EventSource) -> None:
    """Keep ``backend``'s index from its vLLM-format KV events (``route.kv_events``), for as long as the router runs.

    The PUB socket's connection is watched: when it drops (the node went
    away) the index is dropped at once, and when it is made again the
    follower asks the replay socket for a snapshot, so a restarted node is
    routed by its new state one replay round trip after it is reachable.
    A batch from another incarnation, or a gap in the sequence numbers,
    asks for the same: a replay from the first missing number when the
    buffer still holds it, else a snapshot. vLLM sends no snapshot: without
    a replay that covers the gap, its index is dropped and rebuilt from the
    events that follow. A kvtier node's silence past a few heartbeats drops
    the index too (vLLM sends none: an idle vLLM is silent, not lost).
    """
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    keys = VllmKeys(backend.url, prompts.hasher, prompts.namespace, fleet.index, fleet.guesses)

    async def subscribed() -> None:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        watch = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        replay = None
        if source.replay_endpoint is not None:
            replay = context.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(source.replay_endpoint)
        sub.connect(source.endpoint)
        try:
            await _read_zmq(fleet, backend, prompts, keys, sub, watch, replay)
        finally:
            sub.disable_monitor()
            for socket in (watch, sub, replay):
                if socket is not None:
                    socket.close(linger=0)

    await _keep_following(fleet, backend, "KV events", subscribed, (_Resync, msgspec.DecodeError, ValueError))


async def _read_zmq(
    fleet: Fleet,
    backend: Backend,
    prompts: Prompts,
    keys: VllmKeys,
    sub: Any,
    watch: Any,
    replay: Any | None,
) -> None:
    import zmq
    import zmq.asyncio
    from zmq.utils.monitor import parse_monitor_message

    poller = zmq.asyncio.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(watch, zmq.POLLIN)
    at = _Position()
    beats = False  # a kvtier node sends a heartbeat; vLLM is silent when idle, and only a dropped connection counts
    while True:
        ready = dict(await poller.poll(SILENT_S * 1000))
        if not ready:
            if not beats:
                continue
            if backend.events_live:
                log.warning("%s: no KV events for %.0f s; index dropped until they resume", backend.url, SILENT_S)
            lost(fleet, backend)
            at = _Position()
            continue
        if watch in ready:
            event = parse_monitor_message(await watch.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                lost(fleet, backend)
                at = _Position()
            elif event == zmq.EVENT_CONNECTED and replay is not None:
                at = await _resync(fleet, backend, prompts, keys, replay, None)
        if sub not in ready:
            continue
        seq, payload = split(await sub.recv_multipart())
        batch = BATCHES.decode(payload)
        _check_root(prompts, backend, batch)
        beats = batch.root is not None
        if at.expected is not None and batch.incarnation == at.incarnation:
            if seq < at.expected:
                continue  # already applied (it was in a replay or a snapshot)
            if seq == at.expected:
                keys.apply_batch(batch)
                at.expected = seq + 1
                continue
        # a first batch, a restarted node, or lost batches
        if replay is not None:
            start = at.expected if batch.incarnation == at.incarnation else None
            at = await _resync(fleet, backend, prompts, keys, replay, start)
            if at.expected is not None and seq < at.expected:
                continue
        elif at.expected is not None:
            log.warning("%s: KV events %d..%d lost; index rebuilt from here", backend.url, at.expected, seq)
            fleet.index.drop(backend.url)
        keys.apply_batch(batch)
        at = _Position(batch.incarnation, seq + 1)
        backend.events_live = True


def _check_root(prompts: Prompts, backend: Backend, batch: KVEventBatch) -> None:
    if batch.root is not None and batch.root.hex() != prompts.root:
        raise KeyMismatch(f"{backend.url} keys blocks differently (check the secret file, model, dtype and block size)")


async def _resync(
    fleet: Fleet, backend: Backend, prompts: Prompts, keys: VllmKeys, replay: Any, start: int | None
) -> _Position:
    """Ask the replay socket for the batches from ``start`` and apply its answer; returns where the stream stands.

    ``start`` None: nothing is known of this incarnation, so the index is
    dropped and a snapshot asked for (:data:`~kvtier.vllm_events.SNAPSHOT`;
    a vLLM publisher has none and answers nothing: its index is rebuilt
    from the events that follow). A kvtier node answers a start its buffer
    no longer holds with a snapshot too; a vLLM publisher with what it
    still has, so a first number past ``start`` is a gap, and the index is
    dropped and rebuilt from there.
    """
    asked = time.monotonic()
    if start is None:
        fleet.index.drop(backend.url)
        fleet.guesses.drop(backend.url)
    await replay.send_multipart([b"", SNAPSHOT if start is None else start.to_bytes(8, "big")])
    at = _Position()
    first = True
    while True:
        if not await replay.poll(SILENT_S * 1000):
            raise _Resync(f"{backend.url}: no answer from the replay socket")
        frames = await replay.recv_multipart()
        if len(frames) != 4:
            raise msgspec.DecodeError(f"a replay answer of {len(frames)} frames")
        if frames[2] == END_SEQ:
            backend.event_resyncs += 1
            backend.event_resync_s = time.monotonic() - asked
            return at
        seq, payload = split(frames[1:])
        batch = BATCHES.decode(payload)
        _check_root(prompts, backend, batch)
        if first and batch.root is None and start is not None and seq != start:
            fleet.index.drop(backend.url)  # vLLM's buffer no longer holds the start
        first = False
        keys.apply_batch(batch)
        at = _Position(batch.incarnation, seq + 1)
        backend.events_live = True
