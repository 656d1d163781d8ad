"""The two cache-manager calls the admin routes stand on: a side-effect-free probe, and TTL pins.

Toy shapes (tests.helpers): 4-token blocks, one 4 KiB host slot per block.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.config import WriteMode
from kvtier.index import MissReason
from kvtier.manager import CacheManager
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, make_config, payload, prompt, toy_layout

H, D = TierKind.HOST, TierKind.DISK


def manager(tmp: Path, host_blocks: int, disk_blocks: int = 16, **kw: Any) -> CacheManager:
    cfg = make_config(
        tmp,
        host={"capacity_bytes": host_blocks * 4096},
        disk={"capacity_bytes": disk_blocks * 4096},
        cache={"write_mode": WriteMode.WRITE_BACK},
    )
    return CacheManager(cfg, toy_layout(), model_fingerprint="toy-model", **kw)


def blocks(n: int, seed: int) -> list:
    return [payload(toy_layout(), seed * 100 + i) for i in range(n)]


def test_probe_answers_like_lookup_and_changes_nothing(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=3) as m:
        a, b = prompt(3 * BLOCK, seed=1), prompt(3 * BLOCK, seed=2)
        m.store(m.keyed(a), blocks(3, 1))
        m.store(m.keyed(b[: 2 * BLOCK]), blocks(2, 2))  # evicts a's two least recent blocks to disk
        before = m.stats()
        probe = m.probe(m.keyed(a))
        assert (probe.cached_tokens, probe.tiers, probe.miss_reason) == (12, (D, D, H), MissReason.NONE)
        assert m.probe(m.keyed(a, "other")).cached_tokens == 0
        assert m.probe(m.keyed(prompt(2 * BLOCK, seed=9))).miss_reason is MissReason.ABSENT
        assert m.stats() == before, "a probe counted as traffic"
        # The policy did not see the probe: the next victim is still a's block 2, the least recent in host.
        m.store(m.keyed(prompt(BLOCK, seed=3)), blocks(1, 3))
        assert m.probe(m.keyed(a)).tiers == (D, D, D)
        assert m.lookup(m.keyed(a)).tiers == (D, D, D)
        assert m.stats().tiers["host"].lookups == before.tiers["host"].lookups + 1


def test_ttl_pinned_blocks_stay_in_host_until_they_expire(tmp_path: Path) -> None:
    now = [1000.0]
    with manager(tmp_path, host_blocks=3, clock=lambda: now[0]) as m:
        system = prompt(2 * BLOCK, seed=4)
        m.store(m.keyed(system), blocks(2, 4))
        assert m.pin_for(m.keyed(system), ttl_s=0.3) == 2 and m.ttl_pinned() == 2
        m.store(m.keyed(prompt(3 * BLOCK, seed=5)), blocks(3, 5))  # would evict both system blocks without the pin
        assert m.probe(m.keyed(system)).tiers == (H, H)
        now[0] += 0.29
        assert m.ttl_pinned() == 2
        now[0] += 0.01
        assert m.ttl_pinned() == 0  # expired, dropped lazily
        m.store(m.keyed(prompt(3 * BLOCK, seed=6)), blocks(3, 6))
        assert m.probe(m.keyed(system)).tiers == (D, D)


def test_a_pin_protects_a_prefix_stored_later_and_ttl_zero_unpins(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=2) as m:
        system = prompt(BLOCK, seed=7)
        m.pin_for(m.keyed(system), ttl_s=60)
        m.store(m.keyed(system), blocks(1, 7))
        m.store(m.keyed(prompt(2 * BLOCK, seed=8)), blocks(2, 8))
        assert m.probe(m.keyed(system)).tiers == (H,)
        m.pin_for(m.keyed(system), ttl_s=0)
        assert m.ttl_pinned() == 0
        m.store(m.keyed(prompt(2 * BLOCK, seed=9)), blocks(2, 9))
        assert m.probe(m.keyed(system)).tiers == (D,)
        with pytest.raises(ValueError, match="ttl_s"):
            m.pin_for(m.keyed(system), ttl_s=-1)
