"""The node's KV events in vLLM's format over real ZMQ sockets on loopback: batches, replays, snapshots, restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import zmq

from kvtier.config import EventSource
from kvtier.events import HeldKeys
from kvtier.keys import BlockKey
from kvtier.publisher import EventPublisher
from kvtier.route.backends import Backend, Fleet
from kvtier.route.choice import RoundRobin
from kvtier.route.subscribe import follow_zmq
from kvtier.tiers.base import TierKind
from kvtier.vllm_events import (
    DECODER,
    ENCODER,
    END_SEQ,
    SNAPSHOT,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    split,
)

ROOT = BlockKey(b"r" * 16)
ANY_PORT = "tcp://127.0.0.1:*"


def keys(*ns: int) -> list[BlockKey]:
    return [BlockKey(n.to_bytes(16, "big")) for n in ns]


def publisher(held: HeldKeys, **kw) -> EventPublisher:
    kw.setdefault("replay_endpoint", ANY_PORT)
    kw.setdefault("heartbeat_s", 3600.0)
    pub = EventPublisher(kw.pop("endpoint", ANY_PORT), block_size=16, root=ROOT, snapshot=held.snapshot, **kw)
    held.listen(pub)
    return pub


@pytest.fixture
def held() -> Iterator[HeldKeys]:
    yield HeldKeys()


def replay(endpoint: str, start: bytes | int) -> list[tuple[int, KVEventBatch]]:
    """What a replay request from ``start`` is answered with, up to the end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start if isinstance(start, bytes) else start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(20_000), "no answer from the replay socket"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            seq, payload = split(frames[1:])
            out.append((seq, DECODER.decode(payload)))
    finally:
        dealer.close(linger=0)


def state(batches: list[tuple[int, KVEventBatch]]) -> dict[str, set[bytes]]:
    """What a consumer applying ``batches`` in order knows: medium -> hashes."""
    held: dict[str, set[bytes]] = {}
    for _, batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                held.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                held.setdefault(event.medium, set()).difference_update(event.block_hashes)
    return {m: s for m, s in held.items() if s}


def test_batches_carry_kvtier_keys_each_tiers_medium_and_the_incarnation(held: HeldKeys) -> None:
    pub = publisher(held)
    try:
        held.stored(TierKind.HOST, keys(1, 2))
        held.stored(TierKind.HOST, keys(3))
        held.removed(TierKind.HOST, keys(1))
        held.stored(TierKind.DISK, keys(2))
        held.stored(TierKind.DEVICE, keys(4))
        batches = replay(pub.replay_endpoint, 0)
    finally:
        pub.close()
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    assert batches[0][1].events == []  # a start is published at once: a restarted node says so
    assert {b.incarnation for _, b in batches} == {pub.incarnation} and {b.root for _, b in batches} == {bytes(ROOT)}
    assert state(batches) == {
        "CPU": {bytes(k) for k in keys(2, 3)},
        "DISK": {bytes(keys(2)[0])},
        "GPU": {bytes(keys(4)[0])},
    }
    stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]
    assert all(e.token_ids == [] and e.block_size == 16 and e.parent_block_hash is None for e in stored)
    assert any(isinstance(e, BlockRemoved) for _, b in batches for e in b.events)


def test_a_replay_from_a_buffered_number_sends_the_rest_and_an_older_one_a_snapshot(held: HeldKeys) -> None:
    pub = publisher(held, buffer_batches=3)
    try:
        for n in range(6):  # one batch each: the replay between them waits until it is published
            held.stored(TierKind.HOST, keys(n))
            last = replay(pub.replay_endpoint, pub.report().last_seq)[-1][0]
        held.removed(TierKind.HOST, keys(0))
        held.stored(TierKind.DISK, keys(9))
        recent = replay(pub.replay_endpoint, last)
        old = replay(pub.replay_endpoint, 0)
        asked = replay(pub.replay_endpoint, SNAPSHOT)
        report = pub.report()
    finally:
        pub.close()
    assert [seq for seq, _ in recent] == list(range(last, report.last_seq + 1))
    for snapshot in (old, asked):
        assert len(snapshot) == 1 and snapshot[0][0] == report.last_seq
        events = snapshot[0][1].events
        assert isinstance(events[0], AllBlocksCleared) and all(isinstance(e, BlockStored) for e in events[1:])
        assert state(snapshot) == {"CPU": {bytes(k) for k in keys(1, 2, 3, 4, 5)}, "DISK": {bytes(keys(9)[0])}}
    assert report.snapshots == 2 and report.replays >= 7


def test_a_cleared_tier_is_published_as_all_cleared_and_what_the_others_hold(held: HeldKeys) -> None:
    pub = publisher(held)
    try:
        held.stored(TierKind.HOST, keys(1, 2))
        held.stored(TierKind.DISK, keys(1))
        held.cleared(TierKind.HOST)
        held.stored(TierKind.HOST, keys(7))
        batches = replay(pub.replay_endpoint, 0)
    finally:
        pub.close()
    assert state(batches) == {"CPU": {bytes(keys(7)[0])}, "DISK": {bytes(keys(1)[0])}}
    assert any(isinstance(e, AllBlocksCleared) for _, b in batches for e in b.events)


def test_a_subscriber_hears_heartbeats_in_silence(held: HeldKeys) -> None:
    pub = publisher(held, heartbeat_s=0.05, replay_endpoint=None)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        assert sub.poll(20_000), "no heartbeat"
        seq, payload = split(sub.recv_multipart())
        batch = DECODER.decode(payload)
        assert seq > 0 and batch.events == [] and batch.incarnation == pub.incarnation
    finally:
        sub.close(linger=0)
        pub.close()


async def _until(condition, what: str, timeout_s: float = 30.0) -> float:
    """Poll ``condition`` on the event loop until it holds; returns when it did (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
    return time.monotonic()


def test_the_router_follows_a_node_across_its_restart_by_snapshot() -> None:
    """A node's publisher goes away and another incarnation binds the same ports with other blocks: the router
    drops the old index when the connection drops and holds exactly the new state after one replay round trip."""
    backend = Backend("http://node", up=True)
    fleet = Fleet({backend.url: backend}, RoundRobin(), 16)
    prompts = SimpleNamespace(hasher=None, namespace="default", root=bytes(ROOT).hex())
    before, after = HeldKeys(), HeldKeys()
    before.stored(TierKind.HOST, keys(1, 2, 3))
    first = publisher(before, endpoint=ANY_PORT)
    source = EventSource(endpoint=first.endpoint, replay_endpoint=first.replay_endpoint)

    async def run() -> None:
        task = asyncio.create_task(follow_zmq(fleet, backend, prompts, source))  # type: ignore[arg-type]
        try:
            await _until(lambda: fleet.index.blocks(backend.url) == 3, "the first node's snapshot")
            before.stored(TierKind.DISK, keys(4))
            await _until(lambda: fleet.index.match(backend.url, keys(4)) == [TierKind.DISK], "a published store")
            first.close()
            await _until(lambda: not backend.events_live, "the dropped connection")
            assert fleet.index.blocks(backend.url) == 0  # no stale routes while the node is away
            after.stored(TierKind.DISK, keys(1, 5))
            second = publisher(after, endpoint=source.endpoint, replay_endpoint=source.replay_endpoint)
            try:
                await _until(lambda: fleet.index.blocks(backend.url) == 2, "the restarted node's state")
                assert fleet.index.match(backend.url, keys(1)) == [TierKind.DISK]
                assert fleet.index.match(backend.url, keys(2, 3, 4)) == []
                after.stored(TierKind.HOST, keys(6))
                await _until(lambda: fleet.index.match(backend.url, keys(6)) == [TierKind.HOST], "a later store")
            finally:
                second.close()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(run(), 60))


def test_garbage_on_the_stream_costs_a_resubscription_never_the_follower() -> None:
    backend = Backend("http://node", up=True)
    fleet = Fleet({backend.url: backend}, RoundRobin(), 16)
    prompts = SimpleNamespace(hasher=None, namespace="default", root=bytes(ROOT).hex())
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    good = ENCODER.encode(
        KVEventBatch(1.0, [BlockStored([bytes(keys(1)[0])], None, [], 16, None, "CPU")], 0, 7, bytes(ROOT))
    )

    async def run() -> None:
        task = asyncio.create_task(follow_zmq(fleet, backend, prompts, EventSource(endpoint=f"tcp://127.0.0.1:{port}")))  # type: ignore[arg-type]
        try:
            seq = 0
            for garbage in ([b"one frame"], [b"", (1).to_bytes(8, "big"), b"\x93not a batch"]):
                while not fleet.index.blocks(backend.url):  # a SUB socket hears nothing until it has joined
                    pub.send_multipart([b"", seq.to_bytes(8, "big"), good])
                    seq += 1
                    await asyncio.sleep(0.02)
                pub.send_multipart(garbage)  # the stream is dropped, the index with it, and followed again
                await _until(lambda: fleet.index.blocks(backend.url) == 0, "the garbage noticed")
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        pub.close(linger=0)


def test_the_router_catches_up_on_a_gap_from_the_buffer_or_else_a_snapshot(held: HeldKeys) -> None:
    """What the follower does on a gap, against a real replay socket: a start the buffer holds is replayed
    batch by batch on top of the index; an older one is answered by a snapshot that replaces it."""
    import zmq.asyncio

    from kvtier.route import subscribe
    from kvtier.route.vllm import VllmKeys

    backend = Backend("http://node", up=True)
    fleet = Fleet({backend.url: backend}, RoundRobin(), 16)
    prompts = SimpleNamespace(hasher=None, namespace="default", root=bytes(ROOT).hex())
    events = VllmKeys(backend.url, None, "default", fleet.index, fleet.guesses)  # type: ignore[arg-type]
    pub = publisher(held, buffer_batches=4)
    try:
        for n in range(3):
            held.stored(TierKind.HOST, keys(n))
            replay(pub.replay_endpoint, pub.report().last_seq)  # one batch each
        missed_from = pub.report().last_seq - 1  # the last two stores' batches

        async def run() -> None:
            dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            dealer.connect(pub.replay_endpoint)
            try:
                fleet.index.stored(backend.url, TierKind.HOST, keys(0, 99))  # what the router knew before the gap
                at = await subscribe._resync(fleet, backend, prompts, events, dealer, missed_from)  # type: ignore[arg-type]
                assert at.expected == pub.report().last_seq + 1 and at.incarnation == pub.incarnation
                assert fleet.index.blocks(backend.url) == 4  # 0 and 99 kept, 1 and 2 replayed on top
                for n in range(3, 9):
                    held.stored(TierKind.DISK, keys(n))
                    await asyncio.to_thread(replay, pub.replay_endpoint, pub.report().last_seq)
                await subscribe._resync(fleet, backend, prompts, events, dealer, at.expected)  # type: ignore[arg-type]
                assert fleet.index.blocks(backend.url) == 9 and fleet.index.match(backend.url, keys(99)) == []
            finally:
                dealer.close(linger=0)

        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        pub.close()
    assert backend.event_resyncs == 2 and pub.report().snapshots == 1
