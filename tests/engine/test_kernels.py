"""The C attention kernels (decode; prefill over cached positions) against float64 references and the torch path.

Pools are random, block ids are shuffled (a sequence's blocks are anywhere in
the pool), lengths end inside blocks, one sequence is shorter than a block,
and 9 query heads share 3 KV heads (SmolLM2's grouping). Every build the CPU
runs (``kernels.IMPLS``: AVX-512, AVX2, base) is checked, not only the one in
use.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtier.engine import BlockTable, KVPool, LlamaModel, SeqInput, kernels
from kvtier.engine.kernels import (
    NativeDecode,
    NativePrefill,
    PagedBlocks,
    TorchDecode,
    paged_attention,
    plan_decode,
    plan_prefill,
)
from kvtier.layout import KVLayout
from kvtier.model.config import ModelConfig

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LENGTHS = [5, 16, 17, 130, 300]  # shorter than a block, exactly one, one past, longer


def random_pool(dtype: torch.dtype, *, kv_heads: int = 3, head_dim: int = 64, block: int = 16) -> KVPool:
    pool = KVPool(KVLayout(2, kv_heads, head_dim, block, dtype), num_blocks=64)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(1)))
    return pool


def shuffled_tables(pool: KVPool, lengths: list[int]) -> list[BlockTable]:
    ids = torch.randperm(pool.num_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    tables = []
    for n in lengths:
        need = -(-n // pool.block_size)
        tables.append(BlockTable(ids[:need], n))
        ids = ids[need:]
    return tables


def reference(pool: KVPool, layer: int, tables: list[BlockTable], lengths: list[int], q: torch.Tensor) -> torch.Tensor:
    """Dense float64 attention of each sequence over its first ``length`` positions, one at a time."""
    out = []
    for table, n, qs in zip(tables, lengths, q, strict=True):
        kv = pool.layers[layer][torch.tensor(table.block_ids)].double()  # [blocks, 2, kv_heads, B, D]
        k, v = (kv[:, i].transpose(0, 1).flatten(1, 2)[:, :n] for i in (0, 1))  # [kv_heads, n, D]
        heads, dim = qs.shape
        qq = qs.double().view(k.shape[0], heads // k.shape[0], dim)
        probs = torch.softmax(qq @ k.transpose(-1, -2) * dim**-0.5, dim=-1)
        out.append((probs @ v).reshape(heads, dim))
    return torch.stack(out)


def queries(n: int, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(3)).to(dtype)


# -- the kernel ----------------------------------------------------------------------
def test_the_native_kernel_is_the_one_in_use_on_cpu() -> None:
    assert kernels.IMPLS and kernels.IMPLS[-1] == "base"
    pool = random_pool(torch.float32)
    assert isinstance(plan_decode(pool, shuffled_tables(pool, [20]), [20], num_heads=9), NativeDecode)


@pytest.mark.parametrize("impl", kernels.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_matches_the_float64_reference(impl: str, dtype: torch.dtype) -> None:
    pool = random_pool(dtype)
    tables = shuffled_tables(pool, LENGTHS)
    q = queries(len(LENGTHS), 9, 64, dtype)
    blocks = PagedBlocks.of(tables, LENGTHS, pool.block_size)
    for layer in range(2):
        got = paged_attention(pool.layers[layer], blocks, q, impl=impl)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.double() - reference(pool, layer, tables, LENGTHS, q)).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_matches_the_torch_path(dtype: torch.dtype) -> None:
    pool = random_pool(dtype)
    tables = shuffled_tables(pool, LENGTHS)
    q = queries(len(LENGTHS), 9, 64, dtype)
    native = plan_decode(pool, tables, LENGTHS, num_heads=9)
    torch_path = TorchDecode(pool, pool.plan_gather(tables, LENGTHS), mask_of(LENGTHS, pool.block_size))
    assert native.native and not torch_path.native
    diff = native.attend(1, q).float() - torch_path.attend(1, q).float()
    assert diff.abs().max().item() < TOL[dtype]


def mask_of(lengths: list[int], block: int) -> torch.Tensor:
    width = -(-max(lengths) // block) * block
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).view(len(lengths), 1, 1, width)


@pytest.mark.parametrize("impl", kernels.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("kv_heads", "heads", "head_dim", "block"),
    [
        (3, 9, 64, 8),
        (3, 9, 64, 24),
        (2, 2, 128, 16),
        (2, 4, 64, 16),
        (2, 10, 64, 16),
        (1, 4, 96, 16),
        (1, 3, 48, 16),
        (4, 64, 16, 32),
    ],
    ids=["block8", "block24", "mha-dim128", "group2", "group5", "dim96", "dim48", "group16"],
)
def test_native_handles_other_shapes(
    impl: str, dtype: torch.dtype, kv_heads: int, heads: int, head_dim: int, block: int
) -> None:
    """Blocks that are not one 16-position tile, head dims off the unrolled paths (and, in bf16, one not
    a multiple of 32), and groups of every size the kernel's four-heads-at-a-time V pass splits into."""
    pool = random_pool(dtype, kv_heads=kv_heads, head_dim=head_dim, block=block)
    lengths = [3, 40, 200]
    tables = shuffled_tables(pool, lengths)
    q = queries(len(lengths), heads, head_dim, dtype)
    got = paged_attention(pool.layers[0], PagedBlocks.of(tables, lengths, block), q, impl=impl)
    assert (got.double() - reference(pool, 0, tables, lengths, q)).abs().max().item() < TOL[dtype]


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    """Work is cut by the lengths alone, so reuse stays exact whatever torch.get_num_threads() says."""
    pool = random_pool(torch.float32)
    tables = shuffled_tables(pool, LENGTHS)
    blocks = PagedBlocks.of(tables, LENGTHS, pool.block_size)
    q = queries(len(LENGTHS), 9, 64, torch.float32)
    one = paged_attention(pool.layers[0], blocks, q, threads=1)
    for threads in (2, 3, 8):
        assert torch.equal(paged_attention(pool.layers[0], blocks, q, threads=threads), one)


def test_callers_on_several_threads_at_once_each_get_their_own_result() -> None:
    """One call at a time has the worker team; one that finds it busy runs alone, with the same result."""
    pool = random_pool(torch.float32)
    tables = shuffled_tables(pool, LENGTHS)
    blocks = PagedBlocks.of(tables, LENGTHS, pool.block_size)
    qs = [queries(len(LENGTHS), 9, 64, torch.float32) * (i + 1) for i in range(4)]
    want = [paged_attention(pool.layers[0], blocks, q, threads=2) for q in qs]
    with ThreadPoolExecutor(4) as ex:
        for _ in range(20):
            got = list(ex.map(lambda q: paged_attention(pool.layers[0], blocks, q, threads=2), qs))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_bad_block_tables_are_refused_before_reading_the_pool() -> None:
    pool = random_pool(torch.float32)
    q = queries(1, 9, 64, torch.float32)
    outside = PagedBlocks.of([BlockTable([3, pool.num_blocks], 20)], [20], pool.block_size)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_attention(pool.layers[0], outside, q)
    too_few = PagedBlocks(
        torch.tensor([3], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([20], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match="fewer blocks"):
        paged_attention(pool.layers[0], too_few, q)
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(pool.layers[0], too_few, q.to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        paged_attention(pool.layers[0], too_few, queries(2, 9, 64, torch.float32))


WINDOW = 37  # off every block edge, shorter than most LENGTHS


def windowed_reference(
    pool: KVPool, layer: int, tables: list[BlockTable], lengths: list[int], q: torch.Tensor, window: int
) -> torch.Tensor:
    """Dense float64 attention of each new token over its last ``window`` positions."""
    out = []
    for table, n, qs in zip(tables, lengths, q, strict=True):
        kv = pool.layers[layer][torch.tensor(table.block_ids)].double()
        k, v = (kv[:, i].transpose(0, 1).flatten(1, 2)[:, max(0, n - window) : n] for i in (0, 1))
        heads, dim = qs.shape
        qq = qs.double().view(k.shape[0], heads // k.shape[0], dim)
        probs = torch.softmax(qq @ k.transpose(-1, -2) * dim**-0.5, dim=-1)
        out.append((probs @ v).reshape(heads, dim))
    return torch.stack(out)


def poison_before_windows(pool: KVPool, layer: int, tables: list[BlockTable], lengths: list[int], window: int) -> None:
    """NaN in every position a window leaves out: what a windowed load leaves unloaded, there to be never read."""
    for table, n in zip(tables, lengths, strict=True):
        for pos in range(max(0, n - window)):
            block, row = table.block_ids[pos // pool.block_size], pos % pool.block_size
            pool.layers[layer][block, :, :, row] = float("nan")


@pytest.mark.parametrize("impl", kernels.IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_windowed_decode_matches_the_float64_reference_and_reads_nothing_before_the_window(
    impl: str, dtype: torch.dtype
) -> None:
    pool = random_pool(dtype)
    tables = shuffled_tables(pool, LENGTHS)
    poison_before_windows(pool, 0, tables, LENGTHS, WINDOW)
    q = queries(len(LENGTHS), 9, 64, dtype)
    got = paged_attention(pool.layers[0], PagedBlocks.of(tables, LENGTHS, 16), q, impl=impl, window=WINDOW)
    assert not got.isnan().any()
    assert (got.double() - windowed_reference(pool, 0, tables, LENGTHS, q, WINDOW)).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_windowed_decode_takes_the_kernel_and_agrees_with_the_torch_path(dtype: torch.dtype) -> None:
    pool = random_pool(dtype)
    tables = shuffled_tables(pool, LENGTHS)
    q = queries(len(LENGTHS), 9, 64, dtype)
    native = plan_decode(pool, tables, LENGTHS, num_heads=9, window=WINDOW)
    assert isinstance(native, NativeDecode)
    width = -(-max(LENGTHS) // pool.block_size) * pool.block_size
    n = torch.tensor(LENGTHS)[:, None]
    positions = torch.arange(width)[None, :]
    mask = ((positions < n) & (positions >= n - WINDOW)).view(len(LENGTHS), 1, 1, width)
    torch_path = TorchDecode(pool, pool.plan_gather(tables, LENGTHS), mask)
    diff = native.attend(1, q).float() - torch_path.attend(1, q).float()
    assert diff.abs().max().item() < TOL[dtype]


def test_a_window_not_yet_reached_changes_no_bit_and_a_sequence_is_alone_in_its_batch() -> None:
    """Up to its window a sliding layer is a global one; past it, a sequence's result is the same bits
    alone or beside others (prompt lookup's verify rows), since its cut depends on its own length."""
    pool = random_pool(torch.bfloat16)
    tables = shuffled_tables(pool, LENGTHS)
    q = queries(len(LENGTHS), 9, 64, torch.bfloat16)
    blocks = PagedBlocks.of(tables, LENGTHS, 16)
    plain = paged_attention(pool.layers[0], blocks, q)
    windowed = paged_attention(pool.layers[0], blocks, q, window=WINDOW)
    short = [i for i, n in enumerate(LENGTHS) if n <= WINDOW]
    assert short and torch.equal(windowed[short], plain[short])
    for i, (table, n) in enumerate(zip(tables, LENGTHS, strict=True)):
        alone = paged_attention(pool.layers[0], PagedBlocks.of([table], [n], 16), q[i : i + 1], window=WINDOW)
        assert torch.equal(alone[0], windowed[i])
    with pytest.raises(ValueError, match="window"):
        paged_attention(pool.layers[0], blocks, q, window=-1)


def test_pools_the_kernel_does_not_take_get_the_torch_path() -> None:
    pages = random_pool(torch.float8_e5m2)  # another engine's fp8 pages: no row scales, not kvtier's own
    assert isinstance(plan_decode(pages, shuffled_tables(pages, [20]), [20], num_heads=9), TorchDecode)
    odd_dim = random_pool(torch.float32, head_dim=24)
    assert isinstance(plan_decode(odd_dim, shuffled_tables(odd_dim, [20]), [20], num_heads=9), TorchDecode)


# -- the prefill kernel --------------------------------------------------------------


def prefill_reference(
    pool: KVPool, layer: int, table: BlockTable, start: int, q: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Dense float64 causal attention: new token i (of q [T, heads, D]) sees positions <= start + i
    (and, with a ``window``, > start + i - window)."""
    total = start + len(q)
    kv = pool.layers[layer][torch.tensor(table.block_ids)].double()
    k, v = (kv[:, i].transpose(0, 1).flatten(1, 2)[:, :total] for i in (0, 1))  # [kv_heads, total, D]
    tokens, heads, dim = q.shape
    qq = q.double().transpose(0, 1).reshape(k.shape[0], heads // k.shape[0], tokens, dim)
    scores = qq @ k[:, None].transpose(-1, -2) * dim**-0.5  # [kv_heads, group, T, total]
    allowed = torch.arange(total)[None, :] <= torch.arange(start, total)[:, None]
    if window is not None:
        allowed &= torch.arange(total)[None, :] > torch.arange(start, total)[:, None] - window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v[:, None]).reshape(heads, tokens, dim).transpose(0, 1)


def prefill(
    pool: KVPool,
    start: int,
    tokens: int,
    heads: int,
    dtype: torch.dtype,
    *,
    threads: int | None = None,
    impl: str | None = None,
    window: int | None = None,
) -> tuple[NativePrefill, BlockTable, torch.Tensor]:
    """A plan for ``tokens`` new positions after ``start`` cached ones (shuffled blocks), and their queries."""
    (table,) = shuffled_tables(pool, [start + tokens])
    q = queries(tokens, heads, pool.layout.head_dim, dtype)
    plan = NativePrefill(pool.layers, table, start, tokens, heads, threads=threads, impl=impl, window=window)
    return plan, table, q


def test_the_prefill_kernel_is_the_one_in_use_on_cpu() -> None:
    assert kernels.PREFILL_IMPLS and kernels.PREFILL_IMPLS[-1] == "base"
    pool = random_pool(torch.float32)
    (table,) = shuffled_tables(pool, [100])
    assert isinstance(plan_prefill(pool, table, 36, 64, num_heads=9), NativePrefill)
    assert plan_prefill(pool, table, 0, 100, num_heads=9) is None  # from nothing: SDPA's causal kernel
    assert plan_prefill(random_pool(torch.float8_e5m2), table, 36, 64, num_heads=9) is None


@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("start", "tokens"),
    [(0, 40), (5, 1), (16, 17), (130, 64), (300, 150)],
    ids=["from-nothing", "one-token", "tile-edges", "agent-turn", "several-units"],
)
def test_prefill_matches_the_float64_reference(impl: str, dtype: torch.dtype, start: int, tokens: int) -> None:
    """150 new tokens of 3 heads per KV head are 450 query rows: five units of at most 96 per KV head."""
    pool = random_pool(dtype)
    plan, table, q = prefill(pool, start, tokens, 9, dtype, impl=impl)
    for layer in range(2):
        got = plan.attend(layer, q)
        assert got.dtype == dtype and got.shape == q.shape
        assert (got.double() - prefill_reference(pool, layer, table, start, q)).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
@pytest.mark.parametrize(
    ("kv_heads", "heads", "head_dim", "block"),
    [(3, 9, 64, 5), (3, 9, 64, 24), (2, 2, 128, 16), (2, 10, 64, 16), (1, 3, 48, 16), (4, 64, 16, 32)],
    ids=["block5", "block24", "mha-dim128", "group5", "dim48", "group16"],
)
def test_prefill_handles_other_shapes(impl: str, kv_heads: int, heads: int, head_dim: int, block: int) -> None:
    """Blocks that are not one 16-position tile (partial tiles are copied and masked), panels of 24 rows
    that cut through a token's heads, and the largest group."""
    pool = random_pool(torch.float32, kv_heads=kv_heads, head_dim=head_dim, block=block)
    plan, table, q = prefill(pool, 23, 41, heads, torch.float32, impl=impl)
    got = plan.attend(0, q)
    assert (got.double() - prefill_reference(pool, 0, table, 23, q)).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("start", "tokens", "window"),
    [(0, 150, 40), (130, 64, 50), (300, 150, 17), (60, 20, 100), (200, 1, 33)],
    ids=["from-nothing", "agent-turn", "units-past-window", "window-not-reached", "one-token"],
)
def test_a_windowed_prefill_matches_the_float64_reference(
    impl: str, dtype: torch.dtype, start: int, tokens: int, window: int
) -> None:
    """A sliding-window layer: each token sees its last ``window`` positions only, off tile and block edges."""
    pool = random_pool(dtype)
    plan, table, q = prefill(pool, start, tokens, 9, dtype, impl=impl, window=window)
    got = plan.attend(1, q)
    want = prefill_reference(pool, 1, table, start, q, window)
    assert (got.double() - want).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("impl", kernels.PREFILL_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_windowed_token_is_the_same_bits_however_the_prompt_was_cut(impl: str, dtype: torch.dtype) -> None:
    """What makes reuse exact on a sliding-window layer: a token computed in one long prefill, in a short
    tail over a cached prefix, or alone, beside other rows whose windows start elsewhere, gives the same bits."""
    pool = random_pool(dtype)
    (table,) = shuffled_tables(pool, [300])
    q = queries(300, 9, pool.layout.head_dim, dtype)
    whole = NativePrefill(pool.layers, table, 0, 300, 9, impl=impl, window=37).attend(0, q)
    for start, stop in [(0, 77), (77, 200), (200, 201), (201, 300)]:
        part = NativePrefill(pool.layers, table, start, stop - start, 9, impl=impl, window=37).attend(0, q[start:stop])
        assert torch.equal(part, whole[start:stop]), (start, stop)


def test_prefill_results_do_not_depend_on_the_thread_count() -> None:
    """Each query row is computed alone, in one order of tiles, whichever thread takes its unit."""
    pool = random_pool(torch.float32)
    one, _, q = prefill(pool, 200, 100, 9, torch.float32, threads=1)
    want = one.attend(1, q)
    for threads in (2, 3, 8):
        plan, _, _ = prefill(pool, 200, 100, 9, torch.float32, threads=threads)
        assert torch.equal(plan.attend(1, q), want)


def test_prefill_refuses_bad_tables_and_queries() -> None:
    pool = random_pool(torch.float32)
    q = queries(10, 9, 64, torch.float32)
    with pytest.raises(ValueError, match="outside the pool"):
        NativePrefill(pool.layers, BlockTable([3, pool.num_blocks], 20), 10, 10, 9).attend(0, q)
    with pytest.raises(ValueError, match="fewer blocks"):
        NativePrefill(pool.layers, BlockTable([3], 16), 10, 10, 9).attend(0, q)
    plan, _, _ = prefill(pool, 10, 10, 9, torch.float32)
    with pytest.raises(ValueError, match="does not fit"):
        plan.attend(0, q[:5])
    with pytest.raises(ValueError, match="does not take"):
        NativePrefill(random_pool(torch.float8_e5m2).layers, BlockTable([1, 2], 20), 10, 10, 9)


# -- in the engine -------------------------------------------------------------------
def toy_model() -> LlamaModel:
    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=96,
        intermediate_size=64,
        num_layers=2,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        context_length=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    g = torch.Generator().manual_seed(4)
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            f"{p}self_attn.q_proj.weight": (cfg.num_heads * d, h),
            f"{p}self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
            f"{p}self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
            f"{p}self_attn.o_proj.weight": (h, cfg.num_heads * d),
            f"{p}input_layernorm.weight": (h,),
            f"{p}post_attention_layernorm.weight": (h,),
            f"{p}mlp.gate_proj.weight": (cfg.intermediate_size, h),
            f"{p}mlp.up_proj.weight": (cfg.intermediate_size, h),
            f"{p}mlp.down_proj.weight": (h, cfg.intermediate_size),
        }
    return LlamaModel(cfg, {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()})


def decode_logits(model: LlamaModel, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill each prompt, then one batched decode step; the decode step's logits."""
    pool = model.make_pool(16, 32)
    tables = [BlockTable() for _ in prompts]
    for t, ids in zip(tables, prompts, strict=True):
        pool.grow(t, len(ids) + 1)
        model.forward([SeqInput(ids, 0, t)], pool)
    return model.forward([SeqInput([7], t.num_tokens, t) for t in tables], pool)


def test_the_engine_decodes_through_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    model = toy_model()
    prompts = [list(range(1, 40)), [3, 1, 4, 1, 5]]
    calls = []
    real = NativeDecode.attend

    def spy(self: NativeDecode, layer: int, q: torch.Tensor) -> torch.Tensor:
        calls.append(layer)
        return real(self, layer, q)

    monkeypatch.setattr(NativeDecode, "attend", spy)
    native = decode_logits(model, prompts)
    assert calls == list(range(model.config.num_layers))  # one call per layer for the whole batch
    monkeypatch.setattr(kernels, "native_fits", lambda *a, **kw: False)
    via_torch = decode_logits(model, prompts)
    assert len(calls) == model.config.num_layers  # the torch path ran this time
    assert (native - via_torch).abs().max().item() < 1e-4


def test_the_engine_prefills_on_cached_positions_through_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's tail on top of its cached head: one kernel call per layer, logits as the torch path's."""
    model = toy_model()
    ids = [int(t) for t in torch.randint(1, 50, (90,), generator=torch.Generator().manual_seed(5))]
    calls = []
    real = NativePrefill.attend

    def spy(self: NativePrefill, layer: int, q: torch.Tensor) -> torch.Tensor:
        calls.append(layer)
        return real(self, layer, q)

    def tail_logits() -> torch.Tensor:
        pool, table = model.make_pool(16, 8), BlockTable()
        pool.grow(table, len(ids))
        model.forward([SeqInput(ids[:50], 0, table)], pool)
        return model.forward([SeqInput(ids[50:], 50, table)], pool)

    monkeypatch.setattr(NativePrefill, "attend", spy)
    native = tail_logits()
    assert calls == list(range(model.config.num_layers))  # the head's prefill (from nothing) took SDPA
    monkeypatch.setattr(kernels, "native_fits", lambda *a, **kw: False)
    via_torch = tail_logits()
    assert len(calls) == model.config.num_layers
    assert (native - via_torch).abs().max().item() < 1e-4
