"""Two ``kvtier serve`` instances on one node-local cache service: a session's turn 2 on the second instance
hits the blocks its turn 1 stored through the first, with the same greedy output as no cache at all."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from kvtier.engine.runtime import LoadedModel
from tests.helpers import shared_full_blocks
from tests.server.live import ROOT, SIZES, LiveServer, Reference, running

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@contextmanager
def cache_service(tmp: Path, sock: Path | None = None) -> Iterator[tuple[Path, subprocess.Popen[str]]]:
    """``kvtier cache serve`` in a subprocess (tiers under ``tmp``); yields its socket and process once it listens."""
    sock = sock or tmp / "cache.sock"
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "service.yaml"
    # its own slab directory: a service killed by a test leaves its slab behind, which the next one would reclaim
    tree = {"data_dir": str(tmp / "service-data"), "service": {"slab_dir": str(tmp)}, **SIZES}
    config.write_text(yaml.safe_dump(tree))
    log = tmp / "service.log"
    with log.open("w") as errors:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "cache", "serve", "--config", str(config), "--socket", str(sock)],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            cwd=ROOT,
        )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # printed once the socket listens (or nothing: it exited)
        assert line.startswith("kvtier cache service: unix://"), line + log.read_text()
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

            service.kill()  # the service goes away mid-session: the instances answer on, from their own pools
            assert service.wait(timeout=60) == -signal.SIGKILL
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


def test_servers_use_a_restarted_service_and_one_started_before_it_connects_when_it_appears(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    """kill -9 the service under two servers, start a third while it is down, then start a new service:
    all three use it from then on, without a restart, and the greedy text never changes."""
    reference = Reference(loaded_model, tmp_path)
    sock = tmp_path / "cache.sock"
    shared = {"cache": {"service": f"unix://{sock}", "service_retry_s": 0.5}}
    question = [{"role": "user", "content": "Name the planets of the solar system, in order from the sun. " * 6}]
    with running(tmp_path / "a", shared) as a, running(tmp_path / "b", shared) as b:
        with cache_service(tmp_path / "first", sock) as (_, first):
            a.client().chat.completions.create(model=MODEL, messages=question, max_tokens=4, temperature=0)
            first.kill()
            assert first.wait(timeout=60) == -signal.SIGKILL
        with running(tmp_path / "c", shared) as c:  # starts with nothing listening: serves by recomputing
            fresh = [{"role": "user", "content": "Which of the planets are gas giants, and why? " * 6}]
            ids, ref = reference.chat(fresh, 8)
            with cache_service(tmp_path / "second", sock):
                wait_connected(c)
                answers = []
                for server in (a, b, c):
                    out = server.client().chat.completions.create(
                        model=MODEL, messages=fresh, max_tokens=8, temperature=0
                    )
                    answers.append((out.choices[0].message.content, out.usage.prompt_tokens_details.cached_tokens))
                    wait_stored(server, len(ids) // 16)  # stores finish behind the answer
                full = (len(ids) - 1) // 16 * 16
                assert [text for text, _ in answers] == [ref.text] * 3
                # a computed it (all but the chat template's opening, held in its own pool) and stored all of it
                # there, the opening too (kept under the old service); b and c, which never saw it, hit all of it
                assert answers[0][1] < full and answers[1][1] == answers[2][1] == full
                assert b.stats()["tiers"]["host"]["blocks"] == len(ids) // 16  # the new service's own figure
        said = c.log.read_text()
        assert said.count("until it answers") == 1 and said.count("answers again") == 1, said


def wait_connected(server: LiveServer, timeout_s: float = 120) -> None:
    """Until the server's /stats says its cache service answered (it asks when due, every service_retry_s)."""
    deadline = time.monotonic() + timeout_s
    while not server.stats()["service"]["connected"]:
        assert time.monotonic() < deadline, server.log.read_text()


def wait_stored(server: LiveServer, blocks: int, timeout_s: float = 120) -> None:
    """Until the cache service holds ``blocks`` blocks, as the server's /stats reports its figures."""
    deadline = time.monotonic() + timeout_s
    while server.stats()["tiers"]["host"]["blocks"] < blocks:
        assert time.monotonic() < deadline, server.log.read_text()
