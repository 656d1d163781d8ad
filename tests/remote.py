"""Real redis-server fixtures for the remote tier's tests (no fake Redis): import the ones a module uses.

One standalone server per test session (each test gets it emptied), and a
three-master cluster per module that asks for it. Both listen on free
loopback ports in temporary directories and are stopped by PID.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from kvtier.bench.redis_server import RedisCluster, RedisServer


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    with RedisServer.start() as server:
        yield server


@pytest.fixture
def redis_server(redis_session: RedisServer) -> Iterator[RedisServer]:
    """The session's server, running (a test may have killed it) and empty."""
    if redis_session.proc is None or redis_session.proc.poll() is not None:
        redis_session.restart()
    client = redis.Redis(port=redis_session.port)
    client.flushall()
    client.close()
    yield redis_session


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisCluster]:
    with RedisCluster.start() as cluster:
        yield cluster


def remote_section(url: str | list[str], **over: object) -> dict[str, object]:
    """A ``remote:`` config section for tests: enabled, short timeouts, a breaker that retries after 1 s."""
    urls = [url] if isinstance(url, str) else url
    return {"enabled": True, "urls": urls, "timeout_ms": 500, "breaker_retry_s": 1.0, **over}
