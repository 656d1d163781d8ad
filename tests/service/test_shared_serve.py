"""Two ``kvtier serve`` instances on one node-local cache service: a session's turn 2 on the second instance
hits the blocks its turn 1 stored through the first, with the same greedy output as no cache at all."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from kvtier.engine.runtime import LoadedModel
from tests.helpers import shared_full_blocks
from tests.server.live import ROOT, SIZES, Reference, running

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@contextmanager
def cache_service(tmp: Path) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """``kvtier cache serve`` in a subprocess; yields its socket (and process) once it says it is listening."""
    sock = tmp / "cache.sock"
    config = tmp / "service.yaml"
    config.write_text(yaml.safe_dump({"data_dir": str(tmp / "service-data"), **SIZES}))
    process = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "cache", "serve", "--config", str(config), "--socket", str(sock)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once the socket listens
        assert line.startswith("kvtier cache service: unix://"), line + process.stdout.read()
        yield sock, process
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_turn_two_on_another_instance_hits_what_turn_one_stored(loaded_model: LoadedModel, tmp_path: Path) -> None:
    reference = Reference(loaded_model, tmp_path)
    messages = [
        {"role": "system", "content": "You are a terse assistant. Answer in one short sentence. " * 4},
        {"role": "user", "content": "List three prime numbers."},
    ]
    with cache_service(tmp_path) as (sock, service):
        shared = {"cache": {"service": f"unix://{sock}"}}
        with running(tmp_path / "a", shared) as a, running(tmp_path / "b", shared) as b:
            first = a.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
            ids1, ref1 = reference.chat(messages, 12)
            assert first.choices[0].message.content == ref1.text
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now add them up."},
            ]
            second = b.client().chat.completions.create(
                model=MODEL, messages=messages, max_tokens=12, temperature=0, user="agent-1"
            )
            ids2, ref2 = reference.chat(messages, 12)
            assert second.choices[0].message.content == ref2.text  # identical to no cache at all
            cached = second.usage.prompt_tokens_details.cached_tokens
            assert cached == shared_full_blocks(ids2, [ids1 + ref1.token_ids[:-1]]) > 0
            stats = b.stats()
            assert stats["tiers"]["host"]["hit_tokens"] >= cached  # the service's own tier counted the hit
            assert stats["tiers"]["host"]["blocks"] > 0
            prefetch = stats["engine"]["prefetch"]  # fetched on arrival, off the engine thread, then taken
            assert prefetch["started"] == 1 and prefetch["blocks_used"] * 16 == cached

            # The session's tiers are the service's: prefetch and explain are answered there, not 404.
            done = b.post("/v1/sessions/agent-1/prefetch")
            assert done.status_code == 200, done.text
            assert done.json()["host_tokens"] == len(ids2) // 16 * 16 and done.json()["promoted_tokens"] == {}
            changed = [{**messages[0], "content": "You are a verbose assistant. " + messages[0]["content"]}]
            why = b.post(
                "/v1/cache/explain", json={"messages": changed + messages[1:]}, headers={"X-Session-ID": "agent-1"}
            )
            assert why.status_code == 200, why.text
            assert why.json()["reason"] == "session_diverged" and why.json()["divergence"]["position"] < 16
            same = b.post("/v1/cache/explain", json={"messages": messages}).json()
            assert same["cached_tokens"] == len(ids2) // 16 * 16 and same["tiers"] == {"host": same["cached_tokens"]}

            service.terminate()  # the service goes away mid-session: the instances answer on, from their own pools
            assert service.wait(timeout=60) == 0
            messages += [
                {"role": "assistant", "content": second.choices[0].message.content},
                {"role": "user", "content": "Is the sum prime?"},
            ]
            for server in (a, b):
                third = server.client().chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=12, temperature=0
                )
                assert third.choices[0].message.content == reference.chat(messages, 12)[1].text
            assert b.stats()["tiers"]["host"]["blocks"] > 0  # the last figures the service gave
