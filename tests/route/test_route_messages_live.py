"""``kvtier route`` over two real ``kvtier serve`` backends, asked through the official ``anthropic`` client: a
message, plain or streamed, is the backend's own answer; the router keys it as the backend does; and the next
turn of a conversation, or of a ``metadata.user_id`` session, goes back to the backend that holds its prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from kvtier.route.prompt import Endpoint
from tests.route.live import Fleet, Proc, fleet, held

pytestmark = pytest.mark.slow  # starts three processes, two of them load the model

BACKEND = "X-Kvtier-Backend"
GREEDY = {"temperature": 0}  # the API's default is 1, and the SDK no longer names it: sent as an extra field
MAX = 6
SYSTEM = "You are a terse assistant. Answer in one short sentence. "


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(tmp_path_factory.mktemp("route-messages"), 2) as f:
        yield f


@pytest.fixture(scope="module")
def model(two: Fleet) -> str:
    return two.router.get("/v1/models").json()["data"][0]["id"]


def client(proc: Proc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proc.url, api_key="sk-any", max_retries=0, timeout=120)


def question(i: int) -> dict[str, Any]:
    return {
        "system": f"Conversation {i}. {SYSTEM * 3}",  # no two share a block
        "messages": [{"role": "user", "content": f"Name {i + 2} colours of the rainbow."}],
    }


def ask(proc: Proc, model: str, body: dict[str, Any]) -> tuple[anthropic.types.Message, str | None]:
    """The message ``proc`` answers, and the backend the router says answered it (None when asked directly)."""
    raw = client(proc).messages.with_raw_response.create(model=model, max_tokens=MAX, extra_body=GREEDY, **body)
    return raw.parse(), raw.headers.get(BACKEND)


def texts(message: anthropic.types.Message) -> list[str]:
    """The answer's text blocks (a streamed message's blocks are of a subclass, so compared by their text)."""
    return [block.text for block in message.content if block.type == "text"]


def by_url(two: Fleet, url: str | None) -> Proc:
    return next(b for b in two.backends if b.url == url)


def test_a_message_through_the_router_is_the_backends_own_answer(two: Fleet, model: str) -> None:
    routed, url = ask(two.router, model, question(0))
    direct, _ = ask(by_url(two, url), model, question(0))
    assert texts(routed) and texts(routed) == texts(direct) and routed.stop_reason == direct.stop_reason

    with client(two.router).messages.stream(model=model, max_tokens=MAX, extra_body=GREEDY, **question(1)) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
        url = stream.response.headers[BACKEND]
    direct, _ = ask(by_url(two, url), model, question(1))
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
    _, url = ask(two.router, model, body)
    sent = {**body, "model": model, "max_tokens": MAX, **GREEDY}
    keys = {bytes(k).hex() for k in two.prompts().read(Endpoint.MESSAGES, sent, "sk-any", None).keys}
    assert len(keys) >= 4
    backend = by_url(two, url)
    deadline = time.monotonic() + 10  # the answer may come before its blocks are stored
    while not keys <= (holds := {k for tier in held(backend).values() for k in tier}):
        assert time.monotonic() < deadline, f"{len(keys - holds)} of {len(keys)} keys not held"
        time.sleep(0.1)


def test_the_next_turn_goes_to_the_backend_holding_its_prefix(two: Fleet, model: str) -> None:
    turns = {i: question(i) for i in range(10, 14)}
    first: dict[int, str | None] = {}
    for i, body in turns.items():
        answer, first[i] = ask(two.router, model, body)
        body["messages"] += [
            {"role": "assistant", "content": "".join(texts(answer))},
            {"role": "user", "content": "And one more?"},
        ]
    assert len(set(first.values())) == 2  # new prompts spread over both backends
    for backend in two.backends:  # the first turns' stored events reached the router
        two.agree(backend)
    cheapest = two.stats()["reasons"].get("cheapest", 0)
    for i, body in turns.items():
        answer, url = ask(two.router, model, body)
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
        seen.add(ask(two.router, model, body)[1])
    assert len(seen) == 1
