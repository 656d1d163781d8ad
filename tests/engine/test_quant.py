"""Decode steps and last-row logits on the GGUF's own blocks: the same weights, the same products to a few ulps."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kvtier.engine import BlockTable, SeqInput, quant
from kvtier.engine.llama import LlamaModel
from kvtier.engine.quant import QuantMatrix, QuantStack, fuse
from kvtier.engine.runtime import LoadedModel
from kvtier.model import QuantKind, load_gguf_with_blocks
from kvtier.model.blocks import BLOCK_FORMATS, repack, weights_of
from kvtier.model.config import Architecture
from tests.model.hf_gguf import VOCAB, random_model, write_gguf
from tests.model.random_blocks import random_raw


def dequantized(m: QuantMatrix | QuantStack) -> torch.Tensor:
    """The float32 matrix a :class:`QuantMatrix` (or a stack of them) stands for, computed the plain way."""
    if isinstance(m, QuantStack):
        return torch.cat([dequantized(p) for p in m.parts])

    def array(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.numpy()

    return torch.from_numpy(weights_of(m.kind, *(array(t) for t in (m.q, m.d, m.m, m.d_fac, m.m_fac))))


def test_the_native_decode_path_is_the_one_in_use(loaded_model: LoadedModel) -> None:
    model = loaded_model.model
    assert quant.IMPL in {"avx2", "base"}
    assert model.decode_layers is not None and len(model.decode_layers) == model.config.num_layers
    assert model.lm_head_blocks is not None and model.lm_head_blocks.kind is QuantKind.Q8_0
    assert model.decode_layers[0].wqkv.kind is QuantKind.Q4_1


def test_blocks_are_exactly_the_dequantized_weights(loaded_model: LoadedModel) -> None:
    """Q and K rows un-permuted like the float32 ones, fused in the same order: the same values, bit for bit."""
    model = loaded_model.model
    for i in (0, 17, model.config.num_layers - 1):
        dense, blocks = model.layers[i], model.decode_layers[i]
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert torch.equal(dequantized(getattr(blocks, name)), getattr(dense, name)), (i, name)
    assert torch.equal(dequantized(model.lm_head_blocks), model.lm_head)
    assert model.decode_layers[0].wqkv.nbytes * 5 < model.layers[0].wqkv.numel() * 4  # the point of it


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("which", ["w_down", "wqkv", "lm_head"])
def test_products_match_float64_as_closely_as_float32_matmul(loaded_model: LoadedModel, rows: int, which: str) -> None:
    model = loaded_model.model
    m = model.lm_head_blocks if which == "lm_head" else getattr(model.decode_layers[5], which)
    dense = model.lm_head if which == "lm_head" else getattr(model.layers[5], which)
    x = torch.randn(rows, m.cols, generator=torch.Generator().manual_seed(rows))
    exact = x.double() @ dense.double().T
    got = m(x)
    assert got.shape == (rows, m.rows) and got.dtype == torch.float32
    scale = exact.abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 1e-6 * scale + 4 * (x @ dense.T - exact).abs().max().item()
    assert torch.equal(m(x, threads=1), m(x, threads=2))  # each output row is one thread's, in one order
    base = m(x, impl="base")
    assert (base.double() - exact).abs().max().item() <= 1e-6 * scale + 4 * (x @ dense.T - exact).abs().max().item()


def test_the_kernel_refuses_what_it_cannot_do(loaded_model: LoadedModel) -> None:
    m = loaded_model.model.decode_layers[0].wo
    with pytest.raises(ValueError, match="float32"):
        m(torch.zeros(1, m.cols, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows"):
        m(torch.zeros(quant.MAX_ROWS + 1, m.cols))
    with pytest.raises(ValueError, match="no nosuch build"):
        m(torch.zeros(1, m.cols), impl="nosuch")


def test_decode_steps_use_the_blocks_and_prefills_only_for_the_head(loaded_model: LoadedModel) -> None:
    """Decode logits equal the dense path's to a few ulps (same argmax); a prefill's layers stay dense.

    A prefill reads the blocks only for its last row's lm_head, so taking
    the layers' blocks away leaves its logits bit-identical, and taking the
    head's away too moves them by ulps only.
    """
    model = loaded_model.model
    ids = [int(t) for t in torch.randint(0, 49000, (70,), generator=torch.Generator().manual_seed(3))]

    def run(layers: bool, head: bool) -> tuple[torch.Tensor, torch.Tensor]:
        saved = model.decode_layers, model.lm_head_blocks
        model.decode_layers = saved[0] if layers else None
        model.lm_head_blocks = saved[1] if head else None
        try:
            pool, table = model.make_pool(16, 8), BlockTable()
            pool.grow(table, 71)
            prefill = model.forward([SeqInput(ids[:69], 0, table)], pool)
            decode = model.forward([SeqInput(ids[69:70], 69, table)], pool)
            return prefill, decode
        finally:
            model.decode_layers, model.lm_head_blocks = saved

    (p_blocks, d_blocks), (p_head, _), (p_dense, d_dense) = run(True, True), run(False, True), run(False, False)
    assert torch.equal(p_blocks, p_head)
    assert 0 < (p_blocks - p_dense).abs().max().item() < 1e-3
    assert int(p_blocks.argmax()) == int(p_dense.argmax())
    assert (d_blocks - d_dense).abs().max().item() < 1e-3
    assert int(d_blocks.argmax()) == int(d_dense.argmax())


def random_q4_1(rows: int, cols: int, seed: int) -> QuantMatrix:
    g = torch.Generator().manual_seed(seed)
    blocks = cols // 32
    return QuantMatrix(
        QuantKind.Q4_1,
        torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8),
        torch.rand(rows, blocks, generator=g) * 0.1,
        torch.randn(rows, blocks, generator=g) * 0.05,
        rows,
        cols,
    )


@pytest.mark.skipif(not quant.BF16, reason="this CPU has no AVX-512 BF16")
@pytest.mark.parametrize("cols", [576, 1536, 96])  # 96: an odd block count, the last pair half empty
def test_bfloat16_rows_on_avx512_bf16_match_float64_as_closely_as_float32(cols: int) -> None:
    """Q4_1 times bfloat16 rows on VDPBF16PS: within float32's own error of the exact product, every row alone
    the same bits as in a batch, and the float32 build given the same rows (widened on the C side) agrees."""
    m = random_q4_1(40, cols, seed=cols)
    dense = dequantized(m)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    exact = x.double() @ dense.double().T
    got = m(x)
    float32_error = (x.float() @ dense.T - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 1e-6 * exact.abs().max().item() + 4 * float32_error
    assert torch.equal(got, m(x, impl="avx512bf16"))
    for i in range(5):
        assert torch.equal(m(x[i : i + 1])[0], got[i])  # a decode step and a verify step agree
    assert torch.equal(m(x, threads=1), m(x, threads=2))
    if quant.IMPL == "avx2":
        assert torch.equal(m(x, impl="avx2"), m(x.float(), impl="avx2"))  # widened exactly


def test_bfloat16_rows_of_the_int8_forms(loaded_model: LoadedModel) -> None:
    """On AVX-512 BF16 the int8 forms run on VDPBF16PS too (float32's own error, a row alone the same bits as in a
    batch); elsewhere the rows are widened to float32 exactly."""
    head = loaded_model.model.lm_head_blocks
    x = torch.randn(5, head.cols, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    if not quant.BF16:
        assert torch.equal(head(x), head(x.float()))
        return
    got = head(x)
    assert torch.equal(got, head(x, impl="avx512bf16"))
    assert_close_to_exact(got, x, dequantized(head))
    for i in (0, 4):
        assert torch.equal(head(x[i : i + 1])[0], got[i])
    assert not torch.equal(got, head(x.float()))  # another build: the bfloat16 one did run


# --- every block format -----------------------------------------------------------------------------------------

FORMATS = sorted(BLOCK_FORMATS, key=lambda f: f.name)


def random_matrix(fmt: GGMLQuantizationType, rows: int, cols: int, seed: int) -> QuantMatrix:
    return QuantMatrix.of(repack(random_raw(fmt, rows, cols, seed), fmt, rows))


def assert_close_to_exact(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """Within float32's own error of the float64 product (a few ulps of summation order)."""
    exact = x.double() @ dense.double().T
    float32_error = (x.float() @ dense.T - exact).abs().max().item()
    assert (got.double() - exact).abs().max().item() <= 1e-6 * exact.abs().max().item() + 4 * float32_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_format_multiplies_to_float32_accuracy(fmt: GGMLQuantizationType, dtype: torch.dtype) -> None:
    """Each row of x the same bits alone or in a batch, on any thread count, and the portable build agrees."""
    m = random_matrix(fmt, 48, 768, seed=int(fmt))
    dense = dequantized(m)
    x = torch.randn(6, m.cols, generator=torch.Generator().manual_seed(int(fmt))).to(dtype)
    got = m(x)
    assert got.shape == (6, 48)
    assert_close_to_exact(got, x, dense)
    assert_close_to_exact(m(x, impl="base"), x, dense)
    for i in (0, 5):
        assert torch.equal(m(x[i : i + 1])[0], got[i])
    assert torch.equal(m(x, threads=1), m(x, threads=2))


K_QUANTS = [GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", K_QUANTS, ids=lambda f: f.name)
def test_factored_scales_give_the_plain_scales_bits_in_fewer_bytes(
    fmt: GGMLQuantizationType, dtype: torch.dtype
) -> None:
    """A row's factors multiplied out by the kernel are the numpy-repacked scales: the same output bits, every build."""
    blocks = repack(random_raw(fmt, 40, 1024, seed=3), fmt, 40)
    factored, plain = QuantMatrix.of(blocks), QuantMatrix.of(blocks.plain())
    assert factored.d_fac is not None and plain.d_fac is None
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(4)).to(dtype)
    impls = [None, "base"] + ([quant.IMPL] if quant.IMPL != "base" else [])
    for impl in impls:
        assert torch.equal(factored(x, impl=impl), plain(x, impl=impl)), impl
        assert torch.equal(factored(x[:1], impl=impl), plain(x[:1], impl=impl)), impl
    scale_bytes = (factored.nbytes - factored.q.nbytes) / (plain.nbytes - plain.q.nbytes)
    assert scale_bytes <= 0.375  # an int8 for a float32, and a float32 or two per 256 weights


def test_factored_parts_stack_factored_and_with_plain_ones_multiplied_out() -> None:
    t = GGMLQuantizationType
    q4k = [repack(random_raw(t.Q4_K, 16, 512, seed=i), t.Q4_K, 16) for i in range(2)]
    both = QuantMatrix.cat(q4k)
    assert both.d_fac is not None and both.m_fac is not None and both.d.shape == (32, 2)
    mixed = QuantMatrix.cat([q4k[0], repack(random_raw(t.Q4_0, 16, 512, seed=5), t.Q4_0, 16)])
    assert mixed.d_fac is None and mixed.d.shape == (32, 16)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(6))
    assert torch.equal(both(x)[:, :16], mixed(x)[:, :16])
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantMatrix(both.kind, both.q[:, :64], both.d, both.m, 32, 128, both.d_fac[:, :4], both.m_fac[:, :4])(
            torch.zeros(1, 128)
        )


def q8_reference(m: QuantMatrix, x: torch.Tensor) -> torch.Tensor:
    """What the 8-bit build computes, in float64: x rounded to int8 per 32 values (scale max|x| / 127), exact sums."""
    blocks = x.float().reshape(len(x), -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, 0.0)  # float32, as the kernel multiplies
    quants = torch.round(blocks * inverse).double()  # to nearest, ties to even, as lrintf
    return (quants * (amax / 127).double()).reshape(len(x), -1) @ dequantized(m).double().T


@pytest.mark.skipif(not quant.Q8, reason="this CPU has no AVX-512 VNNI")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_8_bit_activations_are_llama_cpps_arithmetic_exactly_summed(
    fmt: GGMLQuantizationType, dtype: torch.dtype
) -> None:
    """x rounded to int8 a block, then int8 sums: the float64 sum of those rounded values to float32 accuracy; a row
    alone the same bits as in a batch, on any thread count; an odd block count (96 columns) included."""
    cols = 768 if fmt.name.endswith("_K") else 96
    m = random_matrix(fmt, 40, cols, seed=int(fmt) + 1)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(9)).to(dtype)
    x[1, :32] = 0  # a block of zeros: scale 0
    got = m(x, q8=True)
    want = q8_reference(m, x)
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    exact = x.double() @ dequantized(m).double().T
    assert 1e-4 < ((got.double() - exact).norm() / exact.norm()).item() < 2e-2  # rounded, and only by 8 bits
    for i in (0, 1, 5):
        assert torch.equal(m(x[i : i + 1], q8=True)[0], got[i])
    assert torch.equal(m(x, q8=True, threads=1), m(x, q8=True, threads=2))
    assert torch.equal(m(x, q8=True, impl="avx512vnni"), got)
    with pytest.raises(ValueError, match="avx512vnni"):
        m(x, q8=True, impl="base")


def test_parts_in_different_forms_stack_as_one_matrix() -> None:
    """A Q4_K_M layer's Q and K (Q4_K) with its V (Q6_K): one call a form; Q5_0 beside Q8_0 and Q5_1 fuse into one."""
    t = GGMLQuantizationType
    parts = [repack(random_raw(f, 32, 512, seed=i), f, 32) for i, f in enumerate((t.Q4_K, t.Q4_K, t.Q6_K))]
    stack = fuse(parts)
    assert isinstance(stack, QuantStack) and [p.kind for p in stack.parts] == [QuantKind.Q4_1, QuantKind.Q8_16]
    assert stack.rows == 96 and stack.cols == 512
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    assert_close_to_exact(stack(x), x, dequantized(stack))
    int8 = [repack(random_raw(f, 32, 512, seed=i), f, 32) for i, f in enumerate((t.Q5_0, t.Q8_0, t.Q5_1))]
    one = fuse(int8)
    assert isinstance(one, QuantMatrix) and one.kind is QuantKind.Q8_0 and one.m is not None
    assert_close_to_exact(one(x), x, dequantized(one))
    assert torch.equal(dequantized(one)[:64], torch.cat([dequantized(QuantMatrix.of(b)) for b in int8[:2]]))


def test_q8_16_refuses_minimums() -> None:
    m = random_matrix(GGMLQuantizationType.Q6_K, 16, 256, seed=0)
    bad = QuantMatrix(m.kind, m.q, m.d, torch.zeros(16, 8), m.rows, m.cols)
    with pytest.raises(ValueError, match="no minimums"):
        bad(torch.zeros(1, 256))


# --- a model whose file mixes block formats ----------------------------------------------------------------------

MIXED = {  # each projection in another format, Q/K/V and gate/up across forms, the head in one with minimums
    "q_proj.weight": GGMLQuantizationType.Q4_0,
    "k_proj.weight": GGMLQuantizationType.Q5_0,
    "v_proj.weight": GGMLQuantizationType.Q8_0,
    "o_proj.weight": GGMLQuantizationType.Q5_1,
    "gate_proj.weight": GGMLQuantizationType.Q4_1,
    "up_proj.weight": GGMLQuantizationType.Q5_0,
    "down_proj.weight": GGMLQuantizationType.Q8_0,
    "embed_tokens.weight": GGMLQuantizationType.Q8_0,
    "lm_head.weight": GGMLQuantizationType.Q5_1,
}


@pytest.mark.parametrize("arch", [Architecture.LLAMA, Architecture.GEMMA3], ids=lambda a: a.value)
def test_a_file_of_mixed_formats_decodes_on_its_blocks(arch: Architecture, tmp_path: Path) -> None:
    """Quantized by gguf's own quantizer; blocks are the dequantized weights, and decode on them is dense decode's."""
    path = write_gguf(random_model(arch), arch, tmp_path / "mixed.gguf", MIXED)
    (config, weights, _), blocks = load_gguf_with_blocks(path, progress=False)
    model = LlamaModel(config, weights, blocks=blocks)
    assert model.decode_layers is not None and model.lm_head_blocks is not None
    layer = model.decode_layers[0]
    assert isinstance(layer.wqkv, QuantStack) and isinstance(layer.w_gate_up, QuantStack)
    for i, quantized in enumerate(model.decode_layers):
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert torch.equal(dequantized(getattr(quantized, name)), getattr(model.layers[i], name)), (i, name)
    assert torch.equal(dequantized(model.lm_head_blocks), model.lm_head)

    prompt = [int(t) for t in torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5))]

    def greedy(on_blocks: bool) -> tuple[list[int], torch.Tensor]:
        saved = model.decode_layers, model.lm_head_blocks
        if not on_blocks:
            model.decode_layers, model.lm_head_blocks = None, None
        try:
            pool, table = model.make_pool(16, 8), BlockTable()
            pool.grow(table, len(prompt) + 24)
            logits = model.forward([SeqInput(prompt, 0, table)], pool)[-1:]
            ids, steps = [int(logits.argmax())], []
            for i in range(24):  # past the Gemma model's 16-position window
                logits = model.forward([SeqInput(ids[-1:], len(prompt) + i, table)], pool)
                steps.append(logits[-1])
                ids.append(int(logits[-1].argmax()))
            return ids, torch.stack(steps)
        finally:
            model.decode_layers, model.lm_head_blocks = saved

    (ids, logits), (dense_ids, dense_logits) = greedy(True), greedy(False)
    assert ids == dense_ids
    assert (logits - dense_logits).abs().max().item() < 1e-3
