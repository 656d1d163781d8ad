"""What promises keep, per tenant and tier: quotas, the longest promise over a block, and release by age.

On an embedded :class:`~kvtier.manager.CacheManager` (real tiers in a temp
directory, a disk tier of real files where a test asks for one) with a
stepped clock, so TTLs pass without sleeping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvtier.config import WriteMode, load_config
from kvtier.manager import CacheManager
from kvtier.server.retention import Retention, retain_quota
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, Clock, make_config, payload, prompt, toy_layout

HOUR, FIVE_MIN, DAY = 3600.0, 300.0, 86400.0
H, D = TierKind.HOST, TierKind.DISK


def setup(
    tmp: Path,
    quota_blocks: dict[str, int],
    host_blocks: int = 32,
    *,
    disk_blocks: int | None = None,
    disk_quota_blocks: dict[str, int] | None = None,
) -> tuple[CacheManager, Retention, Clock]:
    """Host quotas ``quota_blocks`` and disk quotas ``disk_quota_blocks`` (default: the same), in blocks."""
    clock = Clock()
    disk = {"enabled": False} if disk_blocks is None else {"capacity_bytes": disk_blocks * 4096}
    cfg = make_config(
        tmp, host={"capacity_bytes": host_blocks * 4096}, disk=disk, cache={"write_mode": WriteMode.WRITE_BACK}
    )
    m = CacheManager(cfg, toy_layout(), model_fingerprint="toy-model", clock=clock)
    block_bytes = m.layout.block_bytes
    quotas = {H: quota_blocks, D: disk_quota_blocks or quota_blocks}
    return m, Retention(m, lambda t, kind: quotas[kind][t] * block_bytes, clock=clock), clock


def kv_fill(n: int, seed: int) -> list:
    return [payload(toy_layout(), seed * 100 + i) for i in range(n)]


def held(m: CacheManager, tokens: np.ndarray, ns: str) -> int:
    """Leading blocks of ``tokens`` host holds now."""
    return m.probe(m.keyed(tokens, ns)).cached_tokens // BLOCK


def test_a_tenants_oldest_prefix_goes_first_and_never_anothers(tmp_path: Path) -> None:
    m, r, clock = setup(tmp_path, {"a": 6, "b": 6})
    a1, a2, b1 = prompt(4 * BLOCK, 1), prompt(4 * BLOCK, 2), prompt(4 * BLOCK, 3)
    assert r.keep("a", [(m.keyed(a1, "ns-a"), HOUR)]) == [True]
    assert r.keep("b", [(m.keyed(b1, "ns-b"), HOUR)]) == [True]
    clock.now += 1
    assert r.keep("a", [(m.keyed(a2, "ns-a"), HOUR)]) == [True]  # 8 blocks > 6: a1 is let go, b1 untouched
    report = r.report()
    assert (report["a"][H].blocks, report["a"][H].prefixes, report["b"][H].blocks) == (4, 1, 4)
    assert report["a"][H].bytes == 4 * m.layout.block_bytes and report["a"][H].quota_bytes == 6 * m.layout.block_bytes
    assert m.ttl_pinned() == 8  # a2's blocks and b1's
    too_big = prompt(7 * BLOCK, 4)
    assert r.keep("a", [(m.keyed(too_big, "ns-a"), HOUR)]) == [False]  # alone above the quota: not kept at all
    assert r.report()["a"][H].prefixes == 1


@pytest.mark.parametrize("tier", [H, D], ids=lambda t: t.value)
def test_nested_marks_keep_each_block_for_the_longest_promise_over_it(tmp_path: Path, tier: TierKind) -> None:
    """A system prompt marked for an hour inside a conversation marked for five minutes; in either tier."""
    m, r, clock = setup(tmp_path, {"a": 16}, disk_blocks=32)
    convo = m.keyed(prompt(6 * BLOCK, 5), "ns")
    assert r.keep("a", [(convo, FIVE_MIN), (convo.prefix(2 * BLOCK), HOUR)], tier) == [True, True]
    assert m.ttl_pinned() == 6
    clock.now += FIVE_MIN + 1
    assert m.ttl_pinned() == 2 and r.report()["a"][tier].prefixes == 1  # the conversation's promise ended
    assert r.keep("a", [(convo.prefix(2 * BLOCK), FIVE_MIN)], tier) == [True]  # a shorter one never cuts it short
    clock.now += FIVE_MIN + 1
    assert m.ttl_pinned() == 2
    clock.now += HOUR
    assert m.ttl_pinned() == 0 and r.report() == {}


def test_an_operators_unpin_leaves_a_tenants_promise_standing(tmp_path: Path) -> None:
    """/admin/pin with ttl_s 0 over a prefix a promise shares: the cache lets the keys go, the promise pins them
    again, to its own end (not the operator's)."""
    m, r, clock = setup(tmp_path, {"a": 16})
    convo = m.keyed(prompt(6 * BLOCK, 5), "ns")
    assert r.keep("a", [(convo.prefix(2 * BLOCK), FIVE_MIN)]) == [True]
    m.pin_for(convo, DAY, tier=H)  # an operator's pin over the whole conversation
    m.pin_for(convo, 0, tier=H)  # and its release: the promised system prompt's keys too
    assert m.ttl_pinned() == 0
    r.pin_again("a", H)
    assert m.ttl_pinned() == 2
    clock.now += FIVE_MIN + 1
    assert m.ttl_pinned() == 0  # the promise's own end


def test_kept_blocks_outlive_a_flood_and_released_ones_do_not(tmp_path: Path) -> None:
    m, r, clock = setup(tmp_path, {"a": 8}, host_blocks=16)
    first, second = prompt(4 * BLOCK, 6), prompt(4 * BLOCK, 7)
    for tokens in (first, second):
        m.store(m.keyed(tokens, "ns"), kv_fill(4, seed=int(tokens[0])))
    r.keep("a", [(m.keyed(first, "ns"), HOUR)])
    for seed in range(10, 20):  # 40 new blocks through a 16-block host tier
        m.store(m.keyed(prompt(4 * BLOCK, seed), "other"), kv_fill(4, seed=seed))
    assert held(m, first, "ns") == 4 and held(m, second, "ns") == 0
    clock.now += 1
    r.keep("a", [(m.keyed(prompt(8 * BLOCK, 30), "ns"), HOUR)])  # a newer prefix takes the whole quota
    for seed in range(40, 50):
        m.store(m.keyed(prompt(4 * BLOCK, seed), "other"), kv_fill(4, seed=seed))
    assert held(m, first, "ns") == 0  # let go, then evicted like any block


def test_disk_promises_have_a_quota_of_their_own_per_tenant(tmp_path: Path) -> None:
    """Tenant a's day-long prefixes take its disk quota, least recently used first; b's and a's host marks stand.

    What is kept is on disk (written through at the promise, write-back or
    not) and stays there through a flood that overflows host and disk alike;
    what a's quota let go is then flooded out like any block.
    """
    m, r, clock = setup(tmp_path, {"a": 4, "b": 4}, host_blocks=8, disk_blocks=16, disk_quota_blocks={"a": 6, "b": 6})
    a1, a2, b1, marked = (prompt(4 * BLOCK, seed) for seed in (60, 61, 62, 63))
    names = {"a1": (a1, "ns-a"), "a2": (a2, "ns-a"), "b1": (b1, "ns-b"), "marked": (marked, "ns-a")}
    for seed, (tokens, ns) in enumerate(names.values()):
        m.store(m.keyed(tokens, ns), kv_fill(4, seed=seed))
    assert r.keep("a", [(m.keyed(a1, "ns-a"), DAY)], D) == [True]
    assert r.keep("b", [(m.keyed(b1, "ns-b"), DAY)], D) == [True]
    assert r.keep("a", [(m.keyed(marked, "ns-a"), HOUR)]) == [True]  # host: a quota apart
    clock.now += 1
    assert r.keep("a", [(m.keyed(a2, "ns-a"), DAY)], D) == [True]  # 8 blocks > 6 on disk: a1 is let go
    report = r.report()
    assert {t: {k: v.blocks for k, v in tiers.items()} for t, tiers in report.items()} == {
        "a": {H: 4, D: 4},
        "b": {D: 4},
    }
    assert report["a"][D].quota_bytes == 6 * m.layout.block_bytes
    assert m.ttl_pinned() == 12  # a2 and b1 on disk, the marked prefix in host
    for seed in range(70, 90):  # 40 new blocks through an 8-block host and a 16-block disk
        m.store(m.keyed(prompt(2 * BLOCK, seed), "other"), kv_fill(2, seed=seed))
    tiers = {name: m.probe(m.keyed(tokens, ns)).tiers for name, (tokens, ns) in names.items()}
    assert tiers == {"a1": (), "a2": (D,) * 4, "b1": (D,) * 4, "marked": (H,) * 4}


def test_a_day_long_promise_is_kept_on_disk_or_in_host_memory_where_there_is_none(tmp_path: Path) -> None:
    with_disk, r, _ = setup(tmp_path / "disk", {"a": 4}, disk_blocks=16)
    assert r.lasting_tier() is D
    with_disk.close()
    without, r, _ = setup(tmp_path / "host", {"a": 4})
    assert r.lasting_tier() is H
    assert r.keep("a", [(without.keyed(prompt(2 * BLOCK, 80), "ns"), DAY)], r.lasting_tier()) == [True]
    assert without.ttl_pinned() == 2 and set(r.report()["a"]) == {H}
    without.close()


def test_the_disk_quota_defaults_to_half_the_disk_tier_and_is_zero_without_one(tmp_path: Path) -> None:
    cfg = load_config(environ={"KVTIER_DATA_DIR": str(tmp_path)})
    tree = cfg.model_dump()
    tree["disk"] |= {"capacity_bytes": 64 * 1024**2}
    tree["server"] |= {"retain_disk_bytes": None, "tenants": {"big": {"retain_disk_bytes": 40 * 1024**2}}}
    cfg = cfg.model_validate(tree)
    assert retain_quota(cfg, "anyone", D) == 32 * 1024**2 and retain_quota(cfg, "big", D) == 40 * 1024**2
    assert retain_quota(cfg, "big", H) == cfg.host.capacity_bytes // 2  # the host quota is not the disk one
    tree["disk"] |= {"enabled": False}
    assert retain_quota(cfg.model_validate(tree), "anyone", D) == 0
    tree["server"] |= {"retain_disk_bytes": 8 * 1024**2}
    assert retain_quota(cfg.model_validate(tree), "anyone", D) == 8 * 1024**2


def test_using_a_kept_prefix_renews_its_promise_and_its_place(tmp_path: Path) -> None:
    """A request that starts with a kept prefix (marked or not) refreshes it: TTL from now, last to go."""
    m, r, clock = setup(tmp_path, {"a": 8})
    system, other = m.keyed(prompt(4 * BLOCK, 60), "ns"), m.keyed(prompt(4 * BLOCK, 61), "ns")
    r.keep("a", [(system, FIVE_MIN)])
    clock.now += 1
    r.keep("a", [(other, FIVE_MIN)])
    clock.now += FIVE_MIN - 10  # both promises end in 10 s (system's in 9)
    longer = m.keyed(np.concatenate([prompt(4 * BLOCK, 60), prompt(3 * BLOCK, 62)]), "ns")
    assert r.used("a", longer) == 1 and r.used("b", longer) == 0  # system's, and only for its own tenant
    assert r.used("a", m.keyed(prompt(4 * BLOCK, 63), "ns")) == 0  # a prompt that starts elsewhere renews nothing
    clock.now += 60  # past the first promises: the renewed one stands, the other ended
    assert r.report()["a"][H].prefixes == 1 and m.ttl_pinned() == 4
    assert r.keep("a", [(m.keyed(prompt(4 * BLOCK, 64), "ns"), FIVE_MIN)]) == [True]
    clock.now += 1
    r.used("a", longer)  # system is the most recently used again: a newer prefix past the quota goes before it
    assert r.keep("a", [(m.keyed(prompt(4 * BLOCK, 65), "ns"), FIVE_MIN)]) == [True]
    assert r.used("a", longer) == 1  # still kept
