"""What cache_control marks keep, per tenant: quotas, the longest promise over a block, and release by age.

On an embedded :class:`~kvtier.manager.CacheManager` (real tiers in a temp
directory) with a stepped clock, so TTLs pass without sleeping.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.manager import CacheManager
from kvtier.server.retention import Retention
from tests.helpers import BLOCK, make_config, payload, prompt, toy_layout

HOUR, FIVE_MIN = 3600.0, 300.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def setup(tmp: Path, quota_blocks: dict[str, int], host_blocks: int = 32) -> tuple[CacheManager, Retention, Clock]:
    clock = Clock()
    cfg = make_config(tmp, host={"capacity_bytes": host_blocks * 4096}, disk={"enabled": False})
    m = CacheManager(cfg, toy_layout(), model_fingerprint="toy-model", clock=clock)
    block_bytes = m.layout.block_bytes
    return m, Retention(m, lambda t: quota_blocks[t] * block_bytes, clock=clock), clock


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
    assert (report["a"].blocks, report["a"].prefixes, report["b"].blocks) == (4, 1, 4)
    assert report["a"].bytes == 4 * m.layout.block_bytes and report["a"].quota_bytes == 6 * m.layout.block_bytes
    assert m.ttl_pinned() == 8  # a2's blocks and b1's
    too_big = prompt(7 * BLOCK, 4)
    assert r.keep("a", [(m.keyed(too_big, "ns-a"), HOUR)]) == [False]  # alone above the quota: not kept at all
    assert r.report()["a"].prefixes == 1


def test_nested_marks_keep_each_block_for_the_longest_promise_over_it(tmp_path: Path) -> None:
    """A system prompt marked for an hour inside a conversation marked for five minutes."""
    m, r, clock = setup(tmp_path, {"a": 16})
    convo = m.keyed(prompt(6 * BLOCK, 5), "ns")
    assert r.keep("a", [(convo, FIVE_MIN), (convo.prefix(2 * BLOCK), HOUR)]) == [True, True]
    assert m.ttl_pinned() == 6
    clock.now += FIVE_MIN + 1
    assert m.ttl_pinned() == 2 and r.report()["a"].prefixes == 1  # the conversation's promise ended, not the system's
    assert r.keep("a", [(convo.prefix(2 * BLOCK), FIVE_MIN)]) == [True]  # a shorter mark never cuts a promise short
    clock.now += FIVE_MIN + 1
    assert m.ttl_pinned() == 2
    clock.now += HOUR
    assert m.ttl_pinned() == 0 and r.report() == {}


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
