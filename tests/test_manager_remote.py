"""Two cache managers (two nodes: separate data dirs, one shared secret file) sharing one real redis-server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import redis
import torch

from kvtier.config import RemoteWriteOn
from kvtier.index import MissReason
from kvtier.manager import CacheManager
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, as_bytes, make_config, payload, prompt, toy_layout
from tests.remote import remote_section

H, D, R = TierKind.HOST, TierKind.DISK, TierKind.REMOTE


def node(
    tmp: Path, name: str, url: str | list[str], host_blocks: int = 16, disk: bool = False, **remote
) -> CacheManager:
    """A node of one deployment: its own data dir, the deployment's secret file, the shared Redis."""
    cfg = make_config(
        tmp / name,
        host={"capacity_bytes": host_blocks * 4096},
        disk={"enabled": disk, "capacity_bytes": 16 * 4096},
        cache={"secret_file": str(tmp / "deployment.secret")},
        remote=remote_section(url, **remote),
    )
    return CacheManager(cfg, toy_layout(), model_fingerprint="toy-model")


def kv(n: int, seed: int) -> list[torch.Tensor]:
    return [payload(toy_layout(), seed * 1000 + i) for i in range(n)]


def load(m: CacheManager, tokens: np.ndarray, namespace: str | None = None) -> list[torch.Tensor]:
    with m.load(m.lookup(m.keyed(tokens, namespace))) as handle:
        return [b.clone() for b in handle.blocks]


def test_a_second_node_hits_what_the_first_stored(tmp_path: Path, redis_server) -> None:
    tokens, blocks = prompt(6 * BLOCK + 1), kv(6, seed=1)
    with node(tmp_path, "a", redis_server.url) as a, node(tmp_path, "b", redis_server.url) as b:
        assert a.store(a.keyed(tokens), blocks) == 6
        assert a.remote is not None and a.remote.flush()
        result = b.lookup(b.keyed(tokens))
        assert (result.cached_blocks, result.tiers, result.miss_reason) == (6, (R,) * 6, MissReason.NONE)
        got = load(b, tokens)
        assert all(torch.equal(g, as_bytes(w)) for g, w in zip(got, blocks, strict=True))
        assert b.lookup(b.keyed(tokens)).tiers == (H,) * 6  # promoted into b's host memory
        stats = b.stats().tiers["remote"]
        assert stats.hit_tokens == 6 * BLOCK and stats.bytes_read == 6 * toy_layout().block_bytes
        assert b.stats().break_even["tiers"]["remote"]["samples"] == 1  # the fetch refitted its cost
        assert "remote" not in a.stats().break_even["tiers"]  # a never fetched from it: no figures to show


def test_the_admin_probe_names_the_remote_tier_and_counts_nothing(tmp_path: Path, redis_server) -> None:
    """What /lookup answers: host blocks, then the blocks only Redis holds, with no hit or miss counted."""
    tokens, blocks = prompt(6 * BLOCK + 1), kv(6, seed=1)
    with node(tmp_path, "a", redis_server.url) as a, node(tmp_path, "b", redis_server.url) as b:
        assert a.store(a.keyed(tokens), blocks) == 6
        assert a.remote is not None and a.remote.flush()
        assert b.store(b.keyed(tokens[: 2 * BLOCK]), blocks[:2]) == 2  # b holds the first two blocks itself
        before = b.stats()
        probe = b.probe(b.keyed(tokens))
        assert (probe.tiers, probe.miss_reason) == ((H, H, R, R, R, R), MissReason.NONE)
        assert probe.tokens_by_tier() == {H: 2 * BLOCK, R: 4 * BLOCK}
        after = b.stats()
        for tier in ("host", "remote"):
            assert after.tiers[tier].hit_tokens == before.tiers[tier].hit_tokens
            assert after.tiers[tier].miss_tokens == before.tiers[tier].miss_tokens
        assert b.probe(b.keyed(prompt(6 * BLOCK + 1, seed=9))).tiers == ()  # a prompt nobody stored


def test_named_blocks_one_node_stored_are_found_and_loaded_by_another(tmp_path: Path, redis_server) -> None:
    """The llama.cpp connector's named chunks go through Redis too: b finds and loads a's, confirmed, bytes exact."""
    names = [f"state/{i}".encode() for i in range(3)]
    data = kv(3, seed=7)

    def fill(i: int, out: torch.Tensor) -> None:
        out.copy_(as_bytes(data[i]))

    with node(tmp_path, "a", redis_server.url) as a, node(tmp_path, "b", redis_server.url) as b:
        assert a.named_store_from(names, fill, "ns") == 3
        assert a.remote is not None and a.remote.flush()
        assert b.named_exists([*names, b"state/absent"], "ns") == [True, True, True, False]
        assert b.named_exists(names, "another-ns") == [False] * 3  # the namespace is in the key
        with b.named_load([*names, b"state/absent"], "ns") as handle:
            assert handle.served_from == [R] * 3
            assert all(torch.equal(g, as_bytes(w)) for g, w in zip(handle.blocks, data, strict=True))
        with b.named_load(names, "ns") as handle:
            assert handle.served_from == [H] * 3  # promoted into b's host memory on the way
        assert b.stats().tiers["remote"].bytes_read == 3 * toy_layout().block_bytes


def test_namespaces_never_hit_each_other(tmp_path: Path, redis_server) -> None:
    tokens = prompt(4 * BLOCK + 1)
    with node(tmp_path, "a", redis_server.url) as a, node(tmp_path, "b", redis_server.url) as b:
        a.store(a.keyed(tokens, "tenant-a"), kv(4, seed=2))
        assert a.remote is not None and a.remote.flush()
        assert b.lookup(b.keyed(tokens, "tenant-b")).cached_blocks == 0
        assert load(b, tokens, "tenant-b") == []
        assert b.lookup(b.keyed(tokens, "tenant-a")).cached_blocks == 4
        assert b.stats().tiers["remote"].hit_tokens == 0  # the lookups above loaded nothing


def test_another_deployment_secret_is_a_counted_miss(tmp_path: Path, redis_server) -> None:
    """Same Redis, same prefix, same tokens, another deployment: its keys differ, and a copied value is refused."""
    tokens = prompt(3 * BLOCK + 1)
    with node(tmp_path / "one", "a", redis_server.url) as a, node(tmp_path / "two", "b", redis_server.url) as b:
        a.store(a.keyed(tokens), kv(3, seed=3))
        assert a.remote is not None and a.remote.flush()
        assert b.lookup(b.keyed(tokens)).cached_blocks == 0
        client = redis.Redis(port=redis_server.port)
        for ka, kb in zip(a.keys(tokens), b.keys(tokens), strict=True):  # a hostile copy under b's names
            client.set(b.remote.name(kb), client.get(a.remote.name(ka)))  # type: ignore[union-attr]
        client.close()
        assert b.lookup(b.keyed(tokens)).cached_blocks == 0
        assert b.stats().tiers["remote"].bad_mac == 3  # every copied value refused at its header


def test_foreign_tokens_under_a_key_are_a_confirm_mismatch(tmp_path: Path, redis_server) -> None:
    tokens, other = prompt(2 * BLOCK + 1, seed=1), prompt(2 * BLOCK + 1, seed=2)
    with node(tmp_path, "a", redis_server.url) as a, node(tmp_path, "b", redis_server.url) as b:
        a.store(a.keyed(other), kv(2, seed=4))
        assert a.remote is not None and a.remote.flush()
        client = redis.Redis(port=redis_server.port)
        k_other, k_tokens = a.keys(other)[0], a.keys(tokens)[0]
        client.set(a.remote.name(k_tokens), client.get(a.remote.name(k_other)))  # authentic, but another key
        client.close()
        result = b.lookup(b.keyed(tokens))
        assert (result.cached_blocks, result.miss_reason) == (0, MissReason.ABSENT)
        assert b.stats().tiers["remote"].wrong_key == 1


def test_write_on_host_eviction_sends_only_victims(tmp_path: Path, redis_server) -> None:
    tokens, blocks = prompt(6 * BLOCK + 1), kv(6, seed=5)
    url = redis_server.url
    with (
        node(tmp_path, "a", url, host_blocks=4, write_on=RemoteWriteOn.HOST_EVICTION) as a,
        node(tmp_path, "b", url) as b,
    ):
        a.store(a.keyed(tokens), blocks)
        assert a.remote is not None and a.remote.flush()
        written = a.stats().tiers["remote"].writes
        assert 0 < written < 6  # the blocks host memory had to let go (the oldest), not all of them
        assert b.lookup(b.keyed(tokens)).tiers == (R,) * written


def test_redis_down_is_a_miss_and_the_breaker_opens(tmp_path: Path, redis_server) -> None:
    tokens = prompt(3 * BLOCK + 1)
    with node(tmp_path, "a", redis_server.url, breaker_failures=2, breaker_retry_s=600) as a:
        a.store(a.keyed(tokens), kv(3, seed=6))
        assert a.remote is not None and a.remote.flush()
        redis_server.kill()
        other = prompt(3 * BLOCK + 1, seed=9)
        for _ in range(3):
            assert a.lookup(a.keyed(other)).cached_blocks == 0
        assert a.lookup(a.keyed(tokens)).tiers == (H,) * 3  # local hits are untouched
        stats = a.stats().tiers["remote"]
        assert stats.breaker_opens == 1 and stats.skipped >= 1
        assert list(stats.breakers.values()) == ["open"]


def test_cluster_dead_master_loses_only_its_blocks(tmp_path: Path, redis_cluster) -> None:
    """Independent one-block prompts spread over three masters; one master dies: its blocks miss, the rest hit."""
    prompts = [prompt(BLOCK + 1, seed=100 + i) for i in range(24)]
    with node(tmp_path, "a", redis_cluster.urls, cluster=True) as a:
        for i, p in enumerate(prompts):
            a.store(a.keyed(p), kv(1, seed=200 + i))
        assert a.remote is not None and a.remote.flush()
        assert a.stats().tiers["remote"].writes == 24
        names = [a.remote.name(a.keys(p)[0]) for p in prompts]
    victim = redis_cluster.node_of(names[0])
    on_victim = [redis_cluster.node_of(n) is victim for n in names]
    assert 0 < sum(on_victim) < 24
    victim.kill()
    try:
        with node(tmp_path, "b", redis_cluster.urls, cluster=True, breaker_failures=1, breaker_retry_s=600) as b:
            hits = [b.lookup(b.keyed(p)).cached_blocks for p in prompts]
            assert hits == [0 if dead else 1 for dead in on_victim]
            got = [load(b, p) for p, dead in zip(prompts, on_victim, strict=True) if not dead]
            assert all(len(g) == 1 for g in got)
            assert b.stats().tiers["remote"].breakers[f"127.0.0.1:{victim.port}"] == "open"
    finally:
        victim.restart()
        redis_cluster.wait_ok()
