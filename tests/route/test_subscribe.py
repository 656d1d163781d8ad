"""A backend's block event stream that floods: a line that never ends costs the router its bound, not its
memory; the stream is dropped (its index with it), counted, logged once, and subscribed to again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2 as httpx
import pytest

from kvtier.events import ENCODER, Hello, Snapshot
from kvtier.route.backends import Backend, Fleet
from kvtier.route.subscribe import LineTooLong, _lines, follow
from kvtier.tiers.base import TierKind
from tests.route.hostile import ROOT, Handler, InOrder, Request, Unkeyed, hang, head, peers, router

LIMIT = 256 * 1024


def endless_line(opening: bytes, flood: int) -> Handler:
    """``opening`` lines, then a line with no end: ``flood`` bytes at once, then a byte at a time for ever."""

    async def handle(_: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, "application/x-ndjson") + opening)
        writer.write(b"x" * flood)
        while True:  # never silent, so only the line's length can end it
            await writer.drain()
            await asyncio.sleep(0.05)  # the peer's own pace, not a test waiting
            writer.write(b"x")

    return handle


def first_then(first: Handler, then: Handler) -> Handler:
    calls = 0

    async def handle(request: Request, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        await (first if calls == 1 else then)(request, writer)

    return handle


def test_an_event_line_that_never_ends_drops_the_stream_and_its_index_then_resubscribes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hello = ENCODER.encode(Hello(1, 16, ROOT, [TierKind.HOST])) + b"\n"
    snapshot = ENCODER.encode(Snapshot({TierKind.HOST: ["ab" * 16]})) + b"\n"
    events = first_then(endless_line(hello + snapshot, 4 * LIMIT), hang)

    async def run() -> None:
        async with (
            peers({"/v1/kv-events": events}) as (peer,),
            router(tmp_path, [peer], max_event_line_bytes=LIMIT) as r,
        ):
            await peer.next("/v1/kv-events")
            await peer.next("/v1/kv-events")  # the router gave up the first stream and subscribed again
            (seen,) = (await r.stats())["backends"]
            assert seen["event_overflows"] == 1
            metrics = (await r.client.get(r.url + "/metrics")).text
            assert f'kvtier_route_backend_event_overflows_total{{backend="{peer.url}"}} 1.0' in metrics
            assert not seen["events_live"] and seen["indexed_blocks"] == 0  # the snapshot's keys went with it

    asyncio.run(run())
    logged = [r for r in caplog.records if "event" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(logged) == 1


def test_lines_are_whole_across_chunks_and_bounded_in_length() -> None:
    async def lines(chunks: list[bytes], limit: int) -> list[bytes]:
        async def arriving() -> AsyncIterator[bytes]:
            for chunk in chunks:
                yield chunk

        return [line async for line in _lines(arriving(), limit)]

    assert asyncio.run(lines([b"ab", b"c\nd", b"e\n\nfg\nh"], 3)) == [b"abc", b"de", b"", b"fg"]
    with pytest.raises(LineTooLong):
        asyncio.run(lines([b"ab", b"cd"], 3))
    with pytest.raises(LineTooLong):
        asyncio.run(lines([b"a\nbcde\nf"], 3))


def test_a_failure_of_no_expected_kind_neither_ends_the_subscription_nor_floods_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend named by a URL httpx cannot even try (port 99999 fails inside its task group) raises
    an ``ExceptionGroup``, which no ``except`` of the loop names: the loop must log it once and go on."""
    url = "http://127.0.0.1:99999"
    fleet = Fleet({url: Backend(url, up=True)}, InOrder([url]), Unkeyed.block_size)
    tries = 0
    third = asyncio.Event()

    async def counted(_: httpx.Request) -> None:
        nonlocal tries
        tries += 1
        if tries == 3:
            third.set()

    async def run() -> None:
        async with httpx.AsyncClient(event_hooks={"request": [counted]}) as client:
            following = asyncio.create_task(follow(fleet, fleet.backends[url], Unkeyed(), client, None, LIMIT))  # type: ignore[arg-type]
            await asyncio.wait({following, asyncio.create_task(third.wait())}, return_when=asyncio.FIRST_COMPLETED)
            assert not following.done(), following.exception()
            following.cancel()

    with caplog.at_level(logging.ERROR, logger="kvtier.route"):
        asyncio.run(run())
    assert tries >= 3
    assert len([r for r in caplog.records if "failed; resubscribing" in r.getMessage()]) == 1
    assert not fleet.backends[url].events_live
