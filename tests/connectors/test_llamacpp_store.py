"""Saved states found by their longest block prefix, over a real CacheManager (host and disk tiers), no llama.cpp."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import WriteMode
from kvtier.connectors.llamacpp_format import pack_state
from kvtier.connectors.llamacpp_store import GENERATIONS, Kind, SaveOutcome, StateStore, mark_name, state_name
from kvtier.keys import KeyHasher, Secret
from kvtier.manager import CacheManager
from kvtier.tiers.base import TierKind
from tests.connectors.test_llamacpp_format import FakeState
from tests.helpers import BLOCK, make_config, toy_layout

LAYOUT = toy_layout()  # 4-token blocks of 1,536 B: a chunk per block
TOKEN_BYTES = LAYOUT.block_bytes // BLOCK


def open_manager(tmp: Path, write_mode: WriteMode = WriteMode.WRITE_BACK) -> CacheManager:
    cfg = make_config(
        tmp,
        host={"capacity_bytes": 128 * 4096},
        disk={"capacity_bytes": 512 * 4096},
        cache={"write_mode": write_mode},
    )
    return CacheManager(cfg, LAYOUT, model_fingerprint="toy-model")


def store_over(m: CacheManager, mark_every: int = 4) -> StateStore:
    hasher = KeyHasher(
        Secret(b"n" * 32), model_fingerprint="toy-model", layout_descriptor=LAYOUT.descriptor, block_size=BLOCK
    )
    return StateStore(
        m, hasher, "default", chunk_bytes=LAYOUT.block_bytes, token_bytes=TOKEN_BYTES, mark_every=mark_every
    )


@pytest.fixture
def m(tmp_path: Path) -> Iterator[CacheManager]:
    with open_manager(tmp_path) as manager:
        yield manager


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 49152, size=n).astype(np.int32)


def state_for(ids: np.ndarray, seed: int = 0) -> FakeState:
    """A state whose KV covers ``ids``: as large as llama.cpp's would be, bytes that name ``seed``."""
    n_ctx = 256
    buf = np.zeros(n_ctx, dtype=np.intc)
    buf[: len(ids)] = ids
    size = len(ids) * TOKEN_BYTES + 300
    blob = np.random.default_rng(seed).bytes(size)
    return FakeState(buf, np.zeros((min(len(ids), 8), 16), np.single), len(ids), blob, size, 7)


def save(store: StateStore, ids: np.ndarray, seed: int = 0, prompt_tokens: int = 0) -> SaveOutcome:
    payload = pack_state(state_for(ids, seed), LAYOUT.block_bytes, keep_scores=False)
    return store.save(ids, payload, prompt_tokens).outcome


def found_seed(store: StateStore, query: np.ndarray) -> tuple[int, int, Kind] | None:
    """Which saved state a query finds: (the seed its bytes name, blocks it covers, how it was reached)."""
    found = store.find(query)
    if found is None:
        return None
    n = found.state.header.n_tokens
    for seed in range(10):
        if bytes(found.state.llama_state) == state_for(found.state.input_ids, seed).llama_state:
            assert np.array_equal(found.state.input_ids[:n], found.state.input_ids)
            return seed, found.blocks, found.kind
    raise AssertionError("found bytes that no saved state had")


def test_a_saved_state_is_found_by_itself_and_by_any_extension(m: CacheManager) -> None:
    store = store_over(m, mark_every=100)
    ids = tokens(10 * BLOCK + 3)
    assert save(store, ids) is SaveOutcome.STORED
    assert found_seed(store, ids) == (0, 10, Kind.STATE)
    assert found_seed(store, np.concatenate([ids, tokens(50, seed=9)])) == (0, 10, Kind.STATE)
    assert found_seed(store, tokens(10 * BLOCK + 3, seed=5)) is None
    assert found_seed(store, ids[: 10 * BLOCK - 1]) is None  # ends before the state's last block, no marker there
    assert store.find(ids[:3]) is None  # not one full block


def test_a_query_that_leaves_a_state_inside_finds_it_by_a_marker(m: CacheManager) -> None:
    store = store_over(m, mark_every=4)
    prompt = tokens(6 * BLOCK + 2)
    ids = np.concatenate([prompt, tokens(5 * BLOCK, seed=1)])  # the prompt, then its completion
    assert save(store, ids, prompt_tokens=len(prompt)) is SaveOutcome.STORED
    other_question = np.concatenate([prompt, tokens(9, seed=2)])
    assert found_seed(store, other_question) == (0, 6, Kind.MARK)  # the prompt's end: every full prompt block
    diverged = np.concatenate([ids[: 9 * BLOCK + 1], tokens(20, seed=3)])
    assert found_seed(store, diverged) == (0, 8, Kind.MARK)  # the marker every 4 blocks before the divergence
    assert found_seed(store, ids[: 3 * BLOCK + 1]) is None  # before the first marker


def test_the_longest_prefix_wins_among_states_sharing_one(m: CacheManager) -> None:
    store = store_over(m, mark_every=100)
    base = tokens(4 * BLOCK)
    short = np.concatenate([base, tokens(BLOCK, seed=1)])
    long = np.concatenate([base, tokens(8 * BLOCK, seed=2)])
    assert save(store, short, seed=1) is SaveOutcome.STORED
    assert save(store, long, seed=2, prompt_tokens=len(base)) is SaveOutcome.STORED
    assert found_seed(store, np.concatenate([long, tokens(3, seed=4)])) == (2, 12, Kind.STATE)
    assert found_seed(store, np.concatenate([short, tokens(30, seed=4)])) == (1, 5, Kind.STATE)
    assert found_seed(store, np.concatenate([base, tokens(30, seed=5)])) == (2, 4, Kind.MARK)


def test_saving_a_state_held_whole_writes_nothing(m: CacheManager) -> None:
    store = store_over(m)
    ids = tokens(9 * BLOCK)
    assert save(store, ids) is SaveOutcome.STORED
    blocks = m.stats().tiers["host"].blocks
    assert save(store, ids, seed=3) is SaveOutcome.HELD  # the same position: the first state serves it
    assert m.stats().tiers["host"].blocks == blocks
    assert save(store, ids[:3]) is SaveOutcome.TOO_SHORT


def test_a_state_that_lost_a_chunk_is_a_miss_and_is_saved_again_beside_it(m: CacheManager) -> None:
    store = store_over(m, mark_every=100)
    ids = tokens(8 * BLOCK)
    save(store, ids)
    position = store.positions(ids)[-1]
    lost = m.hasher.named(state_name(position, 0, 3), "default")
    m.host.remove_many([lost])  # evicted on its own
    assert found_seed(store, ids) is None
    assert save(store, ids, seed=4) is SaveOutcome.STORED  # generation 1: the damaged one stays write-once
    assert m.named_exists([state_name(position, 1, 0)], "default") == [True]
    assert found_seed(store, ids) == (4, 8, Kind.STATE)


def test_a_marker_never_leads_to_a_later_write_in_its_states_place(m: CacheManager) -> None:
    store = store_over(m, mark_every=100)
    prompt = tokens(4 * BLOCK)
    ids = np.concatenate([prompt, tokens(4 * BLOCK, seed=1)])
    save(store, ids, prompt_tokens=len(prompt))
    position = store.positions(ids)[-1]
    for i in range(8):  # the state is gone whole; another one lands in its generation
        m.host.remove_many([m.hasher.named(state_name(position, 0, i), "default")])
    assert save(store, ids, seed=5) is SaveOutcome.STORED
    assert m.named_exists([mark_name(store.positions(ids)[3], 0)], "default") == [True]
    query = np.concatenate([prompt, tokens(9, seed=6)])
    assert found_seed(store, query) is None  # the marker's tag is the first state's


def test_every_generation_taken_is_no_room(m: CacheManager) -> None:
    store = store_over(m, mark_every=100)
    ids = tokens(4 * BLOCK)
    position = store.positions(ids)[-1]
    for g in range(GENERATIONS):
        save(store, ids, seed=g)
        m.host.remove_many([m.hasher.named(state_name(position, g, 2), "default")])
    assert save(store, ids) is SaveOutcome.NO_ROOM
    assert found_seed(store, ids) is None


def test_states_come_back_after_a_restart_and_a_corrupt_chunk_is_a_miss(tmp_path: Path) -> None:
    ids = tokens(8 * BLOCK + 1)
    with open_manager(tmp_path, WriteMode.WRITE_THROUGH) as m:
        save(store_over(m), ids, seed=6)
        key = m.hasher.named(state_name(store_over(m).positions(ids)[-1], 0, 5), "default")
        path, offset = m.disk.slab_path(m.disk.slot_of(key))
    with open_manager(tmp_path) as m:
        assert found_seed(store_over(m), ids) == (6, 8, Kind.STATE)
        assert m.stats().tiers["disk"].blocks > 0
    with open(path, "r+b") as f:
        f.seek(offset + 200)
        byte = f.read(1)
        f.seek(offset + 200)
        f.write(bytes([byte[0] ^ 0x10]))
    with open_manager(tmp_path) as m:
        m.clear(TierKind.HOST)
        store = store_over(m)
        assert found_seed(store, ids) is None
        assert m.stats().tiers["disk"].checksum_failures == 1
        assert save(store, ids, seed=7) is SaveOutcome.STORED
        assert found_seed(store, ids) == (7, 8, Kind.STATE)


def test_a_state_larger_than_the_host_tier_loads_a_piece_at_a_time(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, host={"capacity_bytes": 16 * 4096}, disk={"capacity_bytes": 256 * 4096})
    with CacheManager(cfg, LAYOUT, model_fingerprint="toy-model") as m:
        ids = tokens(40 * BLOCK)  # 41 chunks: more than the host tier holds at once
        assert save(store_over(m, mark_every=100), ids, seed=8) is SaveOutcome.STORED
        assert found_seed(store_over(m, mark_every=100), ids) is None  # all pinned at once: it cannot fit
        store = store_over(m, mark_every=100)
        store.max_pinned = m.load_chunk
        assert found_seed(store, ids) == (8, 40, Kind.STATE)
        assert m.stats().pinned_blocks == 0
