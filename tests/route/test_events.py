"""The publishing side of block events: what a tier holds, as the manager's own policies see it, streamed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from kvtier.config import WriteMode
from kvtier.events import DECODER, Cleared, HeldKeys, Hello, Removed, Snapshot, Stored
from kvtier.keys import BlockKey
from kvtier.manager import CacheManager
from kvtier.server.kv_events import EventFeed
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, make_config, payload, prompt, toy_layout

H, D = TierKind.HOST, TierKind.DISK


class Recorder:
    def __init__(self) -> None:
        self.held: dict[TierKind, set[BlockKey]] = {}

    def stored(self, tier: TierKind, keys: list[BlockKey]) -> None:
        self.held.setdefault(tier, set()).update(keys)

    def removed(self, tier: TierKind, keys: list[BlockKey]) -> None:
        self.held.setdefault(tier, set()).difference_update(keys)

    def cleared(self, tier: TierKind) -> None:
        self.held[tier] = set()


def small_write_back_cache(tmp_path: Path) -> CacheManager:
    """Three host blocks over sixteen on disk, write-back: a five-block store sends some down."""
    cfg = make_config(
        tmp_path,
        host={"capacity_bytes": 3 * 4096},
        disk={"capacity_bytes": 16 * 4096},
        cache={"write_mode": WriteMode.WRITE_BACK},
    )
    return CacheManager(cfg, toy_layout(), model_fingerprint="toy-model")


def store_blocks(m: CacheManager, blocks: int, seed: int = 0) -> list[int]:
    """A prompt of ``blocks`` whole blocks stored with toy payloads; its tokens."""
    tokens = prompt(blocks * BLOCK, seed=seed)
    m.store(m.keyed(tokens), [payload(m.layout, i) for i in range(blocks)])
    return tokens


def test_observed_manager_reports_stores_demotions_and_clears(tmp_path: Path) -> None:
    with small_write_back_cache(tmp_path) as m:
        first = store_blocks(m, 2, seed=1)
        seen = Recorder()
        m.observe(seen)
        assert seen.held[H] == set(m.keys(first))  # what was there before: reported at once
        tokens = store_blocks(m, 5)
        keys = m.keys(tokens)
        tiers = m.lookup(m.keyed(tokens)).tiers
        assert seen.held[H] == {k for k, t in zip(keys, tiers, strict=True) if t is H}
        assert {k for k in keys if k in seen.held[D]} == {k for k, t in zip(keys, tiers, strict=True) if t is D}
        m.clear(TierKind.HOST)
        assert seen.held[H] == set()


def _lines(feed: EventFeed, act: list, n: int) -> list:
    async def run() -> list:
        out = []
        stream = feed.stream(ping_s=0.05)
        async for line in stream:
            out.append(DECODER.decode(line))
            if len(out) == 2:
                for step in act:
                    await asyncio.to_thread(step)  # another thread, as the engine's
            if len(out) == n:
                break
        await stream.aclose()
        return out

    return asyncio.run(run())


def test_feed_starts_with_hello_and_snapshot_then_streams_changes() -> None:
    a, b = BlockKey(b"a" * 16), BlockKey(b"b" * 16)
    feed = EventFeed(16, BlockKey(b"r" * 16))
    feed.stored(H, [a, b])
    feed.removed(H, [b])
    steps = [lambda: feed.stored(D, [b]), lambda: feed.removed(H, [a]), lambda: feed.cleared(D)]
    hello, snap, *events = _lines(feed, steps, 5)
    assert isinstance(hello, Hello) and hello.root == (b"r" * 16).hex() and hello.block_size == 16
    assert snap == Snapshot({H: [a.hex()]})
    assert events == [Stored(D, [b.hex()]), Removed(H, [a.hex()]), Cleared(D)]
    assert feed.subscribers == 0


def test_feed_pings_when_idle() -> None:
    feed = EventFeed(16, BlockKey(b"r" * 16))
    *_, ping = _lines(feed, [], 3)
    assert msgspec.json.encode(ping) == b'{"type":"ping"}'


def test_held_keys_following_a_manager_list_its_tiers_and_keep_no_key_of_their_own(tmp_path: Path) -> None:
    """A snapshot comes from the tiers' own indexes, and fits with the events a listener hears after it."""
    with small_write_back_cache(tmp_path) as m:
        first = store_blocks(m, 2, seed=1)
        held = HeldKeys()
        assert m.follow(held)
        seen = Recorder()
        start = held.listen(seen)
        assert set(start) == {H, D} and set(start[H]) == set(m.keys(first)) and start[D] == []
        seen.held = {tier: set(keys) for tier, keys in start.items()}
        store_blocks(m, 5)  # host holds 3: some go down
        now = {tier: set(keys) for tier, keys in held.snapshot().items()}
        assert now == {H: set(m.host.keys()), D: set(m.disk.keys())} and now[D]
        assert seen.held == now  # the first snapshot and the events after it add up to the tiers
        m.clear(TierKind.HOST)
        assert held.snapshot()[H] == [] and seen.held[H] == set()
        assert held._held == {}  # no copy of a key the tiers index already
