"""The C row kernels (RMSNorm with the residual add, RoPE with the K/V write, silu * up) against the torch formulas.

Every build the CPU runs (``rowwise.IMPLS``) is checked, in float32 and
bfloat16. Where the C side rounds exactly as torch's operators do (the
residual add, RoPE in bfloat16, the pool write) the bytes must be equal;
where it sums or exponentiates in another order (RMSNorm's mean, silu's
exp) the result must be within a rounding of the dtype. And a row's result
must not depend on its neighbours or the thread count: that is what lets a
token's K/V be reused whatever batch computed them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import KVPool
from kvtier.engine.pool import BlockTable
from kvtier.engine.rowwise import (
    IMPLS,
    Rope,
    add_rms_norm,
    apply_rope,
    head_rms_norm,
    rms_norm,
    rope_table,
    silu_mul,
)
from kvtier.layout import KVLayout

DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 2e-6, torch.bfloat16: 8e-3}  # relative: a few float32 ulps; one bfloat16 ulp


def rand(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, *, floor: float = 1e-3) -> None:
    """Element by element within a few ulps of the dtype, relative to the value (or to ``floor``, near zero)."""
    err = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(floor)).max().item()
    assert err <= ULP[dtype], err


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_matches_torch(impl: str, dtype: torch.dtype, with_delta: bool) -> None:
    x, w = rand(37, 576, dtype=dtype, seed=1, scale=3.0), rand(576, dtype=dtype, seed=2)
    delta = rand(37, 576, dtype=dtype, seed=3) if with_delta else None
    want_x = x + delta if delta is not None else x.clone()
    got_x, got = add_rms_norm(x.clone(), delta, w, 1e-5, impl=impl)
    assert torch.equal(got_x, want_x)  # the add rounds exactly as torch's
    assert_close_rel(got, rms_norm(want_x, w, 1e-5), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_rms_norm_rounds_as_torchs_own_operator(impl: str, dtype: torch.dtype) -> None:
    """Q/K norms (Qwen3, Gemma 3): each head of a column slice of the fused product a row, the weight
    applied before the one rounding, as ``F.rms_norm`` does; a head's result does not depend on the others."""
    qkv = rand(21, 4 * 256 + 2 * 256, dtype=dtype, seed=4, scale=3.0)
    q, w = qkv[:, : 4 * 256].reshape(-1, 4, 256), rand(256, dtype=dtype, seed=5) + 1.0
    got = head_rms_norm(q, w, 1e-6, impl=impl)
    assert got.shape == q.shape and got.dtype == dtype
    assert_close_rel(got, F.rms_norm(q, (256,), w, 1e-6), dtype)
    assert torch.equal(head_rms_norm(q[5:6, 2:3], w, 1e-6, impl=impl), got[5:6, 2:3])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(impl: str, dtype: torch.dtype) -> None:
    gate_up = rand(19, 2 * 1536, dtype=dtype, seed=4, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close_rel(silu_mul(gate_up, impl=impl), F.silu(gate) * up, dtype)


def small_pool(dtype: torch.dtype) -> KVPool:
    pool = KVPool(KVLayout(2, 3, 64, 16, dtype), num_blocks=8)
    pool.kv.zero_()
    return pool


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_and_writes_the_pool(impl: str, dtype: torch.dtype) -> None:
    heads, kv_heads, dim, n, start = 9, 3, 64, 21, 27
    cos, sin = (t.to(dtype) for t in rope_table(dim, 10000.0, 256))
    table = BlockTable([5, 2, 7], start)
    pool = small_pool(dtype)
    slots = pool.slots(table, start, n)
    positions = torch.arange(start, start + n)
    qkv = rand(n, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=5, scale=2.0)

    native = Rope(cos, sin, positions, slots, pool, heads, impl=impl)
    assert native.native
    q, k, v = native.apply(1, qkv.clone())

    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    wq, wk, wv = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    wq, wk = apply_rope(wq.reshape(n, heads, dim), c, s), apply_rope(wk.reshape(n, kv_heads, dim), c, s)

    assert q.is_contiguous() and q.shape == (n, heads, dim)
    if dtype == torch.bfloat16:  # every product and the sum rounded as torch rounds them: the same bytes
        assert torch.equal(q, wq) and torch.equal(k, wk)
    else:  # a fused multiply-add may round x1 cos - x2 sin once where torch rounds twice: near zero, relative to 1
        assert_close_rel(q, wq, dtype, floor=1.0)
        assert_close_rel(k, wk, dtype, floor=1.0)
    assert torch.equal(v, wv.reshape(n, kv_heads, dim))
    layer = pool.layers[1].clone()
    assert torch.equal(layer[slots.blocks, 0, :, slots.offsets], k)
    assert torch.equal(layer[slots.blocks, 1, :, slots.offsets], v)
    layer[slots.blocks, :, :, slots.offsets] = 0
    assert not layer.any() and not pool.layers[0].any()  # nothing outside the slots, nor in another layer


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """300 rows on two threads give, row for row, the bytes of each row computed alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_rows_alone(dtype)
    finally:
        torch.set_num_threads(threads)


def check_rows_alone(dtype: torch.dtype) -> None:
    x, delta, w = (
        rand(300, 576, dtype=dtype, seed=6),
        rand(300, 576, dtype=dtype, seed=7),
        rand(576, dtype=dtype, seed=8),
    )
    _, together = add_rms_norm(x.clone(), delta, w, 1e-5)
    alone = torch.cat([add_rms_norm(x[i : i + 1].clone(), delta[i : i + 1], w, 1e-5)[1] for i in range(300)])
    assert torch.equal(together, alone)
    gate_up = rand(300, 512, dtype=dtype, seed=9, scale=3.0)
    assert torch.equal(silu_mul(gate_up), torch.cat([silu_mul(gate_up[i : i + 1]) for i in range(300)]))


def test_builds_agree_within_rounding() -> None:
    x, w = rand(8, 576, dtype=torch.float32, seed=10), rand(576, dtype=torch.float32, seed=11)
    outs = [add_rms_norm(x.clone(), None, w, 1e-5, impl=impl)[1] for impl in IMPLS]
    for out in outs[1:]:
        assert_close_rel(out, outs[0], torch.float32)


def test_unfit_tensors_take_the_torch_formulas() -> None:
    """float16 (no C build) and a non-contiguous input run torch's operators, with the same results."""
    x, w = rand(4, 64, dtype=torch.float16, seed=12), rand(64, dtype=torch.float16, seed=13)
    got_x, got = add_rms_norm(x, x, w, 1e-5)
    assert torch.equal(got, rms_norm(x + x, w, 1e-5)) and torch.equal(got_x, x + x)
    wide = rand(4, 128, dtype=torch.float32, seed=14)
    assert torch.equal(silu_mul(wide[:, ::2]), F.silu(wide[:, ::2][:, :32]) * wide[:, ::2][:, 32:])


def test_bad_arguments_are_refused() -> None:
    from kvtier.engine import rowwise

    native = rowwise._native
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="threads"):
        native.rms_norm(x.data_ptr(), 0, x.data_ptr(), x.data_ptr(), 2, 8, 1e-5, False, 0)
    with pytest.raises(ValueError, match="cols"):
        native.rms_norm(x.data_ptr(), 0, x.data_ptr(), x.data_ptr(), 2, 0, 1e-5, False)
    with pytest.raises(ValueError, match="no nope build"):
        native.silu_mul(x.data_ptr(), x.data_ptr(), 2, 4, False, 1, "nope")
    with pytest.raises(ValueError, match="head_dim"):
        native.rope_kv(x.data_ptr(), 2, 8, 1, 1, 3, 1, 1, 1, 1, 0, (0, 0, 0, 0), 0, 0, False)
