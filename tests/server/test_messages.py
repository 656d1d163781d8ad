"""A real ``kvtier serve`` through the official ``anthropic`` client: the Messages API, its cache marks and usage.

Greedy answers are compared with the in-process engine running without any
cache, on the prompt the chat template renders for the same conversation;
usage is checked to the token: the three input counts sum to the prompt,
what a repeated prefix reads from the cache is its whole blocks, and what a
``cache_control`` mark keeps is whole blocks up to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
import requests

from kvtier.engine.runtime import LoadedModel
from tests.server.live import BLOCK_BYTES, B, LiveServer, Reference, running

KEY, OTHER = "sk-alpha-0123456789abcdef", "sk-beta-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
MAX = 8
# Small tiers, so that ten times the host tier also overflows the engine's pool and the disk tier: a flood
# evicts everything a mark does not keep (the pool's resident blocks included).
SMALL = {
    "engine": {"pool_bytes": 100 * BLOCK_BYTES, "dtype": "float32"},
    "host": {"capacity_bytes": "16MiB"},
    "disk": {"capacity_bytes": "24MiB"},
}
SYSTEM = "You are a terse assistant. " * 12  # a few blocks of system prompt, marked for caching


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running(tmp_path_factory.mktemp("messages"), SMALL, api_keys={KEY: "alpha", OTHER: "beta"}) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(loaded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(loaded_model, tmp_path_factory.mktemp("reference"))


GREEDY = {"temperature": 0}  # the API's default is 1, and the SDK no longer names it: sent as an extra field


def ask(client: anthropic.Anthropic, messages: list[dict[str, Any]], **kw: Any) -> anthropic.types.Message:
    return client.messages.create(model=kw.pop("model", MODEL), max_tokens=MAX, messages=messages,
                                  extra_body=GREEDY, **kw)  # fmt: skip


def total(usage: anthropic.types.Usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def test_a_message_equals_the_uncached_engine_plain_and_streamed(
    client: anthropic.Anthropic, reference: Reference
) -> None:
    convo = [{"role": "user", "content": "Name a colour."}]
    ids, ref = reference.chat(convo, MAX)
    done = ask(client, convo)
    assert (done.type, done.role, done.model) == ("message", "assistant", MODEL)
    assert [b.type for b in done.content] == ["text"] and done.content[0].text == ref.text
    assert done.stop_reason == ("max_tokens" if ref.finish_reason.value == "length" else "end_turn")
    assert total(done.usage) == len(ids) and done.usage.output_tokens == len(ref.token_ids)

    with client.messages.stream(model=MODEL, max_tokens=MAX, messages=convo, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    opening = events[0].message.usage  # type: ignore[union-attr]
    split = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    assert [getattr(opening, k) for k in split] == [getattr(final.usage, k) for k in split]  # exact from the start
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds)
    assert final.content[0].text == ref.text and final.stop_reason == done.stop_reason
    assert total(final.usage) == len(ids) and final.usage.output_tokens == len(ref.token_ids)
    assert final.usage.cache_read_input_tokens == (len(ids) - 1) // B * B  # the same prompt again: its whole blocks


def test_a_marked_system_prompt_is_created_once_then_read(client: anthropic.Anthropic, reference: Reference) -> None:
    """The first request computes and keeps the marked prefix; the next, with another question, reads it."""
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    first = ask(client, [{"role": "user", "content": "What is 2 + 2?"}], system=system)
    second = ask(client, [{"role": "user", "content": "What is 3 + 3?"}], system=system)
    ids, ref = reference.chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 + 3?"}], MAX
    )
    assert second.content[0].text == ref.text and total(second.usage) == len(ids)
    created = first.usage.cache_creation_input_tokens
    assert created is not None and created > 0 and created % B == 0
    assert first.usage.cache_creation is not None and first.usage.cache_creation.ephemeral_1h_input_tokens == created
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= created  # the system prompt's blocks, and no more to create
    assert second.usage.cache_creation_input_tokens == 0


def test_tools_tool_use_and_results_render_into_the_prompt(client: anthropic.Anthropic) -> None:
    tools = [{"name": "read_file", "description": "Read a file.", "input_schema": {"type": "object"}}]
    convo = [
        {"role": "user", "content": "Open README.md"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {"p": "R"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "# kvtier"}]},
    ]
    done = ask(client, convo, tools=tools, stop_sequences=["\n"])
    bare = ask(client, [{"role": "user", "content": "Open README.md"}])
    assert total(done.usage) > total(bare.usage) + 20  # the tools and both blocks are in the prompt
    assert done.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    if done.stop_reason == "stop_sequence":
        assert done.stop_sequence == "\n" and "\n" not in done.content[0].text


def test_errors_come_in_the_messages_shape(client: anthropic.Anthropic, server: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError, match="image"):
        ask(client, [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}])
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        ask(client, [{"role": "user", "content": "hi"}], model="another-model")
    marked = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError, match="at most 4"):
        ask(client, [{"role": "user", "content": [marked] * 5}])
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        ask(wrong, [{"role": "user", "content": "hi"}])
    reply = requests.post(server.url + "/v1/messages", json={"messages": []}, headers={"x-api-key": KEY}, timeout=60)
    assert reply.status_code == 400 and reply.json()["type"] == "error"
    assert reply.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in reply.json()["error"]["message"]


def test_a_tenant_reads_only_its_own_marked_prefix(client: anthropic.Anthropic, server: LiveServer) -> None:
    system = [{"type": "text", "text": "Tenant alpha's instructions. " * 10, "cache_control": {"type": "ephemeral"}}]
    ask(client, [{"role": "user", "content": "One."}], system=system)
    beta = anthropic.Anthropic(base_url=server.url, api_key=OTHER, max_retries=0, timeout=120)
    other = ask(beta, [{"role": "user", "content": "One."}], system=system)
    assert other.usage.cache_read_input_tokens == 0  # the same text under another key: another namespace


def test_the_requests_own_mark_keeps_the_whole_prompt_for_the_next_turn(client: anthropic.Anthropic) -> None:
    """Top-level ``cache_control``: the last block is marked, so the whole prompt's blocks are created, then read."""
    convo = [{"role": "user", "content": "Describe a lighthouse in one line. " * 6}]
    first = ask(client, convo, cache_control={"type": "ephemeral"})
    assert first.usage.cache_creation_input_tokens == total(first.usage) // B * B - first.usage.cache_read_input_tokens
    assert first.usage.cache_creation.ephemeral_5m_input_tokens == first.usage.cache_creation_input_tokens
    again = ask(client, [*convo, {"role": "assistant", "content": first.content[0].text},
                         {"role": "user", "content": "Shorter."}], cache_control={"type": "ephemeral"})  # fmt: skip
    assert again.usage.cache_read_input_tokens >= total(first.usage) // B * B - B  # the first turn's blocks


def test_a_marked_prefix_outlives_another_tenants_flood(client: anthropic.Anthropic, server: LiveServer) -> None:
    """Tenant alpha marks its system prompt; tenant beta then sends ten times the host tier in new prompts.

    Alpha's next turn still reads the whole marked prefix from the cache, while beta's own first prompt,
    unmarked, was flooded out (the pool and the disk tier overflow too), and /stats shows what alpha keeps
    (its quota: half the host tier).
    """
    system = [{"type": "text", "text": "Alpha's long standing orders. " * 30, "cache_control": {"type": "ephemeral"}}]
    first = ask(client, [{"role": "user", "content": "Begin."}], system=system)
    marked = first.usage.cache_creation_input_tokens + first.usage.cache_read_input_tokens
    assert marked >= 8 * B
    host_blocks = server.stats()["tiers"]["host"]["capacity_blocks"]
    openai_beta = server.client(api_key=OTHER)
    words = ["river", "stone", "lamp", "cedar", "orbit", "violet", "harbor", "quartz", "meadow", "signal", "ember"]
    flood = [" ".join(f"{words[(i + j) % len(words)]}{i}" for j in range(300)) for i in range(10 * host_blocks // 30)]
    sent = 0
    for text in flood:
        done = openai_beta.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0)
        sent += done.usage.prompt_tokens
    assert sent >= 10 * host_blocks * B
    again = ask(client, [{"role": "user", "content": "Continue."}], system=system)
    assert again.usage.cache_read_input_tokens >= marked
    replay = openai_beta.completions.create(model=MODEL, prompt=flood[0], max_tokens=1, temperature=0)
    assert replay.usage.prompt_tokens_details.cached_tokens < 4 * B  # unmarked: gone
    kept = server.stats()["retained"]["alpha"]["host"]
    assert kept["blocks"] >= marked // B and kept["quota_bytes"] == 8 * 1024**2
