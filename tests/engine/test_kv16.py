"""A float16 KV pool under a float32 or bfloat16 model: the C kernels widen its K/V as they read them.

As for 8-bit pools (``test_kv8.py``), the kernels are checked on every build
the CPU runs against float64 attention over the values the pool holds, and
the write path against torch's own rounding to float16.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import BlockTable, KVPool, kernels, rowwise
from kvtier.engine.kernels import NativeDecode, NativePrefill, PagedBlocks, paged_attention, plan_decode, plan_prefill
from kvtier.layout import KVLayout
from tests.engine.test_kernels import shuffled_tables
from tests.engine.test_kv8 import TOL, attention, queries


def f16_pool(*, kv_heads: int = 3, head_dim: int = 64, block: int = 16) -> KVPool:
    """Random K/V rounded to float16, with values at float16's edges: subnormals and its largest."""
    pool = KVPool(KVLayout(2, kv_heads, head_dim, block, torch.float16), num_blocks=96)
    g = torch.Generator().manual_seed(1)
    for layer in pool.layers:
        layer.copy_(torch.randn(layer.shape, generator=g) * 4)
        layer[3, 1, 0, 0, :8] = torch.tensor([6e-8, -3e-6, 65504.0, -65504.0, 1e-5, 2.0**-14, -(2.0**-24), 0.0])
    return pool


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Within ``tol`` of the largest |value| (at least 1): float16's largest values make large outputs."""
    return (got.double() - want).abs().max().item() < tol * max(1.0, want.abs().max().item())


def held(pool: KVPool, layer: int, table: BlockTable, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    kv = pool.layers[layer][torch.tensor(table.block_ids)].double()
    k, v = (kv[:, i].transpose(0, 1).flatten(1, 2)[:, :total] for i in (0, 1))
    return k, v


@pytest.mark.parametrize("impl", kernels.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("kv_heads", "heads", "head_dim", "block"), [(3, 9, 64, 16), (2, 2, 128, 8), (1, 3, 48, 16)])
def test_decode_reads_float16_under_either_model_dtype(
    impl: str, dtype: torch.dtype, kv_heads: int, heads: int, head_dim: int, block: int
) -> None:
    pool = f16_pool(kv_heads=kv_heads, head_dim=head_dim, block=block)
    lengths = [5, block + 1, 130, 300]
    tables = shuffled_tables(pool, lengths)
    q = queries(len(lengths), heads, head_dim, dtype) / 8
    got = paged_attention(pool.layers[1], PagedBlocks.of(tables, lengths, block), q, impl=impl)
    assert got.dtype == dtype
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k, v = held(pool, 1, table, n)
        want = attention(q[i : i + 1], k, v, torch.ones(1, n, dtype=torch.bool))
        assert close(got[i : i + 1], want, TOL[dtype])


@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("start", "tokens", "window"), [(0, 70, None), (130, 37, None), (200, 90, 50)])
def test_prefill_reads_float16_under_either_model_dtype(
    impl: str, dtype: torch.dtype, start: int, tokens: int, window: int | None
) -> None:
    pool = f16_pool()
    (table,) = shuffled_tables(pool, [start + tokens])
    q = queries(tokens, 9, 64, dtype) / 8
    got = NativePrefill(pool.layers, table, start, tokens, 9, impl=impl, window=window).attend(1, q)
    total = start + tokens
    k, v = held(pool, 1, table, total)
    if dtype == torch.bfloat16:  # the bf16 build rounds each K/V tile to bfloat16, as q is
        k, v = k.to(torch.bfloat16).double(), v.to(torch.bfloat16).double()
    allowed = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
    if window is not None:
        allowed &= torch.arange(total)[None, :] > torch.arange(start, total)[:, None] - window
    assert close(got, attention(q, k, v, allowed), TOL[dtype])


@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
def test_prefill_over_float16_gives_a_token_the_same_bits_however_the_prompt_was_cut(impl: str) -> None:
    pool = f16_pool()
    (table,) = shuffled_tables(pool, [300])
    q = queries(300, 9, 64, torch.float32) / 8
    whole = NativePrefill(pool.layers, table, 0, 300, 9, impl=impl).attend(0, q)
    for cut in (1, 16, 131):
        head = NativePrefill(pool.layers, table, 0, cut, 9, impl=impl).attend(0, q[:cut])
        tail = NativePrefill(pool.layers, table, cut, 300 - cut, 9, impl=impl).attend(0, q[cut:])
        assert torch.equal(torch.cat([head, tail]), whole)


def test_a_float16_pool_is_planned_on_the_kernels_from_position_zero() -> None:
    pool = f16_pool()
    (table,) = shuffled_tables(pool, [100])
    assert isinstance(plan_prefill(pool, table, 0, 100, num_heads=9), NativePrefill)
    assert isinstance(plan_decode(pool, [table], [100], num_heads=9), NativeDecode)


@pytest.mark.parametrize("impl", rowwise.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rope_kernel_rounds_kv_to_float16_as_torch_does(impl: str, dtype: torch.dtype) -> None:
    heads, kv_heads, dim, n, start = 9, 3, 64, 21, 27
    cos, sin = (t.to(dtype) for t in rowwise.rope_table(dim, 10000.0, 256))
    pool = KVPool(KVLayout(2, kv_heads, dim, 16, torch.float16), num_blocks=8)
    table = BlockTable([5, 2, 7], start)
    slots = pool.slots(table, start, n)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    v0 = (heads + kv_heads) * dim  # V rows are written unrotated: float16's edges, ties and overflow
    edges = [65504.0, 65519.0, 65520.0, 1e6, -(2.0**-25), 3 * 2.0**-26, 2.0**-14, 1.0 + 2.0**-11, float("nan")]
    qkv[4, v0 : v0 + len(edges)] = torch.tensor(edges).to(dtype)
    qkv[5, v0 : v0 + dim] = (2.0 ** -(torch.arange(dim, dtype=torch.float32) / 2.5)).to(dtype)
    rope = rowwise.Rope(cos, sin, torch.arange(start, start + n), slots, pool, heads, impl=impl)
    assert rope.native
    _, k, v = rope.apply(1, qkv.clone())
    want = KVPool(pool.layout, num_blocks=8)
    want.write(1, slots, k, v)  # torch's float -> float16 on the same K/V
    assert torch.equal(pool.kv.view(torch.int16), want.kv.view(torch.int16))
    assert torch.count_nonzero(pool.kv[0]) == 0
