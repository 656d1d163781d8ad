"""Two ``kvtier serve`` instances (two nodes: separate data dirs, one secret file) sharing one real redis-server.

Turn 2 of a session on the second instance hits, from Redis, what turn 1
stored through the first, with the same greedy output as no cache at all.
Then Redis is killed mid-session: both instances answer on (same outputs),
their breakers open; Redis comes back and the breakers close.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.engine.runtime import LoadedModel
from tests.helpers import shared_full_blocks
from tests.remote import remote_section
from tests.server.live import LiveServer, Reference, metric_values, running

MODEL = "SmolLM2-135M-Instruct.Q4_1"
TRIES = 300  # bounded waits on the instances' own counters (each try is one /stats request)


def ask(server: LiveServer, messages: list[dict[str, str]]) -> Any:
    return server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)


def wait_for(server: LiveServer, done: Any) -> dict[str, Any]:
    """Poll /stats until ``done(stats)``: writes go out behind the request, so the test waits on their counters."""
    for _ in range(TRIES):
        stats = server.stats()
        if done(stats):
            return stats
    raise AssertionError(f"never reached: {server.stats()}")


def test_two_instances_share_blocks_through_redis_and_survive_it(
    loaded_model: LoadedModel, tmp_path: Path, redis_server
) -> None:
    reference = Reference(loaded_model, tmp_path)
    remote = remote_section(redis_server.url, breaker_failures=1, breaker_retry_s=1.0)
    shared = {"cache": {"secret_file": str(tmp_path / "deployment.secret")}, "remote": remote}
    messages = [
        {"role": "system", "content": "You are a terse assistant. Answer in one short sentence. " * 4},
        {"role": "user", "content": "List three prime numbers."},
    ]
    with running(tmp_path / "a", shared) as a, running(tmp_path / "b", shared) as b:
        first = ask(a, messages)
        ids1, ref1 = reference.chat(messages, 8)
        assert first.choices[0].message.content == ref1.text
        stored = (len(ids1) + len(ref1.token_ids) - 1) // 16
        wait_for(a, lambda s: s["remote"]["writes"] >= stored and s["remote"]["write_queue"] == 0)

        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Now add them up."},
        ]
        ids2, ref2 = reference.chat(messages, 8)
        shared_tokens = shared_full_blocks(ids2, [ids1 + ref1.token_ids[:-1]])
        looked = b.admin_post("/lookup", {"messages": messages}).json()  # before b serves it: all from Redis
        assert (looked["cached_tokens"], looked["tiers"]) == (shared_tokens, {"remote": shared_tokens})
        second = ask(b, messages)
        assert second.choices[0].message.content == ref2.text  # identical to no cache at all
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached == shared_tokens > 0
        stats = b.stats()
        assert stats["tiers"]["remote"]["hit_tokens"] == cached  # every cached token came from Redis
        assert stats["tiers"]["remote"]["bytes_read"] == cached // 16 * 46080 * 16
        assert stats["remote"]["rejected"]["bad_mac"] == 0

        redis_server.kill()  # mid-session: both instances answer on, from their own tiers
        messages += [
            {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": "Is the sum prime?"},
        ]
        _, ref3 = reference.chat(messages, 8)
        for server in (a, b):
            assert ask(server, messages).choices[0].message.content == ref3.text
        for server in (a, b):
            stats = wait_for(server, lambda s: s["remote"]["breaker_opens"] >= 1)
            assert list(stats["remote"]["breakers"].values()) == ["open"]
            metrics = metric_values(server.read("/metrics").text)
            node = f"127.0.0.1:{redis_server.port}"
            assert metrics[("kvtier_remote_breaker_open", (("node", node),))] == 1.0

        redis_server.restart()  # back: the next trial call (at most breaker_retry_s later) closes the breaker
        for i in range(TRIES):  # new blocks after the locally cached system prompt: each lookup asks Redis
            ask(b, [messages[0], {"role": "user", "content": f"Count from {i} to {i + 3}."}])
            if list(b.stats()["remote"]["breakers"].values()) == ["closed"]:
                break
        assert list(b.stats()["remote"]["breakers"].values()) == ["closed"]
