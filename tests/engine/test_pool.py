"""The paged pool's allocator: exact block ids, reference counts, and refusals that leak nothing."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.pool import BlockTable, KVPool, blocks_for
from tests.helpers import as_bytes, payload, toy_layout


def pool(n: int = 4) -> KVPool:
    return KVPool(toy_layout(), n)


def test_blocks_are_handed_out_lowest_first_and_come_back_at_zero_references() -> None:
    p = pool()
    assert p.allocate(2) == [0, 1] and p.num_free == 2
    p.share([1])
    p.free([0, 1])
    assert p.num_free == 3 and p.ref_count(1) == 1  # block 1 is still shared
    p.free([1])
    assert p.num_free == 4 and p.allocate(1) == [1]  # the last freed comes back first


def test_all_or_nothing_allocation_and_misuse_refused() -> None:
    p = pool()
    p.allocate(3)
    with pytest.raises(MemoryError):
        p.allocate(2)
    assert p.num_free == 1  # the failed call took nothing
    with pytest.raises(ValueError, match="free"):
        p.share([3])
    with pytest.raises(ValueError, match="twice"):
        p.free([3])
    with pytest.raises(ValueError):
        KVPool(toy_layout(), 0)


def test_tables_grow_by_whole_blocks_and_release_everything() -> None:
    p = pool()
    table = BlockTable()
    assert p.blocks_needed(table, 9) == blocks_for(9, 4) == 3
    p.grow(table, 9)
    assert table.block_ids == [0, 1, 2] and table.capacity(4) == 12
    p.grow(table, 12)
    assert table.block_ids == [0, 1, 2]  # already holds 12 positions
    table.num_tokens = 9
    p.release(table)
    assert (table.block_ids, table.num_tokens, p.num_free) == ([], 0, 4)


def test_a_payload_round_trips_through_a_pool_block() -> None:
    p = pool()
    (block,) = p.allocate(1)
    data = payload(p.layout, seed=3)
    p.write_block_from_payload(block, as_bytes(data))
    out = torch.empty(p.layout.block_bytes, dtype=torch.uint8)
    p.read_block_to_payload(block, out)
    assert torch.equal(out, as_bytes(data))
