"""The remote tier against a real Redis Cluster that changes under it: a live reshard, and a replica failover.

Each step of the cluster's change is made by the test (``CLUSTER SETSLOT``,
``MIGRATE``, ``SIGKILL``, ``CLUSTER FAILOVER TAKEOVER``) and awaited on the
cluster's own state, bounded; between steps the tier reads and writes, so
every outcome is exact: the right bytes, or a counted miss, never an error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import torch
from redis.crc import key_slot

from kvtier.bench.redis_server import RedisCluster, RedisServer
from kvtier.config import RemoteConfig
from kvtier.keys import BlockKey, Secret
from kvtier.tiers.remote import RemoteTier
from tests.helpers import as_bytes, payload, record, toy_layout
from tests.remote import remote_section

LAYOUT = toy_layout()


class Clock:
    """Time that moves only when a test says so (slot map refreshes, breaker retries)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def open_tier(cluster: RedisCluster, clock: Clock, **over: object) -> RemoteTier:
    over = {"timeout_ms": 5000, **over}  # a loaded machine must not turn a slow answer into a miss here
    cfg = RemoteConfig(**remote_section(cluster.urls, cluster=True, **over))
    return RemoteTier.open(cfg, LAYOUT, Secret(b"s" * 32), "toy-model", clock=clock)


def put(tier: RemoteTier, ids: list[int]) -> None:
    assert all(tier.put_many([key(i) for i in ids], [payload(LAYOUT, i) for i in ids], [record(i) for i in ids]))
    assert tier.flush()


def served(tier: RemoteTier, ids: list[int]) -> list[bool]:
    """Probe then read ``ids``; True where the block came back with exactly its bytes (a wrong byte fails)."""
    keys = [key(i) for i in ids]
    tier.probe(keys)
    outs = [torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8) for _ in ids]
    ok = tier.get_many(keys, outs)
    for i, got, hit in zip(ids, outs, ok, strict=True):
        assert not hit or torch.equal(got, as_bytes(payload(LAYOUT, i)))
    return ok


def in_slot(tier: RemoteTier, slot: int, count: int, skip: set[int]) -> list[int]:
    """Block ids whose key names hash to ``slot`` (a search over ids: about 16,384 tries per id found)."""
    found = [i for i in range(1, 400_000) if i not in skip and key_slot(tier.name(key(i))) == slot][:count]
    assert len(found) == count
    return found


# -- a live reshard ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster.start() as c:
        yield c


def test_a_live_reshard_is_followed_and_never_serves_a_wrong_byte(cluster: RedisCluster) -> None:
    """One slot moves between masters key by key (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE) while the tier
    reads and writes: ASK and MOVED are followed, so every block is served with its bytes at every step."""
    clock = Clock()
    tier = open_tier(cluster, clock)
    try:
        slot = key_slot(tier.name(key(0)))
        moving = [0, *in_slot(tier, slot, 3, {0})]  # four blocks in the slot that moves: three now, one later
        others = list(range(500_000, 500_008))  # blocks in other slots (not searched: wherever they hash)
        put(tier, moving[:3] + others)
        source = cluster.owner(slot)
        target = next(n for n in cluster.nodes if n is not source)
        names = {i: tier.name(key(i)).decode() for i in moving}

        cluster.command(target, "cluster", "setslot", str(slot), "importing", cluster.node_id(source))
        cluster.command(source, "cluster", "setslot", str(slot), "migrating", cluster.node_id(target))
        assert served(tier, moving[:3] + others) == [True] * 11

        migrate = ("migrate", "127.0.0.1", str(target.port), "", "0", "5000", "keys")
        assert cluster.command(source, *migrate, names[moving[0]]).strip() == "OK"
        before = tier.snapshot().redirects
        assert served(tier, moving[:3] + others) == [True] * 11  # the moved key by ASK, the rest from the source
        assert tier.snapshot().redirects > before
        put(tier, [moving[3]])  # a new key in the migrating slot: the source sends the SET on (ASK)
        assert tier.snapshot().dropped_writes == 0
        assert _exists_importing(target, names[moving[3]])
        assert served(tier, [moving[3]]) == [True]

        assert cluster.command(source, *migrate, names[moving[1]], names[moving[2]]).strip() == "OK"
        for node in cluster.nodes:  # the slot is the target's now, on every master (no wait for gossip)
            cluster.command(node, "cluster", "setslot", str(slot), "node", cluster.node_id(target))
        cluster.wait_until(lambda: cluster.owner(slot) is target, "the target owns the moved slot")
        before = tier.snapshot().redirects
        assert served(tier, moving + others) == [True] * 12  # MOVED followed, and the slot map read again
        assert tier.snapshot().redirects > before
        clock.now += 1.0  # the map refresh on MOVED is at most once a second
        assert served(tier, moving) == [True] * 4
        route = tier._nodes.route([tier.name(key(i)) for i in moving])
        assert [n.name for n in route] == [f"127.0.0.1:{target.port}"]
        snap = tier.snapshot()
        assert (snap.errors, snap.dropped_writes, snap.bad_length) == (0, 0, 0)
    finally:
        tier.close()


def _exists_importing(node: RedisServer, name: str) -> bool:
    """Whether ``node``, importing the name's slot, holds it (it answers only behind ``ASKING``)."""
    client = redis.Redis(port=node.port)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("ASKING")
        pipe.execute_command("EXISTS", name)
        return pipe.execute()[1] == 1
    finally:
        client.close()


# -- a failover to a replica ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicated() -> Iterator[RedisCluster]:
    """Three masters with a replica each; the surviving masters keep serving while one is away."""
    flags = ("--cluster-require-full-coverage", "no", "--repl-diskless-sync-delay", "0")  # replicas sync at once
    with RedisCluster.start(replicas=1, extra=flags) as c:
        yield c


def _replicated(master: RedisServer) -> None:
    """Until the master's writes so far reached its replica (``WAIT``, bounded by its timeout)."""
    client = redis.Redis(port=master.port)
    try:
        assert client.execute_command("WAIT", 1, 10_000) == 1
    finally:
        client.close()


def test_a_killed_master_misses_until_its_replica_takes_over_then_hits_through_it(replicated: RedisCluster) -> None:
    clock = Clock()
    masters = [n for n in replicated.nodes if replicated.command(n, "role").split()[:1] == ["master"]]
    tier = open_tier(replicated, clock, breaker_failures=1, breaker_retry_s=600.0)
    ids = list(range(24))
    try:
        put(tier, ids)
        for master in masters:
            _replicated(master)
        victim = replicated.node_of(tier.name(key(0)))
        lost = replicated.slots_of(victim)
        on_victim = [key_slot(tier.name(key(i))) in lost for i in ids]
        assert 0 < sum(on_victim) < len(ids)
        replica = replicated.replica_of(victim)

        victim.kill()
        assert served(tier, ids) == [not dead for dead in on_victim]  # its blocks miss (counted), the rest hit
        snap = tier.snapshot()
        assert snap.errors >= 1 and snap.breakers[f"127.0.0.1:{victim.port}"] == "open"

        assert replicated.command(replica, "cluster", "failover", "takeover").strip() == "OK"
        slot = key_slot(tier.name(key(0)))
        replicated.wait_until(
            lambda: all(f"127.0.0.1:{replica.port}" in _owner_of(n, slot) for n in replicated.live()),
            "every live node names the promoted replica as the slot's owner",
        )
        assert served(tier, ids) == [not dead for dead in on_victim]  # the slot map is read at most once a second
        clock.now += 1.0
        assert served(tier, ids) == [True] * len(ids)  # the promoted replica serves the victim's blocks
        assert tier.breakers()[f"127.0.0.1:{replica.port}"] == "closed"
    finally:
        tier.close()


def _owner_of(node: RedisServer, slot: int) -> str:
    """``host:port`` of the master ``node`` believes owns ``slot`` (from its ``CLUSTER SLOTS``), or ''."""
    client = redis.Redis(port=node.port)
    try:
        for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
            if int(start) <= slot <= int(end):
                host = master[0].decode() if isinstance(master[0], bytes) else master[0]
                return f"{host}:{int(master[1])}"
    finally:
        client.close()
    return ""
