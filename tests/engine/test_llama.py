"""The built-in Llama engine against transformers (the oracle), and the paged pool under it.

The engine runs kvtier's own GGUF loading (``loaded_model``); the reference is
transformers loading the same file (``hf_model``), each loaded once per test
session. Pool tests use toy shapes and need no model.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import BlockTable, KVPool, LlamaModel, SeqInput
from kvtier.layout import KVLayout
from kvtier.model import default_gguf_path, load_gguf

BLOCK = 16
PROMPT = [
    16086, 19861, 24778, 45212, 5947, 31383, 10361, 2294, 12004, 10280,
    17668, 38992, 12152, 10800, 15161, 26530, 48576, 17365, 3219, 29790,
    31704, 32614, 3734, 46164, 8650, 45158, 47057, 24007, 4113, 27782,
    17040, 5242, 1716, 20749, 29767, 18207, 48693, 15776, 42293, 32069,
]  # fmt: skip
OTHER = [101, 2025, 7, 3094, 48000, 12, 555, 9999, 31, 1200, 640, 17, 22222, 3, 88, 4096, 700, 19, 33, 12345, 6, 808]


@pytest.fixture(scope="module")
def ref(hf_model):
    return hf_model


@pytest.fixture(scope="module")
def model(loaded_model) -> LlamaModel:
    return loaded_model.model


@pytest.fixture(scope="module")
def ref_logits(ref) -> torch.Tensor:
    with torch.inference_mode():
        return ref(torch.tensor([PROMPT])).logits[0]


@pytest.fixture
def pool(model: LlamaModel) -> KVPool:
    return model.make_pool(BLOCK, 16)


def prefill(model: LlamaModel, pool: KVPool, ids: list[int], table: BlockTable | None = None) -> list[torch.Tensor]:
    table = table if table is not None else BlockTable()
    pool.grow(table, table.num_tokens + len(ids))
    return model.forward_all([SeqInput(ids, table.num_tokens, table)], pool)


# -- the model against the oracle ----------------------------------------------
def test_logits_match_transformers_at_every_position(model, pool, ref_logits) -> None:
    table = BlockTable()
    (got,) = prefill(model, pool, PROMPT, table)
    assert got.shape == ref_logits.shape
    assert (got - ref_logits).abs().max().item() < 2e-4
    assert table.num_tokens == len(PROMPT) and len(table.block_ids) == 3


def test_forward_returns_the_last_positions_logits(model, pool, ref_logits) -> None:
    table = BlockTable()
    pool.grow(table, len(PROMPT))
    last = model.forward([SeqInput(PROMPT, 0, table)], pool)
    assert last.shape == (1, model.config.vocab_size)
    assert (last[0] - ref_logits[-1]).abs().max().item() < 2e-4


def test_greedy_decoding_through_the_pool_matches_generate(model, pool, ref) -> None:
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    want = want[0, len(PROMPT) :].tolist()
    table = BlockTable()
    pool.grow(table, len(PROMPT))
    token = int(model.forward([SeqInput(PROMPT, 0, table)], pool).argmax())
    got = [token]
    while len(got) < 30:
        pool.grow(table, table.num_tokens + 1)
        token = int(model.forward([SeqInput([token], table.num_tokens, table)], pool).argmax())
        got.append(token)
    assert got[: len(want)] == want  # generate stops early only at EOS
    assert len(want) == 30 or want[-1] == model.config.eos_token_id


# -- prefix reuse ----------------------------------------------------------------
@pytest.mark.parametrize("reuse", ["share", "copy"])
def test_prefill_on_a_reused_prefix_equals_the_full_prefill(model, pool, ref_logits, reuse) -> None:
    first = BlockTable()
    prefill(model, pool, PROMPT[:32], first)
    prefix = BlockTable(num_tokens=32)
    if reuse == "share":  # the blocks themselves, ref-counted
        pool.share(first.block_ids)
        prefix.block_ids = list(first.block_ids)
    else:  # through kvtier's payload bytes, as a host/disk hit arrives
        prefix.block_ids = pool.allocate(2)
        buf = torch.empty(pool.layout.block_bytes, dtype=torch.uint8)
        for src, dst in zip(first.block_ids, prefix.block_ids, strict=True):
            pool.read_block_to_payload(src, buf)
            pool.write_block_from_payload(dst, buf)
    (tail,) = prefill(model, pool, PROMPT[32:], prefix)
    assert (tail - ref_logits[32:]).abs().max().item() < 1e-4
    if reuse == "share":
        assert prefix.block_ids[:2] == first.block_ids and pool.ref_count(first.block_ids[0]) == 2


def test_chunked_prefill_equals_one_prefill(model, pool, ref_logits) -> None:
    """Chunks that end inside a block: the next chunk writes into the same block at an offset."""
    table = BlockTable()
    chunks = [prefill(model, pool, PROMPT[a:b], table)[0] for a, b in ((0, 7), (7, 25), (25, 40))]
    assert (torch.cat(chunks) - ref_logits).abs().max().item() < 1e-4


# -- batching ----------------------------------------------------------------------
def test_batched_decode_equals_each_sequence_alone(model, pool) -> None:
    a, b = BlockTable(), BlockTable()
    prefill(model, pool, PROMPT, a)
    prefill(model, pool, OTHER, b)
    steps = [SeqInput([7], len(PROMPT), a), SeqInput([300], len(OTHER), b)]
    for s in steps:
        pool.grow(s.table, s.start + 1)
    alone = []
    for s in steps:
        alone.append(model.forward([s], pool)[0])
        s.table.num_tokens = s.start  # rewind: the batched step rewrites the same slot with the same K/V
    together = model.forward(steps, pool)
    assert (together - torch.stack(alone)).abs().max().item() < 1e-4
    assert (a.num_tokens, b.num_tokens) == (len(PROMPT) + 1, len(OTHER) + 1)


def test_mixed_batch_of_prefill_and_decode_equals_each_alone(model, pool, ref_logits) -> None:
    a, b = BlockTable(), BlockTable()
    prefill(model, pool, PROMPT[:39], a)
    pool.grow(a, 40)
    pool.grow(b, len(OTHER))
    alone_b = model.forward_all([SeqInput(OTHER, 0, BlockTable(pool.allocate(2)))], pool)[0]
    got_a, got_b = model.forward_all([SeqInput(PROMPT[39:], 39, a), SeqInput(OTHER, 0, b)], pool)
    assert (got_a[0] - ref_logits[39]).abs().max().item() < 1e-4
    assert (got_b - alone_b).abs().max().item() < 1e-4


def test_forward_refuses_a_start_that_is_not_the_tables_length(model, pool) -> None:
    table = BlockTable()
    pool.grow(table, 8)
    with pytest.raises(ValueError, match="table holds 0"):
        model.forward([SeqInput([1, 2], 3, table)], pool)
    with pytest.raises(ValueError, match="block table holds 16"):
        model.forward([SeqInput(list(range(20)), 0, table)], pool)


def test_bfloat16_stays_close_to_the_float32_reference(ref_logits) -> None:
    config, weights, _ = load_gguf(default_gguf_path(), torch.bfloat16, progress=False)
    model = LlamaModel(config, weights, dtype=torch.bfloat16)
    pool = model.make_pool(BLOCK, 4)
    assert pool.kv.dtype == torch.bfloat16
    (got,) = prefill(model, pool, PROMPT)
    agree = (got.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    assert agree >= 0.8


# -- the pool, toy shapes ---------------------------------------------------------------
def toy_pool(num_blocks: int = 6, dtype: torch.dtype = torch.float32) -> KVPool:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype=dtype)
    pool = KVPool(layout, num_blocks)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_payload_round_trip_is_bit_exact(dtype) -> None:
    pool = toy_pool(dtype=dtype)
    out = torch.empty(pool.layout.block_bytes, dtype=torch.uint8)
    pool.read_block_to_payload(3, out)
    blocks = pool.layout.as_blocks(out)
    for layer in range(3):  # payload layer l is exactly pool.layers[l][block]
        assert torch.equal(blocks[layer], pool.layers[layer][3])
    pool.write_block_from_payload(5, out)
    assert torch.equal(pool.kv[:, 5], pool.kv[:, 3])
    again = torch.empty_like(out)
    pool.read_block_to_payload(5, again)
    assert torch.equal(again, out)
    with pytest.raises(ValueError, match="uint8"):
        pool.write_block_from_payload(0, out[:-1])


def test_allocator_hands_out_low_ids_first_and_counts_references() -> None:
    pool = toy_pool(num_blocks=4)
    assert pool.allocate(2) == [0, 1]
    pool.share([1])
    pool.free([0, 1])
    assert pool.num_free == 3 and pool.ref_count(1) == 1
    with pytest.raises(MemoryError):
        pool.allocate(4)
    assert pool.num_free == 3  # all or nothing
    pool.free([1])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([1])
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]


def test_a_shared_block_is_read_only() -> None:
    pool = toy_pool()
    owner = BlockTable(pool.allocate(2), num_tokens=6)  # block 1 half full
    pool.share(owner.block_ids)
    k = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="shared blocks \\[1\\]"):
        pool.slots(owner, 6, 1)
    pool.free(owner.block_ids[1:])
    pool.write(0, pool.slots(owner, 6, 1), k, k)  # sole holder again: writable


def test_write_scatters_across_blocks_and_gather_reads_back_in_order() -> None:
    pool = toy_pool()
    lay = pool.layout
    table = BlockTable(block_ids=[4, 1, 2])  # deliberately out of order
    k = torch.arange(10 * 2 * 4, dtype=torch.float32).view(10, 2, 4)  # positions 1..10, [N, heads, dim]
    pool.write(1, pool.slots(table, 1, 10), k, -k)
    assert torch.equal(pool.layers[1][4, 0, :, 1], k[0]) and torch.equal(pool.layers[1][2, 1, :, 2], -k[9])
    other = BlockTable(block_ids=[0])
    plan = pool.plan_gather([table, other], [11, 3])
    keys, values = pool.gather(1, plan)
    assert keys.shape == (2, lay.num_kv_heads, 3 * lay.block_size, lay.head_dim)
    assert torch.equal(keys[0, :, 1:11], k.transpose(0, 1)) and torch.equal(values[0, :, 1:11], -k.transpose(0, 1))
    assert torch.equal(keys[1, :, :4], pool.layers[1][0, 0])
