"""The router's surface as the official clients see it: every OpenAI route a backend serves is served, and
Anthropic's Messages API, its key going with the question and the router's own errors raised as its SDK raises them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import openai
import pytest

from tests.route.hostile import MESSAGES, message_answer, peers, reply, router

MODELS = {
    "object": "list",
    "data": [{"id": "toy", "object": "model", "created": 0, "owned_by": "kvtier", "context_length": 2048}],
}
KEY = "sk-test-0123456789"


def test_the_model_list_is_a_backends_and_the_callers_key_goes_with_the_question(tmp_path: Path) -> None:
    async def run() -> None:
        async with peers({"/v1/models": reply(200, MODELS)}) as (backend,), router(tmp_path, [backend]) as r:
            async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0) as client:
                page = await client.models.list()
            assert [m.id for m in page.data] == ["toy"]
            asked = await backend.next("/v1/models")
            assert asked.headers["authorization"] == f"Bearer {KEY}"  # its tenants decide, as without a router

    asyncio.run(run())


def test_the_model_list_comes_from_the_next_backend_when_one_answers_something_else(tmp_path: Path) -> None:
    html = reply(200, b"<html>It works!</html>", "text/html")

    async def run() -> None:
        async with (
            peers({"/v1/models": html}, {"/v1/models": reply(200, MODELS)}) as both,
            router(tmp_path, both) as r,
        ):
            async with openai.AsyncOpenAI(base_url=r.url + "/v1", api_key=KEY, max_retries=0) as client:
                page = await client.models.list()
            assert [m.id for m in page.data] == ["toy"]

    asyncio.run(run())


def test_a_message_is_a_backends_and_the_x_api_key_goes_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    only_x_api_key = {"x-api-key": KEY}  # this SDK sends api_key as a bearer token; the API's clients send this

    async def run() -> None:
        async with (
            peers({MESSAGES: reply(200, message_answer("Blue."))}) as (backend,),
            router(tmp_path, [backend]) as r,
        ):
            async with anthropic.AsyncAnthropic(
                base_url=r.url, api_key=None, default_headers=only_x_api_key, max_retries=0
            ) as client:
                message = await client.messages.create(
                    model="toy", max_tokens=8, messages=[{"role": "user", "content": "A colour?"}]
                )
            assert message.content[0].text == "Blue." and message.stop_reason == "end_turn"
            asked = await backend.next(MESSAGES)
            assert asked.headers["x-api-key"] == KEY and "authorization" not in asked.headers
            assert "anthropic-version" in asked.headers

    asyncio.run(run())


def test_the_routers_own_error_on_messages_is_raised_by_the_anthropic_client(tmp_path: Path) -> None:
    html = reply(200, b"<html>It works!</html>", "text/html")

    async def run() -> None:
        async with peers({MESSAGES: html}) as both, router(tmp_path, both) as r:
            async with anthropic.AsyncAnthropic(base_url=r.url, api_key=KEY, max_retries=0) as client:
                with pytest.raises(anthropic.InternalServerError) as raised:
                    await client.messages.create(model="toy", max_tokens=8, messages=[{"role": "user", "content": "?"}])
            assert raised.value.status_code == 502
            body = raised.value.body
            assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "api_error"

    asyncio.run(run())
