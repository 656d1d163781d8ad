"""``kvtier route`` over two real ``kvtier serve`` backends: turns find their prefix, streams pass through
unchanged, the index follows evictions, and a backend killed mid-run loses no request; and the Messages API
through the router, asked with the official ``anthropic`` client: a message, plain or streamed, is the backend's
own answer, the router keys it as the backend does, and the next turn of a conversation, or of a
``metadata.user_id`` session, goes back to the backend that holds its prefix."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import pytest
import requests

from kvtier.route.prompt import Endpoint
from tests.route.live import Fleet, Proc, fleet, held
from tests.server.live import ADMIN, BLOCK_BYTES

pytestmark = pytest.mark.slow  # starts three processes, two of them load the model

BACKEND = "X-Kvtier-Backend"
SYSTEM = "You are a terse assistant. Answer in one short sentence. "


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # A host tier of 12 blocks: a few conversations overflow it, so blocks are evicted (demoted to disk).
    sizes = {"host": {"capacity_bytes": 12 * BLOCK_BYTES}}
    with fleet(tmp_path_factory.mktemp("route"), 2, sizes=sizes) as f:
        yield f


def conversation(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Conversation {i}. {SYSTEM * 3}"},  # no two share a block
        {"role": "user", "content": f"Name {i + 2} colours of the rainbow."},
    ]


def chat(proc: Proc, messages: list[dict[str, str]], **kw: Any) -> requests.Response:
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, **kw}
    response = proc.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def test_second_turn_lands_on_the_backend_holding_its_prefix(two: Fleet) -> None:
    first: dict[int, str] = {}
    turns = {i: conversation(i) for i in range(4)}
    for i, messages in turns.items():
        answer = chat(two.router, messages)
        first[i] = answer.headers[BACKEND]
        messages += [
            {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And one more?"},
        ]
    assert len(set(first.values())) == 2  # new prompts spread over both backends
    for backend in two.backends:  # the first turns' stored events reached the router
        two.agree(backend)
    for i, messages in turns.items():
        answer = chat(two.router, messages)
        assert answer.headers[BACKEND] == first[i]
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    stats = two.stats()
    assert stats["reasons"]["cheapest"] == 8 and stats["failed"] == 0


def test_session_sticks_to_its_backend(two: Fleet) -> None:
    seen = set()
    for i in range(3):
        messages = [{"role": "user", "content": f"Unrelated question number {i}: what is {i} plus {i}?"}]
        seen.add(chat(two.router, messages, user="agent-7").headers[BACKEND])
    assert len(seen) == 1
    (sticky,) = seen
    header = requests.post(
        two.router.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Another one."}], "max_tokens": 2},
        headers={"X-Session-ID": "agent-7"},
        timeout=120,
    )
    assert header.headers[BACKEND] == sticky


def sse_events(response: requests.Response) -> list[dict[str, Any]]:
    lines = [line for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def _without_ids(event: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in ("id", "created")}


def test_stream_passes_through_unchanged(two: Fleet) -> None:
    messages = conversation(9)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    routed = two.router.post("/v1/chat/completions", json=body)
    backend = next(b for b in two.backends if b.url == routed.headers[BACKEND])
    direct = backend.post("/v1/chat/completions", json=body)
    assert routed.headers["content-type"].startswith("text/event-stream")
    via_router, straight = sse_events(routed), sse_events(direct)
    assert len(via_router) > 2
    assert [_without_ids(e) for e in via_router] == [_without_ids(e) for e in straight]


def _load(two: Fleet, url: str) -> tuple[int, int]:
    b = next(b for b in two.stats()["backends"] if b["url"] == url)
    return b["open_requests"], b["queued_tokens"]


def test_a_requests_prefill_leaves_the_queue_at_its_first_output(two: Fleet) -> None:
    body = {"messages": conversation(30), "max_tokens": 8, "temperature": 0, "stream": True}
    with requests.post(two.router.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        events = r.iter_lines()
        next(line for line in events if line.startswith(b"data: "))  # the router relays from the first output on
        assert _load(two, r.headers[BACKEND]) == (1, 0)  # still open, nothing left to prefill
        assert b"data: [DONE]" in list(events)
    assert _load(two, r.headers[BACKEND]) == (0, 0)


# -- the Messages API through the router, asked with the official anthropic client -------------------------
MESSAGES_GREEDY = {"temperature": 0}  # the API's default is 1, and the SDK no longer names it: an extra field
MESSAGES_MAX = 6


@pytest.fixture(scope="module")
def model(two: Fleet) -> str:
    return two.router.get("/v1/models").json()["data"][0]["id"]


def anthropic_client(proc: Proc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proc.url, api_key="sk-any", max_retries=0, timeout=120)


def question(i: int) -> dict[str, Any]:
    return {
        "system": f"Message conversation {i}. {SYSTEM * 3}",  # no two share a block, nor a chat conversation's
        "messages": [{"role": "user", "content": f"Name {i + 2} colours of the rainbow."}],
    }


def ask_message(proc: Proc, model: str, body: dict[str, Any]) -> tuple[anthropic.types.Message, str | None]:
    """The message ``proc`` answers, and the backend the router says answered it (None when asked directly)."""
    raw = anthropic_client(proc).messages.with_raw_response.create(
        model=model, max_tokens=MESSAGES_MAX, extra_body=MESSAGES_GREEDY, **body
    )
    return raw.parse(), raw.headers.get(BACKEND)


def texts(message: anthropic.types.Message) -> list[str]:
    """The answer's text blocks (a streamed message's blocks are of a subclass, so compared by their text)."""
    return [block.text for block in message.content if block.type == "text"]


def by_url(two: Fleet, url: str | None) -> Proc:
    return next(b for b in two.backends if b.url == url)


def test_a_message_through_the_router_is_the_backends_own_answer(two: Fleet, model: str) -> None:
    routed, url = ask_message(two.router, model, question(0))
    direct, _ = ask_message(by_url(two, url), model, question(0))
    assert texts(routed) and texts(routed) == texts(direct) and routed.stop_reason == direct.stop_reason

    with anthropic_client(two.router).messages.stream(
        model=model, max_tokens=MESSAGES_MAX, extra_body=MESSAGES_GREEDY, **question(1)
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
        url = stream.response.headers[BACKEND]
    direct, _ = ask_message(by_url(two, url), model, question(1))
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert texts(streamed) == texts(direct) and streamed.stop_reason == direct.stop_reason


def test_the_router_keys_a_message_as_its_backend_does(two: Fleet, model: str) -> None:
    """Tools, system and tool blocks rendered alike: every full block of the prompt the router keys is one the
    backend that served it now holds."""
    call = {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}}
    body = {
        "tools": [{"name": "ls", "description": "List the files in a folder.", "input_schema": {"type": "object"}}],
        "system": SYSTEM * 2,
        "messages": [
            {"role": "user", "content": "Which files are there?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look. "}, call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py b.py"}]},
        ],
    }
    _, url = ask_message(two.router, model, body)
    sent = {**body, "model": model, "max_tokens": MESSAGES_MAX, **MESSAGES_GREEDY}
    keys = {bytes(k).hex() for k in two.prompts().read(Endpoint.MESSAGES, sent, "sk-any", None).keys}
    assert len(keys) >= 4
    backend = by_url(two, url)
    settled = backend.post("/admin/settle", headers={"Authorization": f"Bearer {ADMIN}"})  # its stores landed
    assert settled.status_code == 200
    assert keys <= {k for tier in held(backend).values() for k in tier}


def test_the_next_turn_goes_to_the_backend_holding_its_prefix(two: Fleet, model: str) -> None:
    turns = {i: question(i) for i in range(10, 14)}
    first: dict[int, str | None] = {}
    for i, body in turns.items():
        answer, first[i] = ask_message(two.router, model, body)
        body["messages"] += [
            {"role": "assistant", "content": "".join(texts(answer))},
            {"role": "user", "content": "And one more?"},
        ]
    assert len(set(first.values())) == 2  # new prompts spread over both backends
    for backend in two.backends:  # the first turns' stored events reached the router
        two.agree(backend)
    cheapest = two.stats()["reasons"].get("cheapest", 0)
    for i, body in turns.items():
        answer, url = ask_message(two.router, model, body)
        assert url == first[i]
        assert (answer.usage.cache_read_input_tokens or 0) > 0
    stats = two.stats()
    assert stats["reasons"]["cheapest"] == cheapest + 4 and stats["failed"] == 0


def test_a_metadata_user_id_session_sticks_to_its_backend(two: Fleet, model: str) -> None:
    seen = set()
    for i in range(3):
        body = {
            "messages": [{"role": "user", "content": f"Unrelated question number {i}: what is {i} plus {i}?"}],
            "metadata": {"user_id": "agent-9"},
        }
        seen.add(ask_message(two.router, model, body)[1])
    assert len(seen) == 1


# -- the fleet control API over the real backends -----------------------------------------------------------
def ttl_pinned(backend: Proc) -> int:
    return backend.get("/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()["ttl_pinned_blocks"]


def test_the_fleet_api_looks_up_pins_warms_and_counts_over_real_backends(two: Fleet) -> None:
    """A conversation served by one backend: the lookup finds it there alone; two disk pins of it there hold it
    through a host clear, and the prefetch brings it back up from disk; releasing one pin keeps the other's."""
    messages = conversation(40)
    served = by_url(two, chat(two.router, messages).headers[BACKEND])
    other = next(b for b in two.backends if b is not served)
    assert served.post("/admin/settle", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200

    looked = {b["url"]: b for b in two.control("POST", "/fleet/lookup", {"messages": messages})["backends"]}
    assert {b["status"] for b in looked.values()} == {"ok"}
    assert looked[served.url]["cached_tokens"] > 0 and looked[other.url]["cached_tokens"] == 0

    before = ttl_pinned(served)
    body = {"messages": messages, "tier": "disk", "backends": [served.url]}
    first = two.control("POST", "/fleet/pins", {**body, "ttl_s": 600})
    second = two.control("POST", "/fleet/pins", {**body, "ttl_s": 300})
    (pinned,) = first["backends"]
    assert pinned["status"] == "ok" and pinned["pinned_blocks"] > 0
    assert ttl_pinned(served) == before + pinned["pinned_blocks"]

    cleared = two.control("POST", "/fleet/clear", {"tier": "host", "backends": [served.url]})
    assert cleared["backends"][0]["dropped_blocks"]["host"] > 0
    warmed = two.control("POST", "/fleet/prefetch", {"messages": messages, "backend": served.url})
    assert warmed["status"] == "ok" and warmed["promoted_tokens"]["disk"] > 0 and warmed["host_tokens"] > 0

    released = two.control("DELETE", f"/fleet/pins/{first['id']}")
    assert released["backends"] == [{"url": served.url, "status": "ok", "detail": None, "kept_by": [second["id"]]}]
    assert ttl_pinned(served) == before + pinned["pinned_blocks"]  # the second pin's promise stands
    two.control("DELETE", f"/fleet/pins/{second['id']}")
    assert ttl_pinned(served) == before

    used = {b["url"]: b for b in two.control("GET", "/fleet/usage")["backends"]}
    assert {b["status"] for b in used.values()} == {"ok"}
    assert used[served.url]["tiers"]["host"]["blocks"] > 0 and used[served.url]["ttl_pinned_blocks"] == before


def test_events_keep_the_index_right_through_evictions_and_clears(two: Fleet) -> None:
    for i in range(10, 16):  # more than the 12-block host tiers hold: host evicts, demoting to disk
        chat(two.router, conversation(i))
    for backend in two.backends:
        counts = two.agree(backend)
        assert counts.get("disk", 0) > 0 and counts.get("host", 0) <= 12
    backend = two.backends[0]
    cleared = backend.post("/admin/clear", json={"tier": "host"}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert cleared.status_code == 200
    assert "host" not in two.agree(backend)


def test_backend_killed_mid_run_loses_no_request(two: Fleet) -> None:
    """Last in this module: it kills one of the module's backends."""
    victim = two.backends[1]

    def ask(i: int) -> str:
        """A plain request must be answered; a stream may be cut, but only after its output began."""
        stream = i % 2 == 1  # a stream opens before its prefill: that opening is held back until output comes
        body = {"messages": conversation(100 + i), "max_tokens": 6, "temperature": 0, "stream": stream}
        try:
            response = requests.post(two.router.url + "/v1/chat/completions", json=body, timeout=120, stream=stream)
            chunks = list(response.iter_content(None)) if stream else [response.content]
        except requests.exceptions.ChunkedEncodingError:
            return "cut after output"  # the router had relayed output already: nothing left to retry
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        return "ok" if not stream or b"[DONE]" in b"".join(chunks) else "cut after output"

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, i) for i in range(12)]
        time.sleep(1.0)
        victim.process.send_signal(signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    assert outcomes[::2] == ["ok"] * 6  # every plain request answered
    assert set(outcomes[1::2]) <= {"ok", "cut after output"}
    stats = two.stats()
    assert stats["failed"] == 0
    assert not next(b for b in stats["backends"] if b["url"] == victim.url)["up"]
    assert chat(two.router, conversation(200)).headers[BACKEND] == two.backends[0].url
