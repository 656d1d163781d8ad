"""The router's OpenAI surface, as the OpenAI client sees it: every OpenAI route a backend serves is served."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai

from tests.route.hostile import peers, reply, router

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
