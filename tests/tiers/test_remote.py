"""The remote tier against a real redis-server: framing, hostile values, TTLs, the breaker and the write queue."""

from __future__ import annotations

import os
import signal

import pytest
import redis
import torch

from kvtier.config import RemoteConfig
from kvtier.keys import BlockKey, Secret
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.breaker import BreakerState
from kvtier.tiers.remote import MAC_STEP, RemoteTier
from kvtier.tiers.remote.frame import HEADER_BYTES, FrameError, Framer, Rejection, layout_id
from tests.helpers import as_bytes, payload, record, toy_layout
from tests.remote import remote_section

LAYOUT = toy_layout()


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


class Clock:
    """Time that moves only when a test says so (the breaker's retry period)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def open_tier(url: str, secret: Secret | None = None, clock: Clock | None = None, **over: object) -> RemoteTier:
    cfg = RemoteConfig(**remote_section(url, **over))
    secret = secret or Secret(b"s" * 32)
    return RemoteTier.open(cfg, LAYOUT, secret, "toy-model", clock=clock or Clock())


def store(tier: RemoteTier, n: int, first: int = 0) -> list[torch.Tensor]:
    blocks = [payload(LAYOUT, first + i) for i in range(n)]
    keys = [key(first + i) for i in range(n)]
    assert all(tier.put_many(keys, blocks, [record(first + i) for i in range(n)]))
    assert tier.flush()
    return blocks


def read(tier: RemoteTier, keys: list[BlockKey]) -> tuple[list[bool], list[torch.Tensor]]:
    outs = [torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8) for _ in keys]
    return tier.get_many(keys, outs), outs


# -- the value format, without a server ----------------------------------------------------------
FRAMER = Framer(b"k" * 32, layout_id("toy-model", LAYOUT.descriptor, LAYOUT.block_bytes), LAYOUT.block_bytes)


def value(i: int = 1, framer: Framer = FRAMER) -> bytes:
    return framer.encode(key(i), record(i, key(i - 1)), memoryview(as_bytes(payload(LAYOUT, i)).numpy()))


def test_frame_round_trip_keeps_record_and_payload() -> None:
    v = value(3)
    header = FRAMER.header(key(3), v)
    assert header.record == record(3, key(2))
    body = FRAMER.payload(key(3), v, record(3).digest)
    assert bytes(body) == as_bytes(payload(LAYOUT, 3)).numpy().tobytes()


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 1
    return bytes(b)


@pytest.mark.parametrize(
    ("hostile", "why"),
    [
        (lambda v: v[: HEADER_BYTES - 1], Rejection.BAD_LENGTH),  # truncated inside the header
        (lambda v: v[:-1], Rejection.BAD_LENGTH),  # truncated payload
        (lambda v: v + b"\0", Rejection.BAD_LENGTH),  # oversized
        (lambda v: b"XXXX" + v[4:], Rejection.BAD_HEADER),
        (lambda v: _flip(v, 4), Rejection.BAD_HEADER),  # another format version
        (lambda v: _flip(v, 20), Rejection.BAD_MAC),  # a header byte changed
        (lambda v: _flip(v, HEADER_BYTES - 1), Rejection.BAD_MAC),  # the MAC changed
        (lambda v: value(2), Rejection.WRONG_KEY),  # an authentic value of another block
        (lambda v: value(1, Framer(b"k" * 32, b"L" * 32, LAYOUT.block_bytes)), Rejection.WRONG_LAYOUT),
        (lambda v: value(1, Framer(b"x" * 32, FRAMER._layout, LAYOUT.block_bytes)), Rejection.BAD_MAC),
        (lambda v: _flip(v, len(v) - 1), Rejection.BAD_PAYLOAD),
    ],
)
def test_every_hostile_value_is_rejected(hostile, why: Rejection) -> None:
    with pytest.raises(FrameError) as err:
        FRAMER.payload(key(1), hostile(value(1)), record(1).digest)
    assert err.value.why is why


def _other_payload(v: bytes) -> bytes:
    """The same authentic header with the payload of another write of this block (other bytes)."""
    other = FRAMER.encode(key(1), record(1, key(0)), memoryview(as_bytes(payload(LAYOUT, 7)).numpy()))
    return v[:HEADER_BYTES] + other[HEADER_BYTES:]


def test_a_payload_is_bound_to_its_own_write() -> None:
    """Each write draws its own salt, so its own payload key: one header never vouches for another write's bytes,
    and two writes of the same bytes carry different tags (a payload key never tags two messages)."""
    with pytest.raises(FrameError) as err:
        FRAMER.payload(key(1), _other_payload(value(1)), record(1).digest)
    assert err.value.why is Rejection.BAD_PAYLOAD
    first, second = FRAMER.header(key(1), value(1)), FRAMER.header(key(1), value(1))
    assert first.salt != second.salt and first.payload_tag != second.payload_tag
    mac = FRAMER.payload_mac(first)
    body = memoryview(as_bytes(payload(LAYOUT, 1)).numpy())
    for at in range(0, len(body), 1000):  # fed in pieces, as the tier feeds what lands
        mac.update(body[at : at + 1000])
    FRAMER.verify_tag(first, mac.tag())


def test_foreign_tokens_are_rejected() -> None:
    with pytest.raises(FrameError) as err:
        FRAMER.payload(key(1), value(1), record(99).digest)
    assert err.value.why is Rejection.FOREIGN_TOKENS


# -- against redis-server --------------------------------------------------------------------------
def test_store_probe_get_round_trip(redis_server) -> None:
    tier = open_tier(redis_server.url)
    try:
        assert isinstance(tier, Tier)  # the one tier protocol
        blocks = store(tier, 3)
        assert tier.probe([key(0), key(1), key(2), key(7)]) == [record(0), record(1), record(2), None]
        ok, outs = read(tier, [key(0), key(1), key(2)])
        assert ok == [True, True, True]
        for got, want in zip(outs, blocks, strict=True):
            assert torch.equal(got, as_bytes(want))
        snap = tier.snapshot()
        assert snap.writes == 3 and snap.bytes_read == 3 * LAYOUT.block_bytes
        assert snap.breakers == {f"127.0.0.1:{redis_server.port}": "closed"}
    finally:
        tier.close()


def test_key_names_are_prefix_and_hex_and_values_expire_after_ttl(redis_server) -> None:
    tier = open_tier(redis_server.url, key_prefix="kvt-test:", ttl_s=3600)
    client = redis.Redis(port=redis_server.port)
    try:
        store(tier, 1)
        assert client.keys("*") == [b"kvt-test:" + key(0).hex().encode()]
        assert 0 < client.pttl(tier.name(key(0))) <= 3_600_000
    finally:
        tier.close()
        client.close()


def test_a_hit_refreshes_the_ttl(redis_server) -> None:
    tier = open_tier(redis_server.url, ttl_s=3600)
    client = redis.Redis(port=redis_server.port)
    try:
        store(tier, 1)
        client.pexpire(tier.name(key(0)), 50_000)  # as if it had aged
        tier.probe([key(0)])
        assert read(tier, [key(0)])[0] == [True]
        assert tier.flush()
        assert client.pttl(tier.name(key(0))) > 50_000
    finally:
        tier.close()
        client.close()


def test_values_expire_by_redis_own_ttl(redis_server) -> None:
    """ttl_s is Redis's own expiry: the test waits on Redis's "expired" keyspace event, with a bound."""
    tier = open_tier(redis_server.url, ttl_s=0.2)
    client = redis.Redis(port=redis_server.port)
    client.config_set("notify-keyspace-events", "Ex")
    events = client.pubsub()
    events.subscribe("__keyevent@0__:expired")
    try:
        store(tier, 1)
        name = tier.name(key(0))
        expired = []
        for _ in range(50):
            msg = events.get_message(timeout=1.0)
            if msg is not None and msg["type"] == "message":
                expired.append(msg["data"])
                break
        assert expired == [name]
        assert not client.exists(name)
        assert tier.probe([key(0)]) == [None]
    finally:
        events.close()
        tier.close()
        client.close()


def test_hostile_values_in_redis_are_counted_misses_and_never_served(redis_server) -> None:
    tier = open_tier(redis_server.url)
    client = redis.Redis(port=redis_server.port)
    framer = tier._framer
    at_probe = {  # a header a probe already refuses
        3: _flip(value(3, framer), 20),  # forged header
        4: value(1, framer),  # a real value of block 1, copied under block 4's name
        5: value(5, Framer(b"x" * 32, framer._layout, LAYOUT.block_bytes)),  # another deployment's MAC key
        6: value(6, Framer(framer._mac_key, b"L" * 32, LAYOUT.block_bytes)),  # another model or layout
        7: b"short",
        10: b"",  # empty: GETRANGE reads it as it reads an absent key
    }
    at_read = {  # an authentic header, then a payload that is not the block's
        1: value(1, framer)[:-10],  # truncated
        2: value(2, framer) + b"x",  # oversized
        8: _flip(value(8, framer), -1),  # payload changed
    }
    try:
        for i, v in {**at_probe, **at_read}.items():
            client.set(tier.name(key(i)), v)
        client.hset(tier.name(key(9)), "a", "b")  # another type under our name
        assert tier.probe([key(i) for i in (3, 4, 5, 6, 7, 9, 10, 11)]) == [None] * 8  # 11: absent, not counted
        assert tier.probe([key(i) for i in (1, 2, 8)]) == [record(i, key(i - 1)) for i in (1, 2, 8)]
        ok, outs = read(tier, [key(1), key(2), key(8)])
        assert ok == [False, False, False]
        assert not outs[0].any() and not outs[1].any()  # refused before a byte was copied
        # (block 8's bytes were copied, then refused: the manager reads into a reserved slot and aborts it)
        snap = tier.snapshot()
        counts = {r.value: getattr(snap, r.value) for r in Rejection}
        assert counts == {
            "bad_length": 4,
            "bad_header": 0,
            "bad_mac": 2,
            "wrong_key": 1,
            "wrong_layout": 1,
            "foreign_tokens": 0,
            "bad_payload": 1,
        }
    finally:
        tier.close()
        client.close()


def test_a_block_larger_than_a_mac_step_is_authenticated_in_pieces_as_it_lands(redis_server) -> None:
    """Pieces of MAC_STEP bytes, a short last one: a good block is served whole, a byte changed in any piece is not."""
    big = KVLayout(num_layers=11, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    assert big.block_bytes > 2 * MAC_STEP and big.block_bytes % MAC_STEP
    cfg = RemoteConfig(**remote_section(redis_server.url))
    tier = RemoteTier.open(cfg, big, Secret(b"s" * 32), "toy-model", clock=Clock())
    client = redis.Redis(port=redis_server.port)
    try:
        blocks = [payload(big, i) for i in range(3)]
        assert all(tier.put_many([key(i) for i in range(3)], blocks, [record(i) for i in range(3)]))
        assert tier.flush()
        for i, at in ((1, HEADER_BYTES + MAC_STEP + 7), (2, HEADER_BYTES + big.block_bytes - 1)):
            client.set(tier.name(key(i)), _flip(client.get(tier.name(key(i))), at))
        assert tier.probe([key(i) for i in range(3)]) == [record(i) for i in range(3)]
        outs = [torch.zeros(big.block_bytes, dtype=torch.uint8) for _ in range(3)]
        assert tier.get_many([key(i) for i in range(3)], outs) == [True, False, False]
        assert torch.equal(outs[0], as_bytes(blocks[0]))
        assert tier.snapshot().bad_payload == 2
    finally:
        tier.close()
        client.close()


def test_a_value_replaced_after_the_probe_is_refused_before_its_payload_lands(redis_server) -> None:
    """Another tokens' authentic value under the same name (written by another node since): not a byte copied."""
    tier = open_tier(redis_server.url)
    client = redis.Redis(port=redis_server.port)
    try:
        store(tier, 1)
        assert tier.probe([key(0)]) == [record(0)]
        other = tier._framer.encode(key(0), record(99), memoryview(as_bytes(payload(LAYOUT, 99)).numpy()))
        client.set(tier.name(key(0)), other)
        ok, outs = read(tier, [key(0)])
        assert ok == [False] and not outs[0].any()
        assert tier.snapshot().foreign_tokens == 1
        assert tier.probe([key(0)]) == [record(99)]  # the connection is still in step: the next call works
    finally:
        tier.close()
        client.close()


def test_a_killed_server_opens_the_breaker_and_a_restarted_one_closes_it(redis_server) -> None:
    clock = Clock()
    tier = open_tier(redis_server.url, clock=clock, breaker_failures=2, breaker_retry_s=5.0)
    try:
        store(tier, 1)
        redis_server.kill()
        assert tier.probe([key(0)]) == [None]
        assert tier.probe([key(0)]) == [None]
        assert tier.breakers() == {f"127.0.0.1:{redis_server.port}": BreakerState.OPEN.value}
        assert tier.probe([key(0)]) == [None]  # skipped: no call made
        snap = tier.snapshot()
        assert snap.errors == 2 and snap.skipped == 1 and snap.breaker_opens == 1
        redis_server.restart()
        assert tier.probe([key(0)]) == [None]  # still open: the retry period has not passed
        clock.now += 5.0
        store(tier, 1)  # the trial call (the write) succeeds and closes it
        assert tier.breakers() == {f"127.0.0.1:{redis_server.port}": BreakerState.CLOSED.value}
        assert tier.probe([key(0)]) == [record(0)]
    finally:
        tier.close()


def test_a_full_write_queue_drops_and_counts(redis_server) -> None:
    tier = open_tier(redis_server.url, write_queue_blocks=1, timeout_ms=10_000)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the writer's first SET waits: the queue fills
    try:
        queued = tier.put_many(
            [key(i) for i in range(4)], [payload(LAYOUT, i) for i in range(4)], [record(i) for i in range(4)]
        )
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    try:
        assert tier.flush()
        snap = tier.snapshot()
        assert queued.count(False) >= 2
        assert snap.dropped_writes == queued.count(False)
        assert snap.writes == queued.count(True)
    finally:
        tier.close()


def test_the_reply_reader_lands_bulk_bodies_where_asked_and_refuses_garbage() -> None:
    """The tier's own RESP reading of GET replies (values straight into host slots), over a socket pair."""
    import socket

    from redis.exceptions import ResponseError

    from kvtier.tiers.remote.nodes import LINE_READ, ProtocolError, RespReader

    ours, theirs = socket.socketpair()
    with ours, theirs:
        long_error = b"-ERR " + b"x" * 3 * LINE_READ  # a line longer than one line read
        theirs.sendall(b"$5\r\nhello\r\n$-1\r\n-WRONGTYPE not a string\r\n" + long_error + b"\r\n$zz\r\n")
        reader = RespReader(ours)
        slot = bytearray(5)
        assert reader.reply(lambda n: reader.read_into(memoryview(slot)[:n])) is None and slot == b"hello"
        assert reader.reply(lambda n: pytest.fail("nil has no body")) is None
        assert isinstance(reader.reply(lambda n: pytest.fail("an error has no body")), ResponseError)
        assert str(reader.reply(lambda n: pytest.fail("an error has no body"))) == long_error[1:].decode()
        with pytest.raises(ProtocolError):
            reader.reply(lambda n: pytest.fail("garbage has no body"))


def test_the_reply_reader_types_redirects_as_redis_py_does() -> None:
    """MOVED and ASK come back as redis-py's own error types, with the node to follow; a malformed one is garbage."""
    import socket

    from kvtier.tiers.remote.nodes import ProtocolError, Redirect, RespReader, redirect_of

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"-MOVED 12 127.0.0.1:7000\r\n-ASK 13 127.0.0.1:7001\r\n-ERR other\r\n-MOVED nowhere\r\n")
        reader = RespReader(ours)
        replies = [reader.reply(lambda n: pytest.fail("an error has no body")) for _ in range(3)]
        assert [redirect_of(r) for r in replies] == [
            ("127.0.0.1:7000", Redirect.MOVED),
            ("127.0.0.1:7001", Redirect.ASK),
            None,
        ]
        with pytest.raises(ProtocolError):
            reader.reply(lambda n: pytest.fail("an error has no body"))
