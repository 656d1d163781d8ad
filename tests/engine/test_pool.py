"""The paged pool's allocator: exact block ids, reference counts, and refusals that leak nothing."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.pool import BlockTable, KVPool, blocks_for
from kvtier.transfer import TransferWorker
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


def fill_blocks(p: KVPool, seeds: list[int]) -> list[torch.Tensor]:
    data = [as_bytes(payload(p.layout, seed)) for seed in seeds]
    for block, d in enumerate(data):
        p.write_block_from_payload(block, d)
    return data


def test_gathered_payloads_are_the_blocks_as_stored_in_any_order() -> None:
    """The GPU store path's one gather (run on the CPU): row j holds block ids[j], byte for byte."""
    p = pool(6)
    data = fill_blocks(p, [10, 11, 12, 13, 14, 15])
    ids = [4, 0, 5, 2]
    got = p.gather_payloads(ids)
    assert got.shape == (4, p.layout.block_bytes) and got.dtype == torch.uint8
    for j, block in enumerate(ids):
        assert torch.equal(got[j], data[block])


def test_a_cpu_payload_reader_copies_each_block_out_of_the_pool() -> None:
    p = pool(4)
    data = fill_blocks(p, [20, 21, 22, 23])
    read = p.payload_reader([3, 1])
    out = torch.empty(2, p.layout.block_bytes, dtype=torch.uint8)
    read(1, out[1])
    read(0, out[0])
    assert torch.equal(out[0], data[3]) and torch.equal(out[1], data[1])


@pytest.mark.cuda
def test_a_gpu_payload_reader_copies_out_on_another_thread_after_later_writes_are_queued() -> None:
    """The gather is ordered after the writes before it; reads on a transfer worker's stream see exactly those bytes."""
    layout = toy_layout()
    p = KVPool(layout, 6, device="cuda")
    data = [as_bytes(payload(layout, seed)) for seed in range(6)]
    for block, d in enumerate(data):
        p.write_block_from_payload(block, d.cuda())
    read = p.payload_reader([5, 2, 0])
    p.kv.zero_()  # queued after the gather: the reads must not see it
    outs = [torch.empty(layout.block_bytes, dtype=torch.uint8).pin_memory() for _ in range(3)]
    worker = TransferWorker(1)
    worker.wait(worker.submit(lambda: [read(j, out) for j, out in enumerate(outs)]))
    worker.shutdown()
    for out, block in zip(outs, [5, 2, 0], strict=True):
        assert torch.equal(out, data[block])
