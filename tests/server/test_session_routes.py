"""Agent sessions and explain on a real ``kvtier serve``: turns by header or ``user``, prefetch, /stats, explain."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.live import LiveServer, running

ALPHA, BETA = "sk-alpha-sessions-0123456789", "sk-beta-sessions-0123456789"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
MARKER = "Zyxwv-session-marker"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    sections = {"cache": {"write_mode": "write_through"}}  # every block on disk too: prefetch has something to move
    with running(tmp_path_factory.mktemp("sessions"), sections, api_keys={ALPHA: "alpha", BETA: "beta"}) as live:
        yield live


def auth(key: str, session: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    return headers if session is None else {**headers, "X-Session-ID": session}


def transcript(stamp: str) -> list[dict[str, str]]:
    system = f"You are a coding agent. The time is {stamp}. Answer briefly. {MARKER} " + "Rules follow. " * 12
    return [{"role": "system", "content": system}, {"role": "user", "content": "List the files."}]


def turn(server: LiveServer, key: str, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    session = kw.pop("session", None)
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **kw}
    response = server.post("/v1/chat/completions", json=body, headers=auth(key, session))
    response.raise_for_status()
    return response.json()


def explain(server: LiveServer, key: str, body: dict[str, Any], session: str | None = None) -> dict[str, Any]:
    response = server.post("/v1/cache/explain", json=body, headers=auth(key, session))
    response.raise_for_status()
    return response.json()


def stored(server: LiveServer, key: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    """Explain until the turn's blocks have landed (stores finish behind the response); no sleeping."""
    for _ in range(500):
        why = explain(server, key, {"messages": messages})
        if why["cached_tokens"] >= why["prompt_tokens"] // 16 * 16:
            return why
    raise AssertionError(f"the blocks never landed: {why}")


def test_explain_names_where_a_changed_system_prompt_diverged(server: LiveServer) -> None:
    first, second = transcript("2026-12-04 08:00:01"), transcript("2026-12-04 08:00:59")
    body = {"model": MODEL, "messages": first, "max_tokens": 2, "temperature": 0, "user": "agent-1"}
    server.post("/v1/chat/completions", json=body, headers=auth(ALPHA)).raise_for_status()
    warm = stored(server, ALPHA, first)
    assert warm["reason"] in ("partial_tail", "all_cached")
    why = explain(server, ALPHA, {"messages": second, "user": "agent-1"})
    assert why["reason"] == "session_diverged"
    at = why["divergence"]["position"]
    assert why["first_miss_token"] <= at < why["first_miss_token"] + 16
    assert "01" in why["divergence"]["before"] and "59" in why["divergence"]["now"]
    # The same question from another tenant, naming the same session, sees nothing of alpha's.
    other = explain(server, BETA, {"messages": second, "user": "agent-1"})
    assert other["reason"] == "never_stored" and other["divergence"] is None and other["cached_tokens"] == 0
    # After the changed turn is sent, explain still names where it left the turn before.
    server.post("/v1/chat/completions", json={**body, "messages": second}, headers=auth(ALPHA)).raise_for_status()
    assert explain(server, ALPHA, {"messages": second, "user": "agent-1"})["divergence"]["position"] == at
    assert explain(server, ALPHA, {"messages": second, "model": "gpt-4o"})["reason"] == "other_model"


def test_prefetch_promotes_a_session_to_host(server: LiveServer) -> None:
    messages = transcript("prefetch")
    turn(server, ALPHA, messages, session="agent-2")
    stored(server, ALPHA, messages)
    for _ in range(500):  # blocks still being written through to disk are pinned in host: clear once they are done
        for tier in ("host", "device"):
            assert server.admin_post("/admin/clear", {"tier": tier}).status_code == 200
        cold = explain(server, ALPHA, {"messages": messages})
        if "host" not in cold["tiers"]:
            break
    assert cold["tiers"].get("host", 0) == 0 and cold["tiers"]["disk"] > 0
    done = server.post("/v1/sessions/agent-2/prefetch", headers=auth(ALPHA)).json()
    assert done["promoted_tokens"]["disk"] == cold["tiers"]["disk"]
    assert done["host_tokens"] == done["device_tokens"] == done["transcript_tokens"] // 16 * 16
    assert explain(server, ALPHA, {"messages": messages})["tiers"] == {"host": done["host_tokens"]}
    assert server.post("/v1/sessions/agent-2/prefetch", headers=auth(BETA)).status_code == 404  # alpha's session
    after = turn(server, ALPHA, messages, session="agent-2")  # the next turn finds it all in the pool
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == done["device_tokens"]


@pytest.mark.parametrize("path", ["team/agent-9", "team%2Fagent-9"])
def test_a_session_id_with_a_slash_can_be_prefetched(server: LiveServer, path: str) -> None:
    messages = transcript("slash")
    turn(server, ALPHA, messages, session="team/agent-9")
    stored(server, ALPHA, messages)
    done = server.post(f"/v1/sessions/{path}/prefetch", headers=auth(ALPHA))
    assert done.status_code == 200, done.text
    assert done.json()["session"] == "team/agent-9"
    assert done.json()["host_tokens"] == done.json()["transcript_tokens"] // 16 * 16


def test_sessions_show_counts_never_text(server: LiveServer) -> None:
    messages = transcript("stats")
    for _ in range(2):
        turn(server, ALPHA, messages, session="agent-3")
    mine = server.get("/v1/sessions", headers=auth(ALPHA)).json()
    entry = next(s for s in mine["sessions"] if s["session"] == "agent-3")
    assert entry["turns"] == 2 and entry["prompt_tokens"] > 0 and 0 < entry["hit_rate"] <= 1
    assert all(s["session"] != "agent-3" for s in server.get("/v1/sessions", headers=auth(BETA)).json()["sessions"])
    stats = server.read("/stats")
    report = stats.json()["sessions"]
    assert report["live"] >= 1 and len(report["sessions"]) == report["live"]
    assert MARKER not in stats.text and "agent-3" not in stats.text  # hashed ids, no token text
