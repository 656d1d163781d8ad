"""Block mapping between an engine's paged pool and kvtier blocks (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from kvtier.connectors.paged import BlockMap, PagedKV, segments
from kvtier.layout import KVLayout, LayoutOrder

L, H, D = 3, 2, 4


def layout(kv_block: int) -> KVLayout:
    return KVLayout(L, H, D, kv_block, torch.float32, LayoutOrder.HEAD_MAJOR)


def pool(num_blocks: int, engine_block: int) -> list[torch.Tensor]:
    """Each element encodes (layer, block, head, K|V, token, dim), so a misplaced row cannot go unseen."""
    b, h, kv, t, d = torch.meshgrid(
        torch.arange(num_blocks),
        torch.arange(H),
        torch.arange(2),
        torch.arange(engine_block),
        torch.arange(D),
        indexing="ij",
    )
    base = (b * 1000 + h * 100 + kv * 10 + d).float() + t.float() / 1000
    return [(base + layer * 100_000).reshape(num_blocks, H, engine_block, 2 * D).contiguous() for layer in range(L)]


def token_row(kv: list[torch.Tensor], table: list[int], engine_block: int, token: int) -> torch.Tensor:
    """``[layers, heads, K|V, head_dim]`` of one request token, read from the pool by hand."""
    slot, off = table[token // engine_block], token % engine_block
    return torch.stack([t.view(t.shape[0], H, 2, engine_block, D)[slot, :, :, off] for t in kv])


@pytest.mark.parametrize(("kv_block", "engine_block"), [(16, 128), (128, 128), (256, 128), (48, 32)])
def test_segments_tile_the_range_inside_both_blocks(kv_block: int, engine_block: int) -> None:
    segs = segments(96, 700, kv_block, engine_block)
    t = 96
    for s in segs:
        assert s.kv_block * kv_block + s.kv_offset == t == s.engine_block * engine_block + s.engine_offset
        assert s.tokens > 0 and s.kv_offset + s.tokens <= kv_block and s.engine_offset + s.tokens <= engine_block
        t += s.tokens
    assert t == 700


def test_loadable_whole_engine_blocks_never_the_last_token() -> None:
    m = BlockMap(kv_block=16, engine_block=128)
    assert m.loadable(cached_blocks=12, prompt_tokens=1000) == 128  # 192 cached tokens: one whole engine block
    assert m.loadable(cached_blocks=64, prompt_tokens=1024) == 896  # all cached: the last token is computed
    assert m.loadable(cached_blocks=0, prompt_tokens=1000) == 0
    coarse = BlockMap(kv_block=256, engine_block=128)
    assert coarse.loadable(cached_blocks=2, prompt_tokens=400) == 384
    assert list(coarse.kv_blocks(128, 384)) == [0, 1]
    assert list(coarse.kv_blocks(5, 5)) == []


@pytest.mark.parametrize(("kv_block", "engine_block"), [(16, 128), (128, 128), (256, 128)])
def test_read_then_write_moves_every_token_row_to_its_place(kv_block: int, engine_block: int) -> None:
    lay = layout(kv_block)
    src = pool(8, engine_block)
    table = [5, 2, 7, 0]  # the request's blocks sit anywhere in the pool
    tokens = 4 * engine_block
    m = BlockMap(kv_block, engine_block)
    paged = PagedKV(src, lay, engine_block)
    payloads = {}
    for k in m.kv_blocks(0, tokens):
        segs = [s for s in segments(0, tokens, kv_block, engine_block) if s.kv_block == k]
        out = torch.zeros(lay.block_bytes, dtype=torch.uint8)
        paged.read(out, segs, table)
        payloads[k] = (out, segs)
        blocks = lay.as_blocks(out)  # [layers, heads, K|V, tokens, dim]
        for s in segs:
            for i in range(s.tokens):
                want = token_row(src, table, engine_block, k * kv_block + s.kv_offset + i)
                assert torch.equal(blocks[:, :, :, s.kv_offset + i], want)
    # write into another pool at other slots: the same rows come back, nothing else is touched
    dst = [torch.full_like(t, -1.0) for t in src]
    other = [1, 6, 3, 4]
    target = PagedKV(dst, lay, engine_block)
    for out, segs in payloads.values():
        target.write(out, segs, other)
    for token in range(tokens):
        assert torch.equal(token_row(dst, other, engine_block, token), token_row(src, table, engine_block, token))
    untouched = [b for b in range(8) if b not in other]
    assert all(bool((t[untouched] == -1).all()) for t in dst)


def test_pool_that_does_not_match_the_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="does not match"):
        PagedKV(pool(4, 64), layout(16), engine_block=128)
    with pytest.raises(ValueError, match="layers"):
        PagedKV(pool(4, 128)[:2], layout(16), engine_block=128)
    with pytest.raises(ValueError, match="head-major"):
        PagedKV(pool(4, 128), KVLayout(L, H, D, 16, torch.float32), engine_block=128)
