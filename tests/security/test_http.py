"""The HTTP surface of a real ``kvtier serve``: every route scanned without credentials, and no prompt in what it shows.

The routes come from the app's own route table
(:func:`kvtier.server.app.build_app`), so a route added later is scanned, or
fails :func:`test_every_route_is_classified` until someone says who may call
it. The server has tenant API keys, an admin token and a read token, and logs
at INFO (``kvtier -v``), so the log holds all it would.

``kvtier route``'s routes are classified the same way, from its own route
table (:func:`kvtier.route.app.create_app`): its fleet control routes open to
its admin token alone, never to the backends' token it holds.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from fastapi.routing import iter_route_contexts

from kvtier.config import ServerConfig
from kvtier.route.app import RouterState
from kvtier.route.app import create_app as create_router_app
from kvtier.server.app import TOKEN_COOKIE, build_app
from tests.route.hostile import Router, peers, router
from tests.server.live import ADMIN, LiveServer, running

KEY = "sk-security-0123456789"
READ = "read-token-for-tests-0123456789"


class Access(enum.Enum):
    OPEN = "anyone"
    API_KEY = "a tenant's API key (the OpenAI routes' own auth, and the Messages API's, with server.api_keys set)"
    READ = "the read token or the admin token; on these GET routes, also as the cookie /dashboard?token= sets"
    ADMIN = "the admin token"
    FORWARDED = "kvtier route's inference routes: forwarded as sent, the backend that answers asks for its credential"


# With an admin token set, only /health is open (a load balancer's probe needs no secret).
ACCESS = {
    "/health": Access.OPEN,
    "/stats": Access.READ,
    "/metrics": Access.READ,
    "/dashboard": Access.READ,
    "/openapi.json": Access.READ,
    "/docs": Access.READ,
    "/docs/oauth2-redirect": Access.READ,
    "/redoc": Access.READ,
    "/v1/models": Access.API_KEY,
    "/v1/completions": Access.API_KEY,
    "/v1/chat/completions": Access.API_KEY,
    "/v1/messages": Access.API_KEY,  # as x-api-key (the Messages API's header) or bearer
    "/v1/sessions": Access.API_KEY,
    "/v1/sessions/{session_id:path}/prefetch": Access.API_KEY,
    "/v1/cache/explain": Access.API_KEY,
    "/v1/kv-events": Access.ADMIN,
    "/admin/clear": Access.ADMIN,
    "/admin/pin": Access.ADMIN,
    "/admin/prefetch": Access.ADMIN,
    "/admin/settle": Access.ADMIN,
    "/lookup": Access.ADMIN,
}
MARKER = "Zq7Plum4412Marker"  # typed by a client; must never come back out
IDS = [31337, 27182, 16180, 14142, 17320, 22360, 26457, 28284, 30000, 31622, 33166, 34641, 36055, 37416, 38729, 40000]


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("security")
    with running(tmp, verbose=True, api_keys={KEY: "sec"}, read_token=READ, max_tokens_limit=4) as live:
        yield live


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route in the app's route table; anything there that is no HTTP route fails here."""
    out: set[tuple[str, str]] = set()
    for route in iter_route_contexts(build_app(ServerConfig()).routes):  # included routers' routes too
        assert route.methods, f"{route.original_route!r} is no HTTP route: say here who may call it"
        out |= {(m, str(route.path)) for m in route.methods}
    return sorted(out)


def test_every_route_is_classified(server: LiveServer) -> None:
    routes = app_routes()
    assert {path for _, path in routes} == set(ACCESS)
    served = server.get("/openapi.json", headers=bearer(READ)).json()["paths"]
    documented = {(m, re.sub(r":\w+}", "}", path)) for m, path in routes}  # OpenAPI names no path converter
    assert {(m.upper(), path) for path, ops in served.items() for m in ops} <= documented  # this app is the one served


REFUSED = {
    "none": {},
    "wrong token": bearer("sk-wrong-0123456789"),
    "basic auth": {"Authorization": "Basic eDp5"},
    "token in a query": {},
}
# Per route kind, the other kinds' credentials: each must open nothing here. The cookie holds the admin
# token itself, and still opens no admin route, no POST, and no inference.
OTHERS = {
    Access.OPEN: {},
    Access.READ: {"a tenant's API key": bearer(KEY), "a tenant's API key as x-api-key": {"x-api-key": KEY}},
    Access.API_KEY: {
        "the admin token": bearer(ADMIN),
        "the admin token as x-api-key": {"x-api-key": ADMIN},
        "the read token": bearer(READ),
        "the admin token as the dashboard's cookie": {"Cookie": f"{TOKEN_COOKIE}={ADMIN}"},
    },
    Access.ADMIN: {
        "a tenant's API key": bearer(KEY),
        "a tenant's API key as x-api-key": {"x-api-key": KEY},
        "the read token": bearer(READ),
        "the admin token as the dashboard's cookie": {"Cookie": f"{TOKEN_COOKIE}={ADMIN}"},
    },
}


def call(server: LiveServer, method: str, path: str, headers: dict[str, str], *, query: str = "") -> int:
    """The status of one call with an empty body; streamed, so an open endless route cannot hold the test."""
    url = f"{server.url}{path}{query}"
    response = requests.request(method, url, headers=headers, json={}, timeout=60, stream=True, allow_redirects=False)
    with response:
        return response.status_code


def test_every_route_needs_its_credential(server: LiveServer) -> None:
    """No token, a wrong one, the wrong scheme, the token as a query parameter, another kind's: 401 but on /health.

    The one exception is the dashboard's sign-in: ``/dashboard?token=`` with a
    valid token answers 303 (see the cookie test below).
    """
    wrong: dict[str, int] = {}
    for method, path in app_routes():
        access = ACCESS[path]
        for what, headers in {**REFUSED, **OTHERS[access]}.items():
            query = f"?token={ADMIN}&api_key={KEY}" if what == "token in a query" else ""
            status = call(server, method, path, headers, query=query)
            expected = 303 if (path, what) == ("/dashboard", "token in a query") else 401
            if (status == expected) is (access is Access.OPEN):
                wrong[f"{method} {path} with {what}"] = status
    assert wrong == {}


def test_the_read_token_opens_the_readers_routes(server: LiveServer) -> None:
    statuses = {path: call(server, m, path, bearer(READ)) for m, path in app_routes() if ACCESS[path] is Access.READ}
    assert statuses == dict.fromkeys(statuses, 200)


def test_the_dashboards_token_moves_into_a_cookie_that_opens_reading_only(server: LiveServer) -> None:
    """A browser cannot send a bearer header on page load: ``?token=`` once, then an HttpOnly cookie.

    The cookie here holds the admin token, and still opens no admin route.
    """
    browser = requests.Session()
    wrong = browser.get(f"{server.url}/dashboard?token=sk-wrong-0123456789", allow_redirects=False, timeout=60)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    signed_in = browser.get(f"{server.url}/dashboard?token={ADMIN}&interval=250", allow_redirects=False, timeout=60)
    assert signed_in.status_code == 303 and signed_in.headers["location"] == "/dashboard?interval=250"
    attributes = {a.strip().lower() for a in signed_in.headers["set-cookie"].split(";")}
    assert {f"{TOKEN_COOKIE}={ADMIN}", "httponly", "samesite=strict", "path=/"} <= attributes
    assert browser.get(f"{server.url}/dashboard", timeout=60).status_code == 200
    assert browser.get(f"{server.url}/stats", timeout=60).json()["engine"]  # a real report, read with the cookie
    assert browser.post(f"{server.url}/admin/clear", json={}, timeout=60).status_code == 401


def test_the_right_credentials_open_their_routes(server: LiveServer) -> None:
    """The control: the same calls with the right credential are not 401 (so a 401 above was the credential's)."""
    admin = bearer(ADMIN)
    assert server.post("/admin/clear", json={}, headers=admin).status_code == 200
    assert server.post("/lookup", json={"prompt": "x"}, headers=admin).status_code == 400  # names no tenant
    assert server.get("/v1/models", headers=bearer(KEY)).status_code == 200
    assert server.get("/stats", headers=admin).status_code == 200


def test_no_prompt_text_or_token_ids_in_stats_metrics_or_the_log(server: LiveServer) -> None:
    """A marker sent every way a prompt can arrive (text, token ids, chat, streamed, refused) appears nowhere after."""
    auth = bearer(KEY)
    text = f"Remember the code word {MARKER}. " * 8
    chat = [{"role": "system", "content": text}, {"role": "user", "content": f"What is {MARKER}?"}]
    sent = [
        ("/v1/completions", {"prompt": text, "max_tokens": 2}),
        ("/v1/completions", {"prompt": IDS * 3, "max_tokens": 2, "stream": True}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 2, "stream": True}),
        ("/v1/completions", {"prompt": text, "max_tokens": 999}),  # refused: over the server's limit
        ("/v1/completions", {"prompt": IDS, "max_tokens": 2, "temperature": f"{MARKER}"}),  # 422
    ]
    statuses = [server.post(path, json=body, headers=auth).status_code for path, body in sent]
    assert statuses == [200, 200, 200, 200, 400, 422]
    assert sum(server.stats()["engine"]["requests"].values()) >= 4  # the four answered ones are in the figures
    pages = {
        "/stats": server.read("/stats").text,
        "/metrics": server.read("/metrics").text,
        "log": server.log.read_text(),
    }
    assert "POST /v1/completions" in pages["log"]  # the log is at INFO: requests are logged, not their bodies
    ids = [", ".join(map(str, IDS[:4])), ",".join(map(str, IDS[:4])), " ".join(map(str, IDS[:4])), str(IDS[0])]
    leaks = {
        where: [s for s in [MARKER, MARKER.lower(), "code word", *ids] if s.lower() in page.lower()]
        for where, page in pages.items()
    }
    assert leaks == {"/stats": [], "/metrics": [], "log": []}
    json.loads(pages["/stats"])  # a real report was searched, not an error page


# -- kvtier route --------------------------------------------------------------------------------------------
ROUTER_ADMIN = "router-admin-token-0123456789"
ROUTER_ACCESS = {
    "/health": Access.OPEN,
    "/stats": Access.OPEN,  # counts and backend URLs, no prompt
    "/metrics": Access.OPEN,
    "/openapi.json": Access.OPEN,
    "/docs": Access.OPEN,
    "/docs/oauth2-redirect": Access.OPEN,
    "/redoc": Access.OPEN,
    "/v1/models": Access.FORWARDED,
    "/v1/completions": Access.FORWARDED,
    "/v1/chat/completions": Access.FORWARDED,
    "/v1/messages": Access.FORWARDED,
    "/fleet/lookup": Access.ADMIN,  # route.admin_token
    "/fleet/pins": Access.ADMIN,
    "/fleet/pins/{pin_id}": Access.ADMIN,
    "/fleet/prefetch": Access.ADMIN,
    "/fleet/clear": Access.ADMIN,
    "/fleet/usage": Access.ADMIN,
}


def router_routes(state: RouterState) -> list[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    for route in iter_route_contexts(create_router_app(state).routes):
        assert route.methods, f"{route.original_route!r} is no HTTP route: say here who may call it"
        out |= {(m, str(route.path)) for m in route.methods if m != "HEAD"}
    return sorted(out)


async def router_status(r: Router, method: str, path: str, headers: dict[str, str], query: str = "") -> int:
    url = r.url + path.replace("{pin_id}", "0123456789abcdef") + query
    response = await r.client.request(method, url, headers=headers, json={"prompt": "x", "ttl_s": 1, "backend": "x"})
    return response.status_code


def test_the_routers_fleet_routes_open_to_its_admin_token_alone(tmp_path: Path) -> None:
    """No token, a wrong one, another scheme, the token in a query, the backends' token: 401; and with no
    route.admin_token set, the fleet routes refuse every caller."""

    async def run() -> None:
        refused = {**REFUSED, "the backends' token": bearer(ADMIN), "a tenant's API key": bearer(KEY)}
        async with peers({}) as (peer,):
            tokens = {"admin_token": ROUTER_ADMIN, "backend_token": ADMIN}
            async with router(tmp_path / "with", [peer], **tokens) as r:
                routes = router_routes(r.state)
                assert {path for _, path in routes} == set(ROUTER_ACCESS)
                wrong = {}
                for method, path in routes:
                    if ROUTER_ACCESS[path] is not Access.ADMIN:
                        continue
                    for what, headers in refused.items():
                        query = f"?token={ROUTER_ADMIN}" if what == "token in a query" else ""
                        if (status := await router_status(r, method, path, headers, query)) != 401:
                            wrong[f"{method} {path} with {what}"] = status
                    if await router_status(r, method, path, bearer(ROUTER_ADMIN)) == 401:  # the control
                        wrong[f"{method} {path} with its token"] = 401
                assert wrong == {}
            async with router(tmp_path / "without", [peer], backend_token=ADMIN) as r:
                for method, path in router_routes(r.state):
                    if ROUTER_ACCESS[path] is Access.ADMIN:
                        for headers in ({}, bearer(ADMIN), bearer(ROUTER_ADMIN)):
                            assert await router_status(r, method, path, headers) == 401, (method, path)

    asyncio.run(run())
