"""Keeping the index: one subscription per backend to its block event stream (``GET /v1/kv-events``),
or, for a vLLM backend, to its KV event publisher (ZMQ, :mod:`kvtier.route.vllm`).

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
from collections.abc import AsyncIterator

import httpx2 as httpx
import msgspec

from kvtier.events import DECODER, PING_S, Cleared, Hello, Removed, Snapshot, Stored
from kvtier.keys import BlockKey
from kvtier.route.backends import Backend, Fleet
from kvtier.route.prompt import Prompts
from kvtier.route.vllm import VllmKeys, split

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
    warned = failed = False
    while True:
        try:
            await _read(fleet, backend, prompts, client, token, limit)
        except KeyMismatch as err:
            lost(fleet, backend)
            if not warned:
                log.error("%s; routing to it by load only", err)
                warned = True
            await asyncio.sleep(30 * RETRY_S)
            continue
        except LineTooLong as err:
            _overflowed(backend, err)
        except (httpx.HTTPError, msgspec.DecodeError, ValueError) as err:
            if backend.events_live:
                log.warning("lost the block events of %s (%s); resubscribing", backend.url, type(err).__name__)
        except Exception:  # the loop outlives anything one backend does; routing by load meanwhile
            if not failed:
                log.exception("following the block events of %s failed; resubscribing", backend.url)
                failed = True
        lost(fleet, backend)
        await asyncio.sleep(RETRY_S)


def _overflowed(backend: Backend, err: LineTooLong) -> None:
    backend.event_overflows += 1
    if backend.event_overflows == 1:
        log.error("dropped the block events of %s: %s (route.max_event_line_bytes); resubscribing", backend.url, err)


# -- vLLM backends: ZMQ, msgpack (kvtier.route.vllm) ------------------------------------------------------
async def follow_vllm(fleet: Fleet, backend: Backend, prompts: Prompts, endpoint: str) -> None:
    """Subscribe to a vLLM instance's KV events at ``endpoint`` (its ``--kv-events-config`` publisher).

    vLLM sends no snapshot: the index of a vLLM backend holds what it stored
    since the router subscribed. A gap in the sequence numbers means lost
    events, so its index is dropped and rebuilt from the events that follow.
    """
    try:
        import zmq
        import zmq.asyncio
    except ImportError:
        log.error("%s: following vLLM's KV events needs pyzmq (pip install 'kvtier[route-vllm]')", backend.url)
        return
    keys = VllmKeys(backend.url, prompts.hasher, prompts.namespace, fleet.index, fleet.guesses)
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    backend.events_live = True
    expected: int | None = None
    try:
        while True:
            frames = await socket.recv_multipart()
            try:
                seq, payload = split(frames)
                if expected is not None and seq != expected:
                    log.warning("%s: vLLM KV events %d..%d lost; index rebuilt from here", backend.url, expected, seq)
                    fleet.index.drop(backend.url)
                expected = seq + 1
                keys.apply(payload)
            except msgspec.DecodeError as err:
                log.warning("%s: a vLLM KV event message could not be read: %s", backend.url, err)
    finally:
        socket.close(linger=0)
