"""``kvtier serve``'s cache on the node's service (:class:`ServiceCache`) when that service is not there yet,
is killed, or restarts: misses meanwhile, never an error, and the new service is used from the next call on.

The services are real processes on a real socket, killed with SIGKILL as an
operator's mistake or the OOM killer would; each run keeps its tiers in a
directory of its own, so a restarted service starts empty, as the one in the
report did.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.service.cache import ServiceCache
from tests.helpers import BLOCK, make_config, payload, prompt, toy_layout

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "toy-model"

SERVICE = """
import sys
from pathlib import Path
from kvtier.service import CacheService
from tests.helpers import make_config, toy_layout
run, sock = Path(sys.argv[1]), Path(sys.argv[2])
cfg = make_config(run, host={"capacity_bytes": 16 * 4096}, disk={"capacity_bytes": 32 * 4096})
svc = CacheService(cfg, toy_layout(), model_fingerprint="toy-model", socket_path=sock, slab_dir=run)
print("listening", flush=True)
svc.serve_forever()
"""


@contextmanager
def service(run: Path, sock: Path) -> Iterator[subprocess.Popen[str]]:
    """A cache service process on ``sock``, its tiers under ``run``; yielded once it listens, killed at the end."""
    run.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE, str(run), str(sock)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=60)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def open_cache(tmp: Path, sock: Path, clock: Clock) -> ServiceCache:
    cfg = make_config(tmp / "engine", cache={"service": f"unix://{sock}", "service_retry_s": 5.0})
    return ServiceCache(sock, cfg, toy_layout(), model_fingerprint=FINGERPRINT, clock=clock)


def store_and_look(cache: ServiceCache, seed: int) -> tuple[int, int]:
    """(blocks newly stored, blocks a lookup then finds) for a 4-block prompt."""
    keyed = cache.keyed(prompt(4 * BLOCK + 1, seed=seed))
    stored = cache.store(keyed, [payload(toy_layout(), seed * 10 + i) for i in range(4)])
    found = cache.lookup(keyed)
    assert found.keys == tuple(keyed.keys)  # the request's keys, as an embedded cache's lookup carries them
    return stored, found.cached_blocks


def test_a_service_killed_and_restarted_is_used_from_the_first_call_after(tmp_path: Path) -> None:
    sock, clock = tmp_path / "cache.sock", Clock()
    with service(tmp_path / "one", sock) as first:
        cache = open_cache(tmp_path, sock, clock)
        assert store_and_look(cache, seed=1) == (4, 4)
        kill(first)
        assert cache.lookup(cache.keyed(prompt(4 * BLOCK + 1, seed=1))).cached_blocks == 0  # a miss, no error
        assert cache.store(cache.keyed(prompt(4 * BLOCK + 1, seed=2)), [payload(toy_layout(), 0)] * 4) == 0
        assert cache.stats().service.connected is False
    with service(tmp_path / "two", sock):
        clock.now += 5.0  # the next try is due
        assert cache.lookup(cache.keyed(prompt(4 * BLOCK + 1, seed=1))).cached_blocks == 0  # the new one is empty
        assert store_and_look(cache, seed=3) == (4, 4)  # and used
        stats = cache.stats()
        assert stats.service.connected is True and stats.tiers["host"].blocks == 4
        assert stats.service.failures >= 1 and stats.service.connects == 2
        cache.close()


def test_a_service_restarted_between_two_calls_is_found_without_waiting(tmp_path: Path) -> None:
    sock, clock = tmp_path / "cache.sock", Clock()
    with service(tmp_path / "one", sock) as first:
        cache = open_cache(tmp_path, sock, clock)
        assert store_and_look(cache, seed=1) == (4, 4)
        kill(first)
    with service(tmp_path / "two", sock):  # back before the engine's next call: its clock never moved
        assert store_and_look(cache, seed=4) == (4, 4)
        assert cache.link.connects == 2
        cache.close()


def test_an_engine_started_before_its_service_serves_misses_then_connects_saying_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sock, clock = tmp_path / "cache.sock", Clock()
    with caplog.at_level(logging.WARNING, logger="kvtier.service.link"):
        cache = open_cache(tmp_path, sock, clock)  # nothing listens yet: no exception
        for step in range(3):
            assert store_and_look(cache, seed=5) == (0, 0)
            clock.now += 5.0 * step
        with service(tmp_path / "one", sock):
            clock.now += 5.0
            assert store_and_look(cache, seed=5) == (4, 4)
            cache.close()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "until it answers" in m]) == 1, said
    assert len([m for m in said if "answers again" in m]) == 1, said
