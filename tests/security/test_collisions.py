"""Forced key collisions at scale: 10,000 prompts whose block keys have 4 bits, and not one foreign byte served.

With :func:`kvtier.keys.truncated_xxh3_128` every block key is one of 16
values, so nearly every prompt finds "its" key already taken by another
prompt's block. The only thing between that prompt and foreign KV is the
confirmation in :mod:`kvtier.index` (the stored token digest must equal the
request's). Every block's payload is filled with a number naming its prompt
and position, so a foreign block shows as a wrong number, counted byte by byte.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.config import WriteMode
from kvtier.keys import KeyHasher, truncated_xxh3_128
from kvtier.manager import CacheManager
from kvtier.service import CacheClient, CacheService
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, as_bytes, make_config, make_hasher, toy_layout

PROMPTS = 10_000
SERVICE_PROMPTS = 1_000
BLOCKS = 2  # per prompt: block 1 is reached only through a confirmed block 0
BITS = 4
CLEAR_EVERY = 500  # a cleared cache gives the keys new owners, so many prompts own a key at some point


def colliding(tmp: Path) -> KeyHasher:
    return make_hasher(tmp, toy_layout(), hash128=truncated_xxh3_128(BITS))


def prompts(n: int, seed: int) -> np.ndarray:
    """``n`` distinct prompts of ``BLOCKS`` full blocks (distinct: row ``i`` starts with ``i``)."""
    rows = np.random.default_rng(seed).integers(0, 49152, size=(n, BLOCKS * BLOCK), dtype=np.int32)
    rows[:, 0] = np.arange(n, dtype=np.int32)
    return rows


def own_kv(i: int) -> list[torch.Tensor]:
    """Prompt ``i``'s blocks: block ``j`` holds the number ``BLOCKS * i + j + 1`` in every element."""
    shape = toy_layout().block_shape
    return [torch.full(shape, float(BLOCKS * i + j + 1)) for j in range(BLOCKS)]


def foreign_bytes(i: int, blocks: list[torch.Tensor]) -> int:
    """Bytes of ``blocks`` that are not prompt ``i``'s own (0 for a correct load of any length)."""
    return sum(int((b != as_bytes(w)).sum()) for b, w in zip(blocks, own_kv(i), strict=False))


class Tally:
    def __init__(self) -> None:
        self.foreign = 0
        self.served_blocks = 0

    def check(self, i: int, blocks: list[torch.Tensor]) -> None:
        self.foreign += foreign_bytes(i, blocks)
        self.served_blocks += len(blocks)


def test_the_hook_collides_and_is_never_the_default(tmp_path: Path) -> None:
    keys = {bytes(colliding(tmp_path).keys(p, "default")[0]) for p in prompts(200, seed=1)}
    assert len(keys) <= 2**BITS
    assert all(int.from_bytes(k, "big") < 2**BITS for k in keys)
    assert make_hasher(tmp_path, toy_layout())._hash is not colliding(tmp_path)._hash


def test_ten_thousand_colliding_prompts_serve_no_foreign_byte_from_host_or_disk(tmp_path: Path) -> None:
    """Host holds 4 blocks, disk 64: most keys live on disk only, so both tiers must confirm (write-through)."""
    cfg = make_config(
        tmp_path,
        host={"capacity_bytes": 4 * 4096},
        disk={"capacity_bytes": 64 * 4096},
        cache={"write_mode": WriteMode.WRITE_THROUGH},
    )
    rows = prompts(PROMPTS, seed=2)
    tally = Tally()
    owners: list[int] = []
    with CacheManager(cfg, toy_layout(), model_fingerprint="toy-model", hasher=colliding(tmp_path)) as m:
        for i in range(PROMPTS):
            if i % CLEAR_EVERY == 0:
                m.clear()
                owners.clear()
            for j in (i, *owners[i % 7 : i % 7 + 1]):  # this prompt, then one that owns its keys (host or disk)
                with m.load(m.lookup(m.keyed(rows[j]))) as handle:
                    tally.check(j, [b.clone() for b in handle.blocks])
            if m.store(m.keyed(rows[i]), own_kv(i)) == BLOCKS:
                owners.append(i)
        stats = m.stats()
    assert tally.foreign == 0
    assert tally.served_blocks > 1000  # owners were served their own blocks: the check is not vacuous
    assert stats.tiers["host"].confirm_mismatches > 1000 and stats.tiers["disk"].confirm_mismatches > 1000
    assert stats.tiers["host"].hit_tokens > 0 and stats.tiers["disk"].hit_tokens > 0  # served from both tiers
    assert stats.pinned_blocks == 0


@pytest.fixture
def colliding_service(tmp_path: Path) -> Iterator[CacheService]:
    cfg = make_config(tmp_path, host={"capacity_bytes": 8 * 4096}, disk={"capacity_bytes": 64 * 4096})
    svc = CacheService(
        cfg,
        toy_layout(),
        model_fingerprint="toy-model",
        socket_path=tmp_path / "cache.sock",
        slab_dir=tmp_path,
        hasher=colliding(tmp_path),
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    yield svc
    svc.close()
    thread.join(timeout=30)


def test_colliding_prompts_through_the_cache_service_serve_no_foreign_byte(colliding_service: CacheService) -> None:
    """The same, through the socket and the shared slab another engine process would map."""
    rows = prompts(SERVICE_PROMPTS, seed=3)
    tally = Tally()
    owners: list[int] = []
    with CacheClient(colliding_service.socket_path, toy_layout(), model_fingerprint="toy-model") as c:
        for i in range(SERVICE_PROMPTS):
            if i % CLEAR_EVERY == 0:
                c.clear()
                owners.clear()
            for j in (i, *owners[i % 7 : i % 7 + 1]):
                with c.load(rows[j], "default") as load:
                    tally.check(j, [b.clone() for b in load.blocks])
            if c.store(rows[i], own_kv(i), "default") == BLOCKS:
                owners.append(i)
        stats = c.stats()
    assert tally.foreign == 0
    assert tally.served_blocks > 100
    assert stats.tiers["host"].confirm_mismatches + stats.tiers["disk"].confirm_mismatches > 100


@pytest.mark.parametrize("replaced", [TierKind.HOST, TierKind.DISK])
def test_a_key_that_changes_hands_between_lookup_and_fetch_is_a_miss(tmp_path: Path, replaced: TierKind) -> None:
    """Prompt A's block 0 is confirmed on disk; before the fetch pins it, the key goes to prompt B's block
    (in host, or on disk). The fetch must stop there: B's bytes are never served as A's.

    The race the service test above found under load (a host eviction inside the fetch freed the key).
    """
    cfg = make_config(tmp_path, cache={"write_mode": WriteMode.WRITE_THROUGH})
    with CacheManager(cfg, toy_layout(), model_fingerprint="toy-model", hasher=colliding(tmp_path)) as m:
        rows = prompts(64, seed=4)
        keys = [[bytes(k) for k in m.keyed(r).keys] for r in rows]
        whole = [i for i in range(64) if len(set(keys[i])) == BLOCKS]  # 16 keys: a prompt's own blocks may share one
        a, b = next((i, j) for i in whole for j in whole if i < j and keys[i][0] == keys[j][0])
        prompt_a, prompt_b = m.keyed(rows[a]), m.keyed(rows[b])
        assert m.store(prompt_a, own_kv(a)) == BLOCKS
        m.clear(TierKind.HOST)
        result = m.lookup(prompt_a)
        assert result.cached_blocks == BLOCKS and set(result.tiers) == {TierKind.DISK}
        m.clear(TierKind.DISK)
        assert m.store(prompt_b, own_kv(b)) >= 1  # B's block 0 now holds the key, written through to disk
        if replaced is TierKind.DISK:
            m.clear(TierKind.HOST)
        with m.fetch(result).take() as handle:
            assert foreign_bytes(a, [bl.clone() for bl in handle.blocks]) == 0
            assert len(handle.blocks) == 0  # block 0 is B's now: nothing of A's run is left to serve
