"""The device tier's index: confirmed matches, recency, and releases that only free what nobody shares."""

from __future__ import annotations

import numpy as np

from kvtier.engine.pool import KVPool
from kvtier.engine.resident import ResidentBlocks
from kvtier.keys import BlockKey
from tests.helpers import toy_layout


def keys(n: int, salt: int = 0) -> list[BlockKey]:
    return [BlockKey(bytes([salt, i]) * 8) for i in range(n)]


def tokens(n: int, salt: int = 0) -> np.ndarray:
    return (np.arange(n * 4, dtype=np.int32) + 100 * salt).reshape(n, 4)


def kept(n: int = 3) -> tuple[KVPool, ResidentBlocks, list[int]]:
    pool = KVPool(toy_layout(), 8)
    resident = ResidentBlocks(pool)
    ids = pool.allocate(n)
    resident.keep(keys(n), ids, tokens(n))
    pool.free(ids)  # the finished request lets go; the index keeps one reference each
    return pool, resident, ids


def test_a_match_is_the_longest_confirmed_run() -> None:
    _, resident, ids = kept()
    assert resident.match(keys(3), tokens(3)) == ids
    assert resident.peek(keys(2), tokens(2)) == 2
    other = tokens(3)
    other[1, 0] += 1  # same key, other tokens: a collision is a miss from there on
    assert resident.match(keys(3), other) == ids[:1]
    assert resident.match(keys(3, salt=9), tokens(3)) == []


def test_release_frees_least_recent_blocks_nobody_else_holds() -> None:
    pool, resident, ids = kept()
    resident.match(keys(1), tokens(1))  # block 0 becomes the most recent
    pool.share([ids[1]])  # a running request holds block 1
    assert resident.evictable() == 2
    assert resident.release(1) == 1 and pool.ref_count(ids[2]) == 0  # the least recent unshared one
    assert resident.release(5) == 1 and pool.ref_count(ids[0]) == 0
    assert len(resident) == 1 and pool.ref_count(ids[1]) == 2


def test_keep_twice_takes_one_reference_and_clear_gives_all_back() -> None:
    pool, resident, ids = kept()
    resident.keep(keys(3), ids, tokens(3))
    assert [pool.ref_count(b) for b in ids] == [1, 1, 1]
    resident.clear()
    assert len(resident) == 0 and pool.num_free == 8


def test_blocks_count_as_stored_only_in_the_generation_they_were_kept_in() -> None:
    _, resident, ids = kept()  # kept in generation 0
    assert resident.stored_in(keys(3), 0) == 3 and resident.stored_in(keys(3), 1) == 0
    resident.keep(keys(2), ids[:2], tokens(2), generation=1)  # stored again in the new cache: the first two
    assert resident.stored_in(keys(3), 1) == 2
    assert resident.stored_in(keys(3, salt=9), 1) == 0  # not held at all


def test_a_namespaces_clear_gives_back_only_the_blocks_kept_under_its_root() -> None:
    pool = KVPool(toy_layout(), 8)
    resident = ResidentBlocks(pool)
    roots = {name: BlockKey(name.encode() * 4) for name in ("acme", "else")}
    held = {}
    for salt, name in enumerate(roots):
        ids = pool.allocate(3)
        resident.keep(keys(3, salt), ids, tokens(3, salt), root=roots[name])
        pool.free(ids)
        held[name] = ids
    assert resident.clear(roots["acme"]) == 3
    assert [pool.ref_count(b) for b in held["acme"]] == [0, 0, 0]
    assert resident.match(keys(3, 1), tokens(3, 1)) == held["else"] and resident.peek(keys(3, 0), tokens(3, 0)) == 0
    assert resident.clear() == 3 and pool.num_free == 8
