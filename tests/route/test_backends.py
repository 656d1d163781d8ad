"""The router's health loop against backends whose ``/stats`` lies: an odd reply is ignored (counted, logged
once), never the end of the loop, so a backend that then fails ``/health`` is still taken out, and one that
recovers is brought back in.

Each ``/health`` answer is handed out by the test: while the router's next ``/health`` waits for its answer,
the router's state is exactly what the round before left.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from tests.route.hostile import Handler, Request, peers, reply, router


def stats(in_flight: int) -> bytes:
    return json.dumps({"engine": {"in_flight": in_flight}}).encode()


class Scripted:
    """A backend whose ``/health`` answers are the test's to give, one per check; ``/stats`` says ``body``."""

    def __init__(self) -> None:
        self.health: asyncio.Queue[int] = asyncio.Queue()
        self.body = stats(0)

    def routes(self) -> dict[str, Handler]:
        async def health(request: Request, writer: asyncio.StreamWriter) -> None:
            await reply(await self.health.get(), {"status": "?"})(request, writer)

        async def stats_now(request: Request, writer: asyncio.StreamWriter) -> None:
            await reply(200, self.body)(request, writer)

        return {"/health": health, "/stats": stats_now}


ODD = {
    "a list": b"[]",
    "Infinity": b'{"engine": {"in_flight": Infinity}}',
    "NaN": b'{"engine": {"in_flight": NaN}}',
    "not JSON": b"<html>busy</html>",
    "engine a list": b'{"engine": []}',
    "engine a string": b'{"engine": "up"}',
    "in_flight a string": b'{"engine": {"in_flight": "3"}}',
    "in_flight a list": b'{"engine": {"in_flight": [1]}}',
    "in_flight negative": b'{"engine": {"in_flight": -4}}',
}


@pytest.mark.parametrize("odd", ODD.values(), ids=ODD.keys())
def test_an_odd_stats_reply_is_ignored_and_the_loop_still_takes_out_and_brings_in(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, odd: bytes
) -> None:
    async def run() -> None:
        script = Scripted()
        async with peers(script.routes()) as (peer,), router(tmp_path, [peer], up=False, health_interval_s=0.01) as r:
            backend = r.backend(peer)

            async def round_with(health: int, body: bytes) -> None:
                """Answer the check under way; return once the next one has begun (this one is over)."""
                script.body = body
                script.health.put_nowait(health)
                await peer.next("/health")

            await peer.next("/health")
            await round_with(200, stats(3))
            assert backend.up and backend.others == 3
            await round_with(200, odd)
            await round_with(200, odd)
            (seen,) = (await r.stats())["backends"]
            assert seen["up"] and seen["others"] == 0 and seen["bad_stats"] == 2  # its stats ignored, counted
            await round_with(503, stats(0))
            assert not backend.up  # the loop went on: a failed /health still takes it out
            await round_with(200, stats(1))
            assert backend.up and backend.others == 1  # and a recovered one comes back

    asyncio.run(run())

    odd_logged = [r for r in caplog.records if "/stats" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(odd_logged) == 1


def test_a_check_raising_what_no_clause_names_takes_only_that_backend_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A port past 65535 passes the config's URL check; connecting there, the HTTP client raises an
    # ExceptionGroup, which no clause for HTTP errors catches.
    broken = "http://127.0.0.1:99999"

    async def run() -> None:
        script = Scripted()
        async with (
            peers(script.routes()) as (peer,),
            router(tmp_path, [peer, broken], up=False, health_interval_s=0.01) as r,
        ):
            for _ in range(3):  # three rounds, each begun after the one before ended
                await peer.next("/health")
                script.health.put_nowait(200)
            await peer.next("/health")
            good, bad = (await r.stats())["backends"]
            assert good["up"] and not bad["up"] and bad["check_errors"] >= 3

    asyncio.run(run())

    checks = [r for r in caplog.records if "health check" in r.getMessage() and r.levelno >= logging.ERROR]
    assert len(checks) == 1 and broken in checks[0].getMessage()  # once, though every round raised
