from __future__ import annotations

import pytest
import torch

from kvtier.keys import BlockKey
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.host import HostTier
from tests.helpers import as_bytes, payload, record, toy_layout


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def rec(i: int) -> BlockRecord:
    return record(i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    layout = toy_layout(dtype)
    tier = HostTier(layout, 8 * 4096)
    blocks = [payload(layout, i) for i in range(5)]
    assert tier.put_many([key(i) for i in range(5)], blocks, [rec(i) for i in range(5)]) == [True] * 5
    for i, block in enumerate(blocks):
        out = torch.empty(layout.block_bytes, dtype=torch.uint8)
        assert tier.get(key(i), out)
        assert torch.equal(out, as_bytes(block))
        assert torch.equal(layout.as_blocks(out), block)


def test_capacity_is_never_exceeded() -> None:
    layout = toy_layout()
    tier = HostTier(layout, 3 * 4096 + 100)
    assert tier.capacity_blocks == 3 and tier.capacity_bytes == 3 * 4096
    results = [tier.put(key(i), payload(layout, i), rec(i)) for i in range(5)]
    assert results == [True, True, True, False, False]
    assert tier.used_bytes == tier.capacity_bytes and len(tier) == 3
    assert tier.stats.rejected_stores == 2
    assert tier.remove(key(1)) and tier.put(key(4), payload(layout, 4), rec(4))
    assert len(tier) == 3


def test_colliding_key_keeps_the_first_block() -> None:
    layout = toy_layout()
    tier = HostTier(layout, 4 * 4096)
    assert tier.put(key(0), payload(layout, 0), rec(0))
    assert tier.put(key(0), payload(layout, 0), rec(0))  # same tokens: a no-op success
    assert not tier.put(key(0), payload(layout, 1), rec(9))  # other tokens: refused
    out = torch.empty(layout.block_bytes, dtype=torch.uint8)
    assert tier.get(key(0), out) and torch.equal(out, as_bytes(payload(layout, 0)))


def test_reserved_slot_is_invisible_until_commit_and_abort_frees_it() -> None:
    layout = toy_layout()
    tier = HostTier(layout, 2 * 4096)
    buf = tier.reserve(key(0), rec(0))
    assert buf is not None and not tier.contains(key(0)) and tier.free_blocks() == 1
    tier.abort(key(0))
    assert tier.free_blocks() == 2 and not tier.contains(key(0))
    buf = tier.reserve(key(1), rec(1))
    assert buf is not None
    buf.copy_(as_bytes(payload(layout, 1)))
    tier.commit(key(1))
    assert tier.contains(key(1)) and tier.record(key(1)).matches(rec(1).digest)


def test_too_small_capacity_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        HostTier(toy_layout(), 100)


def test_cpu_slab_is_page_aligned_so_direct_reads_need_no_bounce() -> None:
    tier = HostTier(toy_layout(), 4 * 4096, pin=False)
    assert tier._slab.data_ptr() % 4096 == 0 and tier.slot_bytes % 4096 == 0


def test_large_batches_split_over_two_copy_threads_stay_bit_exact() -> None:
    layout = toy_layout(torch.bfloat16)
    tier = HostTier(layout, 64 * 4096)
    blocks = [payload(layout, i) for i in range(40)]
    tier.put_many([key(i) for i in range(40)], blocks, [rec(i) for i in range(40)])
    outs = [torch.empty(layout.block_bytes, dtype=torch.uint8) for _ in range(41)]
    found = tier.get_many([key(i) for i in range(40)] + [key(99)], outs)
    assert found == [True] * 40 + [False]
    assert all(torch.equal(o, as_bytes(b)) for o, b in zip(outs, blocks, strict=False))
    assert tier.stats.bytes_read == 40 * layout.block_bytes
    tier.close()


def test_entries_list_committed_blocks_in_store_order_with_their_records() -> None:
    """The index keeps no Python objects per block: records come back decoded, parents and all, oldest first."""
    tier = HostTier(toy_layout(), 8 * 4096, pin=False)
    layout = tier.layout
    order = [5, 1, 9, 3]
    for i in order:
        assert tier.put(key(i), payload(layout, i), record(i, key(i - 1) if i % 2 else None))
    late = tier.reserve(key(7), rec(7))  # reserved, not committed: not an entry
    assert late is not None
    assert tier.remove(key(9)) and not tier.contains(key(9))
    assert tier.put(key(9), payload(layout, 90), rec(90))  # stored again: now the newest
    assert list(tier.entries()) == [
        (key(5), record(5, key(4))),
        (key(1), record(1, key(0))),
        (key(3), record(3, key(2))),
        (key(9), rec(90)),
    ]
    assert tier.record(key(7)) is None and tier.record(key(1)) == record(1, key(0))
    tier.abort(key(7))
    assert (len(tier), tier.free_blocks()) == (4, 4)


def test_a_record_the_index_cannot_hold_is_refused_before_a_slot_is_taken() -> None:
    tier = HostTier(toy_layout(), 2 * 4096, pin=False)
    with pytest.raises(ValueError, match="digest"):
        tier.reserve(key(0), BlockRecord(b"short", None))  # type: ignore[arg-type]
    assert (len(tier), tier.free_blocks()) == (0, 2)
