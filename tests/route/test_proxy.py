"""Forwarding against backends that lie or hang: a broken answer, or a backend that misses its bounds, costs a
retry on the next backend while nothing has reached the client, and a clean error once something has.

The bounds are set to a second here; the good backends answer at once, and the hostile ones never would.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvtier.route.answer import Lines, carries_output
from kvtier.route.proxy import BACKEND_HEADER
from tests.route.hostile import (
    CHAT,
    JSON,
    MESSAGES,
    MESSAGES_ENDING,
    MESSAGES_OPENING,
    SSE,
    Handler,
    Request,
    chat_answer,
    chat_event,
    hang,
    head,
    message_answer,
    message_event,
    peers,
    reply,
    router,
    text_event,
    then_hang,
    trickle,
)

BOUNDS = {"first_byte_timeout_s": 1.0, "idle_timeout_s": 1.0}
OPENING = b'data: {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
FINE = {CHAT: chat_answer("fine"), MESSAGES: message_answer("fine")}


def good(path: str) -> dict[str, Handler]:
    return {path: reply(200, FINE[path])}


GOOD = good(CHAT)


def streamed(*events: bytes, every_s: float = 0.0, end: bytes = DONE) -> Handler:
    """An event stream of ``events``, one each ``every_s``, then ``end`` (a chat stream's ``[DONE]``) and the end."""

    async def handle(_: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, SSE))
        for event in (*events, end):
            await asyncio.sleep(every_s)  # the peer's own pace, not a test waiting
            writer.write(event)
            await writer.drain()
        writer.close()

    return handle


def ends_after(sent: bytes) -> Handler:
    """Event-stream headers, ``sent``, and the end of the answer."""

    async def handle(_: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, SSE) + sent)
        await writer.drain()
        writer.close()

    return handle


def data_events(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e.startswith("data: ")]


def openai_error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def anthropic_error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    return body["error"]


def pinging(sent: bytes, every_s: float = 0.05) -> Handler:
    """Headers, then ``sent``, then a Messages ``ping`` event every ``every_s``, for ever."""

    async def handle(_: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, SSE) + sent)
        while True:
            await writer.drain()
            await asyncio.sleep(every_s)  # the peer's own pace, not a test waiting
            writer.write(message_event("ping"))

    return handle


# -- defect: a broken answer relayed as a success ----------------------------------------------------------
BROKEN = {
    "cut-off JSON": reply(200, b'{"id": "c", "choices": [{"index": 0, "mess'),
    "HTML": reply(200, b"<html><body>It works!</body></html>", "text/html"),
    "JSON of another shape": reply(200, {"id": "c", "object": "chat.completion"}),
    "choices not a list": reply(200, {"id": "c", "choices": "none"}),
    "a JSON list": reply(200, [chat_answer()]),
    "deeply nested JSON": reply(200, b'{"choices": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"),
    "an event stream that ends before any output": ends_after(OPENING),
}
BROKEN_MESSAGES = {
    "cut-off JSON": reply(200, b'{"type": "message", "content": [{"type": "te'),
    "HTML": reply(200, b"<html><body>It works!</body></html>", "text/html"),
    "a chat completion": reply(200, chat_answer()),
    "an error object as a 200": reply(200, {"type": "error", "error": {"type": "api_error", "message": "no"}}),
    "content not a list": reply(200, {**message_answer(), "content": "hi"}),
    "no type": reply(200, {k: v for k, v in message_answer().items() if k != "type"}),
    "a stream that ends after its opening": ends_after(MESSAGES_OPENING + message_event("ping")),
}
BROKEN_ON = {
    **{f"chat: {name}": (CHAT, handler) for name, handler in BROKEN.items()},
    **{f"messages: {name}": (MESSAGES, handler) for name, handler in BROKEN_MESSAGES.items()},
}


@pytest.mark.parametrize(("path", "broken"), BROKEN_ON.values(), ids=BROKEN_ON.keys())
def test_a_broken_answer_is_retried_on_the_next_backend(tmp_path: Path, path: str, broken: Handler) -> None:
    async def run() -> None:
        async with peers({path: broken}, good(path)) as (bad, good_one), router(tmp_path, [bad, good_one]) as r:
            answer = await r.ask(path)
            assert answer.status_code == 200 and answer.json() == FINE[path]
            assert answer.headers[BACKEND_HEADER] == good_one.url
            stats = await r.stats()
            assert (stats["broken"], stats["retried"], stats["failed"]) == (1, 1, 0)
            assert [b["failures"] for b in stats["backends"]] == [1, 0]
            assert all(b["up"] for b in stats["backends"])  # an answer it could not read, not a dead backend

    asyncio.run(run())


def test_when_every_backend_answers_broken_the_client_gets_a_502_in_openai_shape(tmp_path: Path) -> None:
    html = reply(200, b"<html>oops</html>", "text/html")

    async def run() -> None:
        async with peers({CHAT: html}, {CHAT: html}) as both, router(tmp_path, both) as r:
            answer = await r.chat()
            assert answer.status_code == 502
            assert openai_error(answer.json())["type"] == "bad_gateway"
            stats = await r.stats()
            assert (stats["requests"], stats["broken"], stats["failed"]) == (1, 2, 1)
            assert "kvtier_route_broken_total 2.0" in (await r.client.get(r.url + "/metrics")).text

    asyncio.run(run())


def test_a_backends_own_4xx_is_relayed_as_is_and_not_retried(tmp_path: Path) -> None:
    refusal = {"error": {"message": "max_tokens too large", "type": "invalid_request_error", "param": None}}

    async def run() -> None:
        async with peers({CHAT: reply(400, refusal)}, GOOD) as both, router(tmp_path, both) as r:
            answer = await r.chat()
            assert (answer.status_code, answer.json()) == (400, refusal)
            assert (await r.stats())["retried"] == 0

    asyncio.run(run())


def test_a_stream_passes_through_unchanged(tmp_path: Path) -> None:
    events = (OPENING, chat_event("Hel"), b": keep-alive\n\n", chat_event("lo"))

    async def run() -> None:
        async with peers({CHAT: streamed(*events)}) as (backend,), router(tmp_path, [backend]) as r:
            answer = await r.chat(stream=True)
            assert answer.status_code == 200
            assert answer.content == b"".join(events) + b"data: [DONE]\n\n"

    asyncio.run(run())


# -- defect: a hung backend held without bound -------------------------------------------------------------
HUNG = {
    "before its headers": hang,
    "after JSON headers": then_hang(b"", JSON),
    "inside its JSON body": then_hang(b'{"id": "c", "choices": [', JSON),
    "after event-stream headers": then_hang(b""),
    "after the opening chunk": then_hang(OPENING),
    "trickling keep-alive comments": trickle(OPENING),
}
HUNG_MESSAGES = {
    "after the opening": then_hang(MESSAGES_OPENING),
    "pinging after the opening": pinging(MESSAGES_OPENING),  # the API's keep-alive is no output either
}
HUNG_ON = {
    **{f"chat: {name}": (CHAT, handler) for name, handler in HUNG.items()},
    **{f"messages: {name}": (MESSAGES, handler) for name, handler in HUNG_MESSAGES.items()},
}


@pytest.mark.parametrize(("path", "hung"), HUNG_ON.values(), ids=HUNG_ON.keys())
def test_a_backend_that_hangs_before_its_first_output_is_taken_out_and_the_request_goes_on(
    tmp_path: Path, path: str, hung: Handler
) -> None:
    async def run() -> None:
        async with (
            peers({path: hung}, good(path)) as (slow, good_one),
            router(tmp_path, [slow, good_one], **BOUNDS) as r,
        ):
            answer = await r.ask(path)
            assert answer.status_code == 200 and answer.headers[BACKEND_HEADER] == good_one.url
            stats = await r.stats()
            assert (stats["timed_out"], stats["retried"], stats["failed"]) == (1, 1, 0)
            assert r.backend(slow).epoch == 1  # taken out once, as a failed health check does

    asyncio.run(run())


def test_when_every_backend_hangs_the_client_gets_a_504_in_openai_shape(tmp_path: Path) -> None:
    async def run() -> None:
        async with peers({CHAT: hang}, {CHAT: trickle()}) as both, router(tmp_path, both, **BOUNDS) as r:
            answer = await r.chat(stream=True)
            assert answer.status_code == 504
            assert openai_error(answer.json())["code"] == "backend_timeout"
            assert (await r.stats())["timed_out"] == 2

    asyncio.run(run())


SILENT = {"silent": then_hang, "trickling keep-alive comments": trickle}


@pytest.mark.parametrize("after", SILENT.values(), ids=SILENT.keys())
def test_a_relayed_stream_that_falls_silent_ends_with_an_error_event(tmp_path: Path, after: Any) -> None:
    sent = OPENING + chat_event("Hel")

    async def run() -> None:
        async with (
            peers({CHAT: after(sent)}) as (slow,),
            router(tmp_path, [slow], **BOUNDS) as r,
        ):
            answer = await r.chat(stream=True)
            assert answer.status_code == 200
            *relayed, error, done = data_events(answer.text)
            assert relayed == data_events(sent.decode())  # what it sent, as it was sent
            assert openai_error(json.loads(error.removeprefix("data: ")))["code"] == "backend_timeout"
            assert done == "data: [DONE]"
            assert (await r.stats())["cut"] == 1
            assert r.backend(slow).epoch == 1

    asyncio.run(run())


def test_a_slow_but_steady_stream_is_never_cut(tmp_path: Path) -> None:
    events = [chat_event(str(i)) for i in range(5)]  # five gaps of 0.3 s: longer than the idle bound in all

    async def run() -> None:
        async with (
            peers({CHAT: streamed(*events, every_s=0.3)}) as (steady,),
            router(tmp_path, [steady], **BOUNDS) as r,
        ):
            answer = await r.chat(stream=True)
            assert answer.content == b"".join(events) + b"data: [DONE]\n\n"
            assert (await r.stats())["cut"] == 0

    asyncio.run(run())


def test_lines_tell_data_from_keep_alives_across_chunks_and_where_an_event_ends() -> None:
    lines = Lines()
    assert not lines.feed(b": keep-alive\n\n: ping")  # comments and blank lines are no data
    assert not lines.feed(b" again\ndat")  # a comment split across chunks; a field line begun, not ended
    assert lines.closing() == b"\n\n"  # mid-line: end the line and the event
    assert lines.feed(b'a: {"x": 1}\n')
    assert lines.closing() == b"\n"  # a field line ended, the event not yet dispatched
    assert not lines.feed(b"\n")
    assert lines.closing() == b""


# -- the Messages API: its events, and the router's own errors in Anthropic's shape ---------------------------
def test_a_messages_stream_opening_carries_no_output_and_anything_after_it_does() -> None:
    assert not carries_output(MESSAGES_OPENING)
    assert not carries_output(MESSAGES_OPENING + message_event("ping") + b": keep-alive\n\n")
    assert not carries_output(b"event:message_start\ndata:{}\n\n")  # no space after the colon, as SSE allows
    error = message_event("error", error={"type": "api_error", "message": "engine failed"})
    ends = (text_event("Hel"), message_event("content_block_stop", index=0), MESSAGES_ENDING, error)
    for event in ends:
        assert carries_output(MESSAGES_OPENING + event), event
    assert carries_output(b"event: something_new\ndata: {}\n\n")  # a name kvtier does not know: the answer
    assert not carries_output(OPENING) and carries_output(OPENING + chat_event("Hi"))  # chat as before


def test_a_messages_stream_is_held_to_its_first_output_then_passes_through_unchanged(tmp_path: Path) -> None:
    events = (MESSAGES_OPENING, message_event("ping"), text_event("Hel"), b": keep-alive\n\n", text_event("lo"))

    async def run() -> None:
        handler = streamed(*events, end=MESSAGES_ENDING)
        async with peers({MESSAGES: handler}) as (backend,), router(tmp_path, [backend]) as r:
            answer = await r.ask(MESSAGES, stream=True)
            assert answer.status_code == 200 and answer.headers["content-type"].startswith(SSE)
            assert answer.content == b"".join(events) + MESSAGES_ENDING

    asyncio.run(run())


def test_when_every_backend_answers_broken_on_messages_the_client_gets_a_502_in_anthropic_shape(
    tmp_path: Path,
) -> None:
    html = reply(200, b"<html>oops</html>", "text/html")

    async def run() -> None:
        async with (
            peers({MESSAGES: html}, {MESSAGES: ends_after(MESSAGES_OPENING)}) as both,
            router(tmp_path, both) as r,
        ):
            answer = await r.ask(MESSAGES)
            assert answer.status_code == 502 and anthropic_error(answer.json())["type"] == "api_error"
            assert (await r.stats())["broken"] == 2

    asyncio.run(run())


def test_when_every_backend_hangs_on_messages_the_client_gets_a_504_in_anthropic_shape(tmp_path: Path) -> None:
    async def run() -> None:
        async with (
            peers({MESSAGES: hang}, {MESSAGES: pinging(MESSAGES_OPENING)}) as both,
            router(tmp_path, both, **BOUNDS) as r,
        ):
            answer = await r.ask(MESSAGES, stream=True)
            assert answer.status_code == 504 and anthropic_error(answer.json())["type"] == "timeout_error"

    asyncio.run(run())


def test_with_no_backend_up_messages_get_a_503_in_anthropic_shape_and_chat_in_openai_shape(tmp_path: Path) -> None:
    async def run() -> None:
        sick = {"/health": reply(503, {"status": "starting"}), **good(MESSAGES)}  # down, and kept down by its checks
        async with peers(sick) as (backend,), router(tmp_path, [backend], up=False) as r:
            answer = await r.ask(MESSAGES)
            assert answer.status_code == 503 and anthropic_error(answer.json())["type"] == "overloaded_error"
            chat = await r.chat()
            assert chat.status_code == 503 and openai_error(chat.json())["code"] == "no_backend"

    asyncio.run(run())


def test_a_relayed_messages_stream_that_falls_silent_ends_with_an_anthropic_error_event(tmp_path: Path) -> None:
    sent = MESSAGES_OPENING + text_event("Hel")

    async def run() -> None:
        async with peers({MESSAGES: then_hang(sent)}) as (slow,), router(tmp_path, [slow], **BOUNDS) as r:
            answer = await r.ask(MESSAGES, stream=True)
            assert answer.status_code == 200 and answer.content.startswith(sent)
            name, data = answer.content[len(sent) :].decode().removesuffix("\n\n").split("\n")
            assert name == "event: error" and "[DONE]" not in answer.text  # an Anthropic stream has no [DONE]
            assert anthropic_error(json.loads(data.removeprefix("data: ")))["type"] == "timeout_error"
            assert (await r.stats())["cut"] == 1

    asyncio.run(run())
