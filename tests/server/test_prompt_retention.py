"""Promises through a real ``kvtier serve``: OpenAI's ``prompt_cache_retention`` and the Messages API's marks.

Write-back, and a host tier far larger than these prompts: no block reaches
disk unless a promise writes it through. So clearing host memory
(``/admin/clear``) and looking the prompt up (``/lookup``) shows what a
promise put on disk. Stores land after the response, on the engine's
worker: the checks wait for them with a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import anthropic
import openai
import pytest

from tests.server.live import BLOCK_BYTES, B, LiveServer, running

KEY = "sk-alpha-0123456789abcdef"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
DISK_QUOTA = 64 * 1024**2  # half the test disk tier (tests/server/live.py SIZES): the default
T = TypeVar("T")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    sections = {"cache": {"write_mode": "write_back"}}
    with running(tmp_path_factory.mktemp("retention"), sections, api_keys={KEY: "alpha"}) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return server.client(api_key=KEY)


def below_host(server: LiveServer, body: dict[str, Any]) -> dict[str, Any]:
    """Where ``body``'s prompt is once host memory is cleared: what only disk holds of it."""
    server.admin_post("/admin/clear", {"tier": "host"}).raise_for_status()
    found = server.admin_post("/lookup", {**body, "tenant": "alpha"})
    found.raise_for_status()
    return found.json()


def stored(server: LiveServer, body: dict[str, Any]) -> int:
    """The prompt's full blocks, cached once the run's stores landed (``/admin/settle`` waits for them)."""
    server.admin_post("/admin/settle").raise_for_status()
    found = server.admin_post("/lookup", {**body, "tenant": "alpha"}).json()
    assert found["cached_tokens"] == found["prompt_tokens"] // B * B > 0
    return found["cached_tokens"] // B


def test_a_24h_prompt_is_written_to_disk_and_pinned_there(server: LiveServer, client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You answer for the lighthouse keepers' guild, tersely. " * 8},
        {"role": "user", "content": "Which lamp burns longest?"},
    ]
    done = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, prompt_cache_retention="24h"
    )
    assert done.usage.prompt_tokens_details.cached_tokens == 0  # usage as ever: nothing was cached yet
    body = {"messages": messages}
    blocks = stored(server, body)
    assert blocks == done.usage.prompt_tokens // B
    assert below_host(server, body)["tiers"] == {
        "disk": blocks * B
    }  # written through, though write-back would have waited
    stats = server.stats()
    assert stats["retained"]["alpha"] == {
        "disk": {"blocks": blocks, "bytes": blocks * BLOCK_BYTES, "prefixes": 1, "quota_bytes": DISK_QUOTA}
    }
    assert stats["ttl_pinned_blocks"] == blocks


def test_in_memory_promises_nothing(server: LiveServer, client: openai.OpenAI) -> None:
    """The completions route takes the field too (the SDK sends it as an extra field there)."""
    prompt = "The harbour master's ledger lists every ship that came in at dusk. " * 6
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_cache_retention": "in_memory"}
    )
    before = server.stats()
    stored(server, {"prompt": prompt})
    assert below_host(server, {"prompt": prompt})["cached_tokens"] == 0  # host alone held it
    assert server.stats()["retained"] == before["retained"] and done.usage.prompt_tokens > B


def test_a_bad_retention_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"prompt_cache_retention": "7d"})


def test_a_cache_control_mark_is_written_through_to_disk(server: LiveServer) -> None:
    """The Messages API's marks keep their prefix in host memory and, as promises, on disk too."""
    before = server.stats()["tiers"]["disk"]["blocks"]
    system = [
        {"type": "text", "text": "Guild rules, to be kept for the hour. " * 12, "cache_control": {"type": "ephemeral"}}
    ]
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    answer = claude.messages.create(
        model=MODEL, max_tokens=2, system=system, messages=[{"role": "user", "content": "Go."}],
        extra_body={"temperature": 0},
    )  # fmt: skip
    marked = answer.usage.cache_creation_input_tokens // B
    assert marked > 0
    server.admin_post("/admin/settle").raise_for_status()
    assert (
        server.stats()["tiers"]["disk"]["blocks"] == before + marked
    )  # the marked blocks, and no other: write-back wrote nothing else
    assert server.stats()["retained"]["alpha"]["host"]["blocks"] == marked
