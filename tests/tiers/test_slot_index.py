"""The tiers' native slot index (native/slot_index.c) against a model of dicts, and the LRU that ranks by it."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from kvtier.policy.lru import LRUPolicy
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.tiers.slot_index import SlotIndex
from tests.helpers import payload, record, toy_layout

KEY = 16


def test_the_index_answers_as_a_dict_and_a_recency_list_would_over_random_operations() -> None:
    """Puts, pops, replacements, and the recency list's enter/touch/leave: every answer as the model's."""
    rng = random.Random(7)
    cap, size = 64, 12
    index = SlotIndex(cap, size)
    keys = [rng.randbytes(KEY) for _ in range(150)]
    held: dict[bytes, tuple[int, bytes]] = {}  # key -> (slot, record)
    ranked: list[bytes] = []  # the recency list, least recent first
    free = list(range(cap))
    for _ in range(20_000):
        k, op = rng.choice(keys), rng.random()
        if op < 0.3 and free:
            slot = free.pop(rng.randrange(len(free)))
            value = rng.randbytes(size)
            old = index.put(k, slot, value)
            if k in held:  # the key moves: its old slot comes back for the caller to free
                assert old == held[k][0]
                free.append(old)
                if k in ranked:
                    ranked.remove(k)
            else:
                assert old == -1
            held[k] = (slot, value)
        elif op < 0.45:
            slot = index.pop(k)
            assert slot == (held[k][0] if k in held else -1)
            if k in held:
                free.append(held.pop(k)[0])
                if k in ranked:
                    ranked.remove(k)
        elif op < 0.6:
            assert index.enter(k) == (k in held)
            if k in held:
                if k in ranked:
                    ranked.remove(k)
                ranked.append(k)
        elif op < 0.75:
            assert index.touch(k) == (k in ranked)
            if k in ranked:
                ranked.remove(k)
                ranked.append(k)
        elif op < 0.8:
            assert index.leave(k) == (k in ranked)
            if k in ranked:
                ranked.remove(k)
        else:
            assert index.get(k) == held.get(k)
            assert index.find(k) == (held[k][0] if k in held else -1)
            assert index.is_linked(k) == (k in ranked)
            assert (k in index) == (k in held)
        assert len(index) == len(held) and index.linked == len(ranked)
    assert index.oldest(cap) == ranked
    assert index.oldest(3, 2) == ranked[2:5]
    assert np.frombuffer(index.recency(), np.uint32).tolist() == [held[k][0] for k in ranked]
    slots, packed_keys, values = index.dump()
    by_slot = sorted((slot, k, v) for k, (slot, v) in held.items())
    assert np.frombuffer(slots, np.uint32).tolist() == [s for s, _, _ in by_slot]
    assert packed_keys == b"".join(k for _, k, _ in by_slot) and values == b"".join(v for _, _, v in by_slot)
    assert index.slots() == slots
    assert all(index.key(s) == k and index.record(s) == v for s, k, v in by_slot)


def test_a_slot_holding_another_key_is_refused_and_nothing_changes() -> None:
    index = SlotIndex(4, 8)
    a, b = b"a" * KEY, b"b" * KEY
    assert index.put(a, 1, bytes(8)) == -1
    with pytest.raises(ValueError, match="slot 1 holds another key"):
        index.put(b, 1, bytes(8))
    with pytest.raises(IndexError):
        index.put(b, 4, bytes(8))
    with pytest.raises(ValueError, match="a record is 8 bytes"):
        index.put(b, 2, bytes(7))
    with pytest.raises(TypeError, match="a key is 16 bytes"):
        index.find(b"short")
    assert len(index) == 1 and index.find(a) == 1 and index.find(b) == -1


def _records(slots: list[int], seqs: list[int], size: int = 16) -> bytes:
    out = np.zeros((len(slots), size), np.uint8)
    out[:, :4] = np.asarray(slots, "<u4").view(np.uint8).reshape(-1, 4)
    out[:, 4:12] = np.asarray(seqs, "<u8").view(np.uint8).reshape(-1, 8)
    return out.tobytes()


def test_a_bulk_load_indexes_every_record_in_the_order_given_and_names_those_past_the_capacity() -> None:
    rng = random.Random(3)
    keys = [rng.randbytes(KEY) for _ in range(6)]
    index = SlotIndex(8, 16)
    stale = index.load(b"".join(keys), _records([5, 9, 0, 7, 12, 2], [0] * 6), np.array([3, 1, 0, 4, 5, 2], np.int64))
    assert stale == [1, 4]  # positions whose slots (9, 12) lie past the 8 slots
    assert index.oldest(10) == [keys[3], keys[0], keys[5], keys[2]]  # linked in the order given
    assert [index.find(k) for k in keys] == [5, -1, 0, 7, -1, 2]


@pytest.mark.parametrize(
    ("slots", "keys", "error"),
    [([1, 1], [b"a" * KEY, b"b" * KEY], "two records name slot 1"), ([1, 2], [b"a" * KEY] * 2, "one key")],
)
def test_a_bulk_load_refuses_an_index_no_tier_could_have_written(
    slots: list[int], keys: list[bytes], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        SlotIndex(4, 16).load(b"".join(keys), _records(slots, [1, 2]), np.arange(2, dtype=np.int64))


@pytest.mark.parametrize("kind", ["disk", "host"])
def test_lru_over_a_tiers_recency_list_picks_the_victims_of_lru_over_its_own_dict(tmp_path: Path, kind: str) -> None:
    """The same events, in the same order, give the same victims, whichever list the LRU keeps."""
    rng = random.Random(11)
    if kind == "disk":
        tier: DiskTier | HostTier = DiskTier(tmp_path, toy_layout(), 24 * 4096, model_fingerprint="toy-model")
    else:
        tier = HostTier(toy_layout(), 24 * 4096, pin=False)
    try:
        on_tier, own = LRUPolicy(), LRUPolicy()
        on_tier.load([], tier.recency)
        keys = [i.to_bytes(KEY, "little") for i in range(60)]
        for step in range(3000):
            k, op = rng.choice(keys), rng.random()
            if op < 0.35 and not tier.contains(k):
                if tier.free_blocks() == 0:
                    exclude = set(rng.sample(keys, 5))
                    victims = own.victims(3, exclude)
                    assert on_tier.victims(3, exclude) == victims, step
                    for v in victims:
                        own.on_remove(v)
                        on_tier.on_remove(v)
                    tier.remove_many(victims)
                assert tier.put(k, payload(tier.layout, step), record(step, None))
                own.on_insert(k, None)
                on_tier.on_insert(k, None)
            elif op < 0.8:
                own.on_access(k)
                on_tier.on_access(k)
            else:
                assert (k in on_tier) == (k in own) and len(on_tier) == len(own)
        assert on_tier.victims(100) == own.victims(100)
    finally:
        tier.close()


def test_confirm_compares_the_records_last_bytes_without_decoding_them() -> None:
    index = SlotIndex(4, 40)
    record = bytes(8) + b"d" * 32
    index.put(b"k" * KEY, 2, record)
    assert index.confirm(b"k" * KEY, b"d" * 32, 8) == 1
    assert index.confirm(b"k" * KEY, b"d" * 31 + b"e", 8) == 0  # other tokens under the key
    assert index.confirm(b"k" * KEY, b"d" * 31, 8) == 0  # evidence of another length never matches
    assert index.confirm(b"x" * KEY, b"d" * 32, 8) == -1  # absent
    with pytest.raises(ValueError, match="offset"):
        index.confirm(b"k" * KEY, b"d" * 32, 41)


@pytest.mark.parametrize("kind", ["disk", "host"])
def test_a_tiers_confirm_agrees_with_its_record(tmp_path: Path, kind: str) -> None:
    """``Tier.confirm`` is ``record(key).matches(digest)``, answered in C: the lookups' hot path."""
    if kind == "disk":
        tier: DiskTier | HostTier = DiskTier(tmp_path, toy_layout(), 8 * 4096, model_fingerprint="toy-model")
    else:
        tier = HostTier(toy_layout(), 8 * 4096, pin=False)
    try:
        keys = [i.to_bytes(KEY, "little") for i in range(4)]
        for i, k in enumerate(keys[:3]):
            assert tier.put(k, payload(tier.layout, i), record(i, keys[i - 1] if i else None))
        for k in keys:
            for j in range(4):
                held = tier.record(k)
                want = None if held is None else held.matches(record(j).digest)
                assert tier.confirm(k, record(j).digest) is want
    finally:
        tier.close()
