"""The HTTP surface of a real ``kvtier serve``: every route scanned without credentials, and no prompt in what it shows.

The routes come from the app itself (its router and its served schema), so a
route added later is scanned, or fails :func:`test_every_route_is_classified`
until someone says who may call it. The server has tenant API keys and an
admin token, and logs at INFO (``kvtier -v``), so the log holds all it would.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator

import pytest
import requests
from fastapi.routing import APIRoute

from kvtier.server.app import router
from tests.server.live import ADMIN, LiveServer, running

KEY = "sk-security-0123456789"


class Access(enum.Enum):
    OPEN = "anyone"
    API_KEY = "a tenant's API key (the OpenAI routes' own auth, with server.api_keys set)"
    ADMIN = "the admin token"


# Open on purpose: /health; /stats and /metrics, aggregate figures only (no prompt, no tenant's
# cache: see test_no_prompt_text_or_token_ids_in_stats_metrics_or_the_log) and the static page that
# shows them; the API's own schema.
ACCESS = {
    "/health": Access.OPEN,
    "/stats": Access.OPEN,
    "/metrics": Access.OPEN,
    "/dashboard": Access.OPEN,  # a static page with no figure of its own: it polls the open /stats
    "/openapi.json": Access.OPEN,
    "/docs": Access.OPEN,
    "/docs/oauth2-redirect": Access.OPEN,
    "/redoc": Access.OPEN,
    "/v1/models": Access.API_KEY,
    "/v1/completions": Access.API_KEY,
    "/v1/chat/completions": Access.API_KEY,
    "/v1/sessions": Access.API_KEY,
    "/v1/sessions/{session_id}/prefetch": Access.API_KEY,
    "/v1/cache/explain": Access.API_KEY,
    "/v1/kv-events": Access.ADMIN,
    "/admin/clear": Access.ADMIN,
    "/admin/pin": Access.ADMIN,
    "/lookup": Access.ADMIN,
}
BUILT_IN = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's, not in the router
MARKER = "Zq7Plum4412Marker"  # typed by a client; must never come back out
IDS = [31337, 27182, 16180, 14142, 17320, 22360, 26457, 28284, 30000, 31622, 33166, 34641, 36055, 37416, 38729, 40000]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running(tmp_path_factory.mktemp("security"), verbose=True, api_keys={KEY: "sec"}, max_tokens_limit=4) as live:
        yield live


def served_routes(server: LiveServer) -> set[tuple[str, str]]:
    """(method, path) of every route: the router's, and the served schema's (which also sees app-level routes)."""
    out = {(m, r.path) for r in router.routes if isinstance(r, APIRoute) for m in r.methods}
    schema = server.get("/openapi.json").json()
    out |= {(m.upper(), path) for path, ops in schema["paths"].items() for m in ops}
    return out | {("GET", path) for path in BUILT_IN}


def test_every_route_is_classified(server: LiveServer) -> None:
    assert {path for _, path in served_routes(server)} == set(ACCESS)


CREDENTIALS = {
    "none": {},
    "wrong token": {"Authorization": "Bearer sk-wrong-0123456789"},
    "basic auth": {"Authorization": "Basic eDp5"},
    "token in a query": {},
}


def call(server: LiveServer, method: str, path: str, headers: dict[str, str], *, query: str = "") -> int:
    """The status of one call with an empty body; streamed, so an open endless route cannot hold the test."""
    response = requests.request(method, f"{server.url}{path}{query}", headers=headers, json={}, timeout=60, stream=True)
    with response:
        return response.status_code


def test_every_route_needs_its_credential(server: LiveServer) -> None:
    """No token, a wrong one, the wrong scheme, the token as a query parameter: 401 everywhere but the open routes.

    A tenant's API key opens no admin route, and the admin token is no API key.
    """
    wrong: dict[str, int] = {}
    for method, path in sorted(served_routes(server)):
        access = ACCESS[path]
        tries = dict(CREDENTIALS)
        if access is Access.ADMIN:
            tries["a tenant's API key"] = {"Authorization": f"Bearer {KEY}"}
        if access is Access.API_KEY:
            tries["the admin token"] = {"Authorization": f"Bearer {ADMIN}"}
        for what, headers in tries.items():
            query = f"?token={ADMIN}&api_key={KEY}" if what == "token in a query" else ""
            status = call(server, method, path, headers, query=query)
            if (status == 401) is (access is Access.OPEN):
                wrong[f"{method} {path} with {what}"] = status
    assert wrong == {}


def test_the_right_credentials_open_their_routes(server: LiveServer) -> None:
    """The control: the same calls with the right credential are not 401 (so a 401 above was the credential's)."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert server.post("/admin/clear", json={}, headers=admin).status_code == 200
    assert server.post("/lookup", json={"prompt": "x"}, headers=admin).status_code == 400  # names no tenant
    assert server.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_no_prompt_text_or_token_ids_in_stats_metrics_or_the_log(server: LiveServer) -> None:
    """A marker sent every way a prompt can arrive (text, token ids, chat, streamed, refused) appears nowhere after."""
    auth = {"Authorization": f"Bearer {KEY}"}
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
        "/stats": server.get("/stats").text,
        "/metrics": server.get("/metrics").text,
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
