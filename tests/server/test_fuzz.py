"""Fuzz every operation of the served OpenAPI schema with schemathesis: whatever arrives, never a 5xx.

The server under test caps max_tokens at 4 (``server.max_tokens_limit``),
which its served schema shows, so generated requests stay fast; the admin
token is sent so the admin and readers' routes are fuzzed past their 401.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, response_schema_conformance

from tests.server.live import ADMIN_AUTH, LiveServer, running

EXAMPLES = 20
OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("GET", "/stats"),
    ("GET", "/metrics"),
    ("POST", "/admin/clear"),
    ("POST", "/admin/pin"),
    ("POST", "/admin/prefetch"),
    ("POST", "/admin/settle"),
    ("POST", "/lookup"),
    ("GET", "/v1/sessions"),
    ("POST", "/v1/sessions/{session_id}/prefetch"),
    ("POST", "/v1/cache/explain"),
]
# Served, never fuzzed: an endless stream (block events for `kvtier route`) would hold each case open forever.
# Its contents are tested in tests/route.
ENDLESS = [("GET", "/v1/kv-events")]
# A generated session id mostly names no live session (404); one the fuzzed completions opened answers 200.
UNKNOWN_IS_404 = {("POST", "/v1/sessions/{session_id}/prefetch")}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running(tmp_path_factory.mktemp("fuzz"), max_tokens_limit=4) as live:
        yield live


@pytest.fixture(scope="module")
def api_schema(server: LiveServer):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=ADMIN_AUTH)


def test_every_operation_is_fuzzed(api_schema) -> None:
    served = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert served == set(OPERATIONS) | set(ENDLESS)


NO_BODY = {("POST", "/admin/settle")}
# Negative cases (schema-invalid on purpose) exist only where there is a body to break.
RUNS = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST" and (m, p) not in NO_BODY
]


@pytest.mark.parametrize(("method", "path", "mode"), RUNS, ids=[f"{m} {p} {g.value}" for m, p, g in RUNS])
def test_no_operation_answers_5xx(api_schema, method: str, path: str, mode: GenerationMode) -> None:
    """Hypothesis drives schemathesis' strategy directly (its pytest plugin does not run on this pytest)."""
    operation = api_schema[path][method]

    # The admin token takes the admin and readers' routes past their 401; inference is open here.
    @given(case=operation.as_strategy(generation_mode=mode, headers=ADMIN_AUTH))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case) -> None:
        statuses.append(case.call_and_validate(checks=checks).status_code)

    # A GET has no body to get wrong: its answer must also match the declared response schema (/stats: every field).
    checks = [not_a_server_error, *([response_schema_conformance] if method == "GET" else [])]

    statuses: list[int] = []
    fuzz()
    if mode is GenerationMode.POSITIVE and (method, path) in UNKNOWN_IS_404:
        assert 404 in statuses and set(statuses) <= {200, 404}, f"sessions answered {sorted(set(statuses))}"
    elif mode is GenerationMode.POSITIVE:
        assert any(200 <= s < 300 for s in statuses), f"no schema-valid case was served: {sorted(set(statuses))}"


def test_the_server_is_still_healthy(server: LiveServer) -> None:
    assert server.get("/health").status_code == 200


def test_a_chat_without_max_tokens_stops_at_the_server_limit(server: LiveServer) -> None:
    done = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Tell me a story."}]})
    assert done.status_code == 200 and 1 <= done.json()["usage"]["completion_tokens"] <= 4


def test_a_completion_without_max_tokens_stops_at_the_server_limit(server: LiveServer) -> None:
    """OpenAI's default of 16 is above this server's limit of 4: the limit wins, the request is not refused."""
    done = server.post("/v1/completions", json={"prompt": "Once upon a time", "temperature": 0})
    assert done.status_code == 200 and 1 <= done.json()["usage"]["completion_tokens"] <= 4
