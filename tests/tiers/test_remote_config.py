"""The remote tier's connection settings against real redis-servers: unix sockets, passwords, a hung server."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.bench.redis_server import RedisServer
from kvtier.config import RemoteConfig, load_config
from kvtier.keys import Secret
from kvtier.tiers.remote import RemoteTier
from tests.helpers import record, toy_layout
from tests.remote import remote_section
from tests.tiers.test_remote import key, open_tier, store

LAYOUT = toy_layout()


def test_urls_and_credentials_come_from_the_environment() -> None:
    env = {
        "KVTIER_REMOTE__URLS": "redis://10.0.0.1:7000, redis://10.0.0.2:7000",
        "KVTIER_REMOTE__CLUSTER": "true",
        "KVTIER_REMOTE__USERNAME": "kv",
        "KVTIER_REMOTE__PASSWORD": "not-in-the-file",
    }
    cfg = load_config(environ=env).remote
    assert cfg.urls == ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"] and cfg.cluster
    assert cfg.username == "kv" and cfg.password is not None
    assert cfg.password.get_secret_value() == "not-in-the-file" and "not-in-the-file" not in repr(cfg)


def test_a_unix_socket_url(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    with RedisServer.start("--unixsocket", str(sock), "--unixsocketperm", "700") as server:
        tier = open_tier(f"unix://{sock}")
        try:
            store(tier, 2)
            assert tier.probe([key(0), key(1)]) == [record(0), record(1)]
            assert list(tier.breakers()) == [str(sock)]
        finally:
            tier.close()
        assert server.port > 0


def test_a_password_is_used_and_a_wrong_one_is_a_counted_miss() -> None:
    with RedisServer.start("--requirepass", "s3cret-for-tests") as server:
        good = open_tier(server.url, password="s3cret-for-tests")
        bad = open_tier(server.url, password="wrong")
        try:
            store(good, 1)
            assert good.probe([key(0)]) == [record(0)]
            assert bad.probe([key(0)]) == [None]
            assert bad.snapshot().errors == 1
        finally:
            good.close()
            bad.close()


def test_a_hung_server_costs_one_bounded_timeout_then_the_breaker_skips_it(redis_server) -> None:
    cfg = RemoteConfig(**remote_section(redis_server.url, timeout_ms=50, breaker_failures=2, breaker_retry_s=600))
    tier = RemoteTier.open(cfg, LAYOUT, Secret(b"s" * 32), "toy-model")
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        for _ in range(4):
            assert tier.probe([key(0)]) == [None]
        snap = tier.snapshot()
        assert snap.timeouts == 1 and snap.errors == 1  # one bounded wait opens it at once ...
        assert snap.skipped == 3 and snap.breaker_opens == 1  # ... then no call at all
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        tier.close()


def test_a_cluster_over_unix_sockets_or_several_standalone_urls_are_config_errors() -> None:
    with pytest.raises(ValidationError, match="not unix"):
        RemoteConfig(cluster=True, urls=["unix:///run/redis.sock"])
    with pytest.raises(ValidationError, match="set remote cluster"):
        RemoteConfig(urls=["redis://a:6379", "redis://b:6379"])
