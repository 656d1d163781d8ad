"""TTL pins name the tier they protect: host memory, or the disk tier under it.

Through a real :class:`~kvtier.manager.CacheManager` (a host slab and a disk
tier of real files in a temp directory), toy shapes (4-token blocks, one 4 KiB
slot each), write-back, and a stepped clock, so TTLs pass without sleeping.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.config import WriteMode
from kvtier.keys import BlockKey
from kvtier.manager import CacheManager
from kvtier.pins import Pins
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, Clock, make_config, payload, prompt, toy_layout

H, D = TierKind.HOST, TierKind.DISK


def manager(tmp: Path, clock: Clock, host_blocks: int = 4, disk_blocks: int | None = 8) -> CacheManager:
    disk = {"enabled": False} if disk_blocks is None else {"capacity_bytes": disk_blocks * 4096}
    cfg = make_config(
        tmp, host={"capacity_bytes": host_blocks * 4096}, disk=disk, cache={"write_mode": WriteMode.WRITE_BACK}
    )
    return CacheManager(cfg, toy_layout(), model_fingerprint="toy-model", clock=clock)


def blocks(n: int, seed: int) -> list:
    return [payload(toy_layout(), seed * 100 + i) for i in range(n)]


def flood(m: CacheManager, first_seed: int, prompts: int) -> None:
    """``prompts`` new 2-block prompts: each write-back eviction from host lands on disk and presses it."""
    for seed in range(first_seed, first_seed + prompts):
        m.store(m.keyed(prompt(2 * BLOCK, seed), "other"), blocks(2, seed))


def test_a_disk_pin_keeps_its_blocks_on_disk_through_pressure_until_it_expires(tmp_path: Path) -> None:
    clock = Clock()
    with manager(tmp_path, clock) as m:
        system = m.keyed(prompt(2 * BLOCK, seed=1))
        m.store(system, blocks(2, 1))
        assert m.pin_for(system, 60.0, tier=D) == 2 and m.ttl_pinned() == 2
        flood(m, 10, 20)  # 40 blocks through a 4-block host and an 8-block disk
        assert m.probe(system).tiers == (D, D)  # host let them go (no host pin); disk kept them
        assert m.disk is not None and m.disk.stats.evictions > 0
        clock.now += 60.0
        assert m.ttl_pinned() == 0
        flood(m, 40, 20)
        assert m.probe(system).cached_tokens == 0  # expired: evicted like any block


def test_host_and_disk_pins_are_apart(tmp_path: Path) -> None:
    """Letting the host promise go leaves the disk one standing, and a disk pin does not hold host memory."""
    clock = Clock()
    with manager(tmp_path, clock) as m:
        system = m.keyed(prompt(2 * BLOCK, seed=2))
        m.store(system, blocks(2, 2))
        m.pin_for(system, 60.0, tier=H)
        m.pin_for(system, 60.0, tier=D)
        flood(m, 10, 4)
        assert m.probe(system).tiers == (H, H)
        m.pin_for(system, 0, tier=H)
        assert m.ttl_pinned() == 2  # still under the disk pin
        flood(m, 20, 20)
        assert m.probe(system).tiers == (D, D)


def test_a_disk_pin_without_a_disk_tier_pins_nothing(tmp_path: Path) -> None:
    clock = Clock()
    with manager(tmp_path, clock, disk_blocks=None) as m:
        system = m.keyed(prompt(2 * BLOCK, seed=3))
        assert m.pin_for(system, 60.0, tier=D) == 0
        assert m.pin_for(system, 60.0, tier=TierKind.REMOTE) == 0
        assert m.ttl_pinned() == 0
        assert m.pin_for(system, 60.0) == 2 and m.ttl_pinned() == 2


def test_what_each_tier_excludes() -> None:
    clock = Clock()
    pins = Pins(clock)
    a, b, c = (BlockKey(bytes([i]) * 16) for i in range(3))
    pins.pin([a])  # a read pin: host only
    pins.keep([b], 10.0, H)
    pins.keep([c], 20.0, D)
    assert [k in pins.exclude(H) for k in (a, b, c)] == [True, True, False]
    assert [k in pins.exclude(D) for k in (a, b, c)] == [False, False, True]
    assert c in pins.exclude(D) and pins.kept() == 2 and pins.kept_among([a, b, c]) == [b, c]
    clock.now += 10.0
    assert b not in pins.exclude(H) and a in pins.exclude(H) and pins.kept_among([a, b, c]) == [c]
    clock.now += 10.0
    assert c not in pins.exclude(D) and pins.kept() == 0


def test_a_promise_says_which_keys_it_newly_covers() -> None:
    """Only those need writing through: a renewal (any tier's) covers nothing new; one past its expiry does."""
    clock = Clock()
    pins = Pins(clock)
    a, b = (BlockKey(bytes([i]) * 16) for i in range(2))
    assert pins.keep([a], 10.0, H) == [a]
    assert pins.keep([a, b], 10.0, D) == [b]  # a's host promise covered it already
    assert pins.keep([a, b], 10.0, H) == []
    assert pins.keep([a], 0.0, H) == [] and pins.keep([a], 0.0, D) == []  # letting go covers nothing
    clock.now += 10.0
    assert pins.keep([a, b], 5.0, H) == [a, b]  # both promises had ended
