"""An 8-bit KV pool: its bytes, its quantization, and the C attention kernels reading it in place.

The kernels are checked on every build the CPU runs against float64
attention over the dequantized K/V (quants times their rows' scales): what
an 8-bit pool holds is those values, and the kernels must attend to nothing
else.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import BlockTable, KVPool, kernels, rowwise
from kvtier.engine.kernels import NativeDecode, NativePrefill, PagedBlocks, paged_attention, plan_decode, plan_prefill
from kvtier.layout import KVLayout, quantize_rows
from tests.engine.test_kernels import shuffled_tables

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
KV8 = pytest.mark.parametrize("kv", [torch.int8, torch.float8_e4m3fn], ids=["int8", "e4m3"])


def kv8_pool(
    kv: torch.dtype = torch.int8, *, kv_heads: int = 3, head_dim: int = 64, block: int = 16, layers: int = 2
) -> KVPool:
    """A pool filled through its own write path: random K/V quantized a token at a time."""
    pool = KVPool(KVLayout(layers, kv_heads, head_dim, block, kv, row_scales=True), num_blocks=96)
    g = torch.Generator().manual_seed(1)
    for layer in range(layers):
        for half in range(2):
            x = torch.randn(pool.num_blocks, kv_heads, block, head_dim, generator=g) * torch.rand(
                pool.num_blocks, kv_heads, block, 1, generator=g
            )
            quants, scale = quantize_rows(x, kv)
            pool.layers[layer].view(torch.uint8)[:, half] = quants.view(torch.uint8)
            pool.scales[layer][:, half] = scale
    if kv == torch.float8_e4m3fn:  # every finite e4m3 code (subnormals too), in K and V rows of block 3
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        rows = torch.zeros(4 * head_dim, dtype=torch.uint8)  # four rows: all 254 codes from head_dim 64 up
        rows[: min(len(rows), len(codes))] = codes[: len(rows)]
        for layer in pool.layers:
            layer.view(torch.uint8)[3, :, 0, :4] = rows.view(4, head_dim)
    return pool


def dequantized(pool: KVPool, layer: int, table: BlockTable, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[kv_heads, total, D]`` in float64, as the pool holds them."""
    ids = torch.tensor(table.block_ids)
    quants = pool.layers[layer].view(torch.uint8)[ids].view(pool.layout.dtype)
    kv = quants.double() * pool.scales[layer][ids].double().unsqueeze(-1)
    k, v = (kv[:, i].transpose(0, 1).flatten(1, 2)[:, :total] for i in (0, 1))
    return k, v


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """float64 ``q [T, heads, D]`` against ``k``/``v [kv_heads, n, D]`` where ``allowed [T, n]``."""
    tokens, heads, dim = q.shape
    qq = q.double().transpose(0, 1).reshape(k.shape[0], heads // k.shape[0], tokens, dim)
    scores = (qq @ k[:, None].transpose(-1, -2) * dim**-0.5).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v[:, None]).reshape(heads, tokens, dim).transpose(0, 1)


def queries(n: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(3)).to(dtype)


def test_the_layout_holds_a_quant_a_value_and_a_scale_a_row() -> None:
    lay = KVLayout(30, 3, 64, 16, torch.int8)
    fp32 = KVLayout(30, 3, 64, 16, torch.float32)
    assert lay.bytes_per_token == 30 * 2 * 3 * (64 + 4)
    assert lay.bytes_per_token / fp32.bytes_per_token == pytest.approx(68 / 256)
    assert lay.descriptor.endswith(":int8") and lay.descriptor != fp32.descriptor
    with pytest.raises(ValueError, match="as_float"):
        lay.as_blocks(torch.zeros(lay.block_bytes, dtype=torch.uint8))


def test_quantize_rows_is_symmetric_per_row_and_a_zero_row_stays_zero() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 3.0, -3.0, 1e-3]])
    quants, scale = quantize_rows(x)
    assert quants.dtype == torch.int8 and scale.dtype == torch.float32
    assert quants[0].tolist() == [64, -127, 32, 0] and scale[0].item() == pytest.approx(2 / 127)
    assert quants[1].tolist() == [0, 0, 0, 0] and scale[1].item() == 0.0
    assert quants[2].abs().max().item() == 127
    assert (quants.float() * scale[:, None] - x).abs().max().item() <= (scale.max() / 2).item() + 1e-7


def test_a_row_quantizes_alike_alone_or_among_others() -> None:
    """A token's bytes are its own: the same whichever chunk wrote it."""
    x = torch.randn(40, 3, 64, generator=torch.Generator().manual_seed(4), dtype=torch.bfloat16)
    whole = quantize_rows(x)
    for i in (0, 17, 39):
        one = quantize_rows(x[i : i + 1])
        assert torch.equal(one[0], whole[0][i : i + 1]) and torch.equal(one[1], whole[1][i : i + 1])


def test_pool_write_and_payloads_round_trip() -> None:
    pool = KVPool(KVLayout(2, 3, 64, 16, torch.int8), num_blocks=4)
    table = BlockTable()
    pool.grow(table, 20)
    k, v = torch.randn(2, 20, 3, 64, generator=torch.Generator().manual_seed(5))
    pool.write(1, pool.slots(table, 0, 20), k, v)
    payload = torch.empty(pool.layout.block_bytes, dtype=torch.uint8)
    pool.read_block_to_payload(table.block_ids[0], payload)
    as_float = pool.layout.as_float(payload)  # [layers, 2, heads, block, dim]
    quants, scale = quantize_rows(k[:16])
    assert torch.equal(as_float[1, 0].transpose(0, 1), quants.float() * scale[..., None])
    assert (as_float[1, 1].transpose(0, 1) - v[:16]).abs().max().item() < 0.05
    pool.write_block_from_payload(table.block_ids[1], payload)
    assert torch.equal(pool.kv[:, table.block_ids[1]], pool.kv[:, table.block_ids[0]])
    with pytest.raises(ValueError, match="C attention kernels"):
        pool.plan_gather([table], [20])


@KV8
@pytest.mark.parametrize("impl", kernels.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("kv_heads", "heads", "head_dim", "block"),
    [(3, 9, 64, 16), (3, 9, 64, 24), (2, 2, 128, 8), (1, 4, 96, 16), (1, 3, 48, 16), (4, 64, 16, 32)],
    ids=["smollm2", "block24", "dim128-block8", "dim96", "dim48", "group16"],
)
def test_decode_reads_the_quants_and_scales(
    kv: torch.dtype, impl: str, dtype: torch.dtype, kv_heads: int, heads: int, head_dim: int, block: int
) -> None:
    pool = kv8_pool(kv, kv_heads=kv_heads, head_dim=head_dim, block=block)
    lengths = [5, block, block + 1, 130, 300][: 3 if block == 32 else 5]
    tables = shuffled_tables(pool, lengths)
    q = queries(len(lengths), heads, head_dim, dtype)
    blocks = PagedBlocks.of(tables, lengths, pool.block_size)
    for layer in range(2):
        got = paged_attention(pool.layers[layer], blocks, q, impl=impl)
        assert got.dtype == dtype and got.shape == q.shape
        for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
            k, v = dequantized(pool, layer, table, n)
            want = attention(q[i : i + 1], k, v, torch.ones(1, n, dtype=torch.bool))
            assert (got[i : i + 1].double() - want).abs().max().item() < TOL[dtype]


@KV8
@pytest.mark.parametrize("impl", kernels.IMPLS)
def test_decode_with_a_window_reads_only_inside_it(kv: torch.dtype, impl: str) -> None:
    pool = kv8_pool(kv)
    lengths, window = [40, 300], 37
    tables = shuffled_tables(pool, lengths)
    q = queries(2, 9, 64, torch.float32)
    got = paged_attention(pool.layers[0], PagedBlocks.of(tables, lengths, 16), q, impl=impl, window=window)
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        k, v = dequantized(pool, 0, table, n)
        allowed = (torch.arange(n) >= n - window)[None, :]
        assert (got[i : i + 1].double() - attention(q[i : i + 1], k, v, allowed)).abs().max().item() < 1e-5


@KV8
@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("start", "tokens", "window"), [(0, 70, None), (130, 37, None), (200, 90, 50)])
def test_prefill_reads_the_quants_and_scales(
    kv: torch.dtype, impl: str, dtype: torch.dtype, start: int, tokens: int, window: int | None
) -> None:
    pool = kv8_pool(kv)
    (table,) = shuffled_tables(pool, [start + tokens])
    q = queries(tokens, 9, 64, dtype)
    got = NativePrefill(pool.layers, table, start, tokens, 9, impl=impl, window=window).attend(1, q)
    assert got.dtype == dtype
    total = start + tokens
    k, v = dequantized(pool, 1, table, total)
    allowed = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
    if window is not None:
        allowed &= torch.arange(total)[None, :] > torch.arange(start, total)[:, None] - window
    assert (got.double() - attention(q, k, v, allowed)).abs().max().item() < TOL[dtype]


@KV8
@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_gives_a_token_the_same_bits_however_the_prompt_was_cut(
    kv: torch.dtype, impl: str, dtype: torch.dtype
) -> None:
    """What makes 8-bit reuse exact: a token's output does not depend on the chunk it came in."""
    pool = kv8_pool(kv)
    (table,) = shuffled_tables(pool, [300])
    q = queries(300, 9, 64, dtype)
    whole = NativePrefill(pool.layers, table, 0, 300, 9, impl=impl).attend(0, q)
    for cut in (1, 16, 131):
        head = NativePrefill(pool.layers, table, 0, cut, 9, impl=impl).attend(0, q[:cut])
        tail = NativePrefill(pool.layers, table, cut, 300 - cut, 9, impl=impl).attend(0, q[cut:])
        assert torch.equal(torch.cat([head, tail]), whole)


@KV8
def test_an_8bit_pool_is_planned_on_the_kernels_from_position_zero(kv: torch.dtype) -> None:
    pool = kv8_pool(kv)
    (table,) = shuffled_tables(pool, [100])
    assert isinstance(plan_prefill(pool, table, 0, 100, num_heads=9), NativePrefill)
    assert isinstance(plan_decode(pool, [table], [100], num_heads=9), NativeDecode)
    with pytest.raises(ValueError, match="does not fit"):
        plan_decode(pool, [table], [100], num_heads=9).attend(0, queries(1, 9, 64, torch.float16))


@KV8
@pytest.mark.parametrize("impl", rowwise.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rope_kernel_writes_the_quants_quantize_rows_makes(kv: torch.dtype, impl: str, dtype: torch.dtype) -> None:
    """The C write rounds as :func:`quantize_rows` does: the same bytes as the torch path on the same K/V."""
    heads, kv_heads, dim, n, start = 9, 3, 64, 21, 27
    cos, sin = (t.to(dtype) for t in rowwise.rope_table(dim, 10000.0, 256))
    pool = KVPool(KVLayout(2, kv_heads, dim, 16, kv, row_scales=True), num_blocks=8)
    table = BlockTable([5, 2, 7], start)
    slots = pool.slots(table, start, n)
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    qkv[3, heads * dim : (heads + 1) * dim] = 0  # a zero row: scale 0, quants 0
    # V rows (not rotated) from 2^8 down to 2^-23 of their largest, both signs: e4m3's subnormals, ties and
    # the largest quant all met
    v0 = (heads + kv_heads) * dim
    span = 2.0 ** -(torch.arange(dim, dtype=torch.float32) * 31 / dim) * torch.tensor([1.0, -1.0]).repeat(dim // 2)
    qkv[4, v0 : v0 + dim] = (span * 3.0).to(dtype)
    qkv[5, v0 : v0 + dim] = (torch.round(span * 512) / 512 + 2.0**-10).to(dtype)
    rope = rowwise.Rope(cos, sin, torch.arange(start, start + n), slots, pool, heads, impl=impl)
    assert rope.native
    _, k, v = rope.apply(1, qkv.clone())
    want = KVPool(pool.layout, num_blocks=8)
    want.write(1, slots, k, v)  # the rotated K the kernel returned, quantized by torch
    assert torch.equal(pool.kv, want.kv)
    assert torch.count_nonzero(pool.scales[1][2, :, :, : start - 16]) == 0  # nothing before the first slot
    assert torch.count_nonzero(pool.scales[1][2, :, :, start - 16 :]) > 0
    assert torch.count_nonzero(pool.kv[0]) == 0  # layer 0 untouched


def test_e4m3_rows_round_as_torch_and_keep_small_values_finer_than_int8() -> None:
    x = torch.tensor([[448.0, 1.0, -0.3, 3 * 2.0**-11, 0.0], [0.0] * 5])
    quants, scale = quantize_rows(x, torch.float8_e4m3fn)
    assert quants.dtype == torch.float8_e4m3fn and scale[0].item() == 1.0 and scale[1].item() == 0.0
    assert torch.equal(quants[0].float(), x[0].to(torch.float8_e4m3fn).float())  # in range: torch's own rounding
    assert quants[0].float()[3].item() == 2.0**-9  # the smallest subnormal: 0.75 of it rounds up to it
    i8, i8_scale = quantize_rows(x)
    assert (i8[0].float() * i8_scale[0])[2].item() != pytest.approx(-0.3, rel=1e-2)
    assert (quants[0].float() * scale[0])[2].item() == pytest.approx(-0.3, rel=0.07)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        quantize_rows(x, torch.float8_e5m2)


def test_an_e4m3_layout_names_its_scales_apart_from_vllm_pages() -> None:
    """kvtier's e4m3 blocks (with row scales) and vLLM's fp8 pages (without) never share a key root."""
    ours = KVLayout(30, 3, 64, 16, torch.float8_e4m3fn, row_scales=True)
    pages = KVLayout(30, 3, 64, 16, torch.float8_e4m3fn)
    assert ours.quantized and not pages.quantized
    assert ours.bytes_per_token == KVLayout(30, 3, 64, 16, torch.int8).bytes_per_token
    assert ours.bytes_per_token == pages.bytes_per_token * 68 // 64
    assert ours.descriptor.endswith(":fp8_e4m3:row_scales") and pages.descriptor.endswith(":fp8_e4m3")
    with pytest.raises(ValueError, match="row scales"):
        KVLayout(30, 3, 64, 16, torch.bfloat16, row_scales=True)
