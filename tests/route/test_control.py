"""The fleet control API over fake backends: every answer has an entry per backend, a down one reported down and
one that answers nonsense reported as an error; fleet pins are counted, so releasing one keeps the others'
promises. The real backends' side is in test_route_live.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.procs import free_port
from tests.route.hostile import Peer, Router, peers, reply, router

ADMIN = "router-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
TIERS = {"capacity_bytes": 100, "used_bytes": 10, "capacity_blocks": 10, "blocks": 1}
TIER = {**TIERS, "hit_tokens": 3, "miss_tokens": 1, "hit_rate": 0.75}
STATS = {
    "engine": {"in_flight": 0},
    "tiers": {"host": TIER},
    "ttl_pinned_blocks": 2,
    "retained": {"acme": {"host": {"blocks": 2, "bytes": 20, "prefixes": 1, "quota_bytes": 50}}},
}
ANSWERS = {
    "/lookup": reply(
        200,
        {"tenant": "acme", "prompt_tokens": 40, "cached_tokens": 32, "tiers": {"host": 32}, "miss_reason": "absent"},
    ),
    "/admin/pin": reply(
        200,
        {"tenant": "acme", "pinned_blocks": 2, "pinned_tokens": 32, "cached_tokens": 32, "ttl_s": 60, "tier": "host"},
    ),
    "/admin/prefetch": reply(
        200, {"tenant": "acme", "prompt_tokens": 40, "promoted_tokens": {"disk": 16}, "host_tokens": 32}
    ),
    "/admin/clear": reply(200, {"dropped_blocks": {"host": 3}}),
    "/stats": reply(200, STATS),
}
BROKEN = {  # answers that are none: an HTML page, JSON of another shape, an error
    "/lookup": reply(200, b"<html>It works!</html>", "text/html"),
    "/admin/pin": reply(200, {"tenant": "acme"}),
    "/admin/prefetch": reply(200, [1, 2]),
    "/admin/clear": reply(500, {"error": {"message": "disk on fire"}}),
}
PROMPT = {"prompt": "You are a terse assistant.", "tenant": "acme"}


def statuses(answer: dict[str, Any]) -> dict[str, str]:
    return {b["url"]: b["status"] for b in answer["backends"]}


async def call(r: Router, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    response = await r.client.request(method, r.url + path, json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def test_every_answer_has_every_backend_a_down_one_as_down(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there

    async def run() -> None:
        async with peers(ANSWERS, BROKEN) as (good, bad), router(tmp_path, [good, dead, bad], admin_token=ADMIN) as r:
            want = {good.url: "ok", dead: "down", bad.url: "error"}
            looked = await call(r, "POST", "/fleet/lookup", PROMPT)
            assert statuses(looked) == want
            assert looked["backends"][0]["cached_tokens"] == 32 and looked["backends"][0]["tiers"] == {"host": 32}
            assert json.loads((await good.next("/lookup")).body) == PROMPT  # passed as given: it renders and keys
            pinned = await call(r, "POST", "/fleet/pins", {**PROMPT, "ttl_s": 60})
            assert statuses(pinned) == want and pinned["id"]
            assert (await call(r, "GET", "/fleet/pins"))["pins"][0]["backends"] == [good.url]  # where it holds
            cleared = await call(r, "POST", "/fleet/clear", {"tier": "host"})
            assert statuses(cleared) == want and "disk on fire" in cleared["backends"][2]["detail"]
            used = await call(r, "GET", "/fleet/usage")
            assert statuses(used) == want  # the bad one's /stats is a router's minimum: no tiers in it
            assert used["backends"][0]["tiers"]["host"]["hit_rate"] == 0.75
            assert used["tenants"]["acme"] == {
                "retained": {"host": {"blocks": 2, "bytes": 20, "prefixes": 1}},  # of the one backend that answered
                "fleet_pins": 1,
            }
            for url, status in want.items():
                warmed = await call(r, "POST", "/fleet/prefetch", {**PROMPT, "backend": url})
                assert warmed["status"] == status
            released = await call(r, "DELETE", f"/fleet/pins/{pinned['id']}")
            assert statuses(released) == {good.url: "ok"}

    asyncio.run(run())


def test_a_backend_that_hangs_is_down_within_the_timeout(tmp_path: Path) -> None:
    async def hang(_: Any, __: Any) -> None:
        await asyncio.Event().wait()

    async def run() -> None:
        async with (
            peers(ANSWERS, {"/lookup": hang}) as (good, slow),
            router(tmp_path, [good, slow], admin_token=ADMIN, fleet_timeout_s=0.5) as r,
        ):
            looked = await call(r, "POST", "/fleet/lookup", PROMPT)
            assert statuses(looked) == {good.url: "ok", slow.url: "down"}
            assert "fleet_timeout_s" in looked["backends"][1]["detail"]

    asyncio.run(run())


async def pins_sent(peer: Peer) -> list[tuple[str | None, float]]:
    """The (prompt, ttl_s) of each /admin/pin the peer received so far."""
    out = []
    while not peer.arrived["/admin/pin"].empty():
        body = json.loads(peer.arrived["/admin/pin"].get_nowait().body)
        out.append((body.get("prompt"), body["ttl_s"]))
    return out


def test_fleet_pins_are_counted_releasing_one_keeps_the_others(tmp_path: Path) -> None:
    async def run() -> None:
        async with peers(ANSWERS) as (peer,), router(tmp_path, [peer], admin_token=ADMIN) as r:
            first = await call(r, "POST", "/fleet/pins", {**PROMPT, "ttl_s": 600})
            second = await call(r, "POST", "/fleet/pins", {**PROMPT, "ttl_s": 60})  # the same prefix again
            other = await call(r, "POST", "/fleet/pins", {**PROMPT, "prompt": "Another prefix.", "ttl_s": 300})
            theirs = await call(r, "POST", "/fleet/pins", {**PROMPT, "tenant": "else", "ttl_s": 900})  # no block shared
            assert [p for p, _ in await pins_sent(peer)] == [PROMPT["prompt"]] * 2 + [
                "Another prefix.",
                PROMPT["prompt"],
            ]

            released = await call(r, "DELETE", f"/fleet/pins/{first['id']}")
            assert released["backends"][0]["kept_by"] == [second["id"], other["id"]]
            sent = await pins_sent(peer)  # no unpin: the second asks for the same prefix; both others set again
            assert [p for p, _ in sent] == [PROMPT["prompt"], "Another prefix."]  # the shortest first
            assert 0 < sent[0][1] <= 60 and 60 < sent[1][1] <= 300

            await call(r, "DELETE", f"/fleet/pins/{other['id']}")
            sent = await pins_sent(peer)
            assert sent[0] == ("Another prefix.", 0) and [p for p, _ in sent[1:]] == [PROMPT["prompt"]]

            await call(r, "DELETE", f"/fleet/pins/{second['id']}")
            assert await pins_sent(peer) == [(PROMPT["prompt"], 0)]  # the last one: unpinned
            assert [p["id"] for p in (await call(r, "GET", "/fleet/pins"))["pins"]] == [theirs["id"]]
            gone = await r.client.delete(r.url + f"/fleet/pins/{second['id']}", headers=AUTH)
            assert gone.status_code == 404

    asyncio.run(run())


def test_a_tenants_clear_releases_its_pins_then_drops_its_blocks(tmp_path: Path) -> None:
    async def run() -> None:
        async with peers(ANSWERS) as (peer,), router(tmp_path, [peer], admin_token=ADMIN) as r:
            mine = await call(r, "POST", "/fleet/pins", {**PROMPT, "ttl_s": 60})
            theirs = await call(r, "POST", "/fleet/pins", {**PROMPT, "tenant": "other", "ttl_s": 60})
            cleared = await call(r, "POST", "/fleet/clear", {"tenant": "acme"})
            assert cleared["released_pins"] == [mine["id"]] and statuses(cleared) == {peer.url: "ok"}
            assert cleared["backends"][0]["dropped_blocks"] == {"host": 3}
            assert json.loads(peer.arrived["/admin/clear"].get_nowait().body) == {"tenant": "acme"}
            assert [p["id"] for p in (await call(r, "GET", "/fleet/pins"))["pins"]] == [theirs["id"]]

    asyncio.run(run())


@pytest.mark.parametrize("bad", [{"backends": ["http://nowhere:1"], "ttl_s": 5}, {"ttl_s": 0}, {"ttl_s": 5, "x": 1}])
def test_a_bad_pin_request_is_refused_before_any_backend_is_asked(tmp_path: Path, bad: dict[str, Any]) -> None:
    async def run() -> None:
        async with peers(ANSWERS) as (peer,), router(tmp_path, [peer], admin_token=ADMIN) as r:
            response = await r.client.post(r.url + "/fleet/pins", json={**PROMPT, **bad}, headers=AUTH)
            assert response.status_code in (404, 422)
            assert peer.arrived["/admin/pin"].empty()

    asyncio.run(run())
