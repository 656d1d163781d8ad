"""Attention over the paged pool by C kernels that read K/V in place, or by torch's gather-then-matmul.

A decode step is one new token per sequence, each attending to all of its
cached positions. At context 2,048 that is megabytes of K/V per layer
against a few hundred multiply-adds per position, so the cost is reading
them: the torch path copies every layer's K/V of each sequence out of its
blocks (``index_select``) and then reads the copy twice (``q @ K``, then
``probs @ V``); the C kernel (``paged_decode_attention`` in
``native/decode_attention.c``) walks the blocks where they lie and reads each
byte once, with an online softmax in float32, on two threads.

Which one runs is chosen once per forward by :func:`plan_decode`:

* :class:`NativeDecode` where the extension has the kernel, the pool is on
  the CPU in float32, bfloat16 or int8 (an 8-bit pool has no other path),
  and the shapes fit it (head_dim a multiple
  of 16, at most 256; at most 16 query heads per KV head; blocks of at most
  256 positions);
* :class:`TorchDecode` everywhere else (CUDA, float16, an extension built
  before the kernel existed): ``matmul → softmax(float32) → matmul`` over
  gathered, padded K/V.

Both compute ``softmax(q·K / sqrt(head_dim)) V`` over exactly the first
``length`` positions of each sequence, with the query heads ``i*group ..
(i+1)*group - 1`` sharing KV head ``i``. They differ only in rounding: the
C kernel accumulates in float32 whatever the pool dtype, where torch's
bfloat16 matmuls round the scores and probabilities to bfloat16.

A prefill on top of cached positions (an agent's next turn: a long cached
transcript and a few dozen new tokens) has the same problem in another
shape: torch gathers the sequence's K/V out of its blocks and runs SDPA
with a shifted causal mask, paying for the copy and the mask on top of the
arithmetic. :class:`NativePrefill` runs ``paged_prefill_attention``
(``native/kvtier_prefill.c``) instead, the query rows in the vector lanes
and K/V read where they lie, so it pays for neither (bench/README.md has
the figures). :func:`plan_prefill` picks it where it fits, as
:func:`plan_decode` does; a prefill from nothing keeps SDPA's causal
kernel, which needs no gather and is as fast there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from kvtier import extension
from kvtier.engine.pool import BlockTable, Gather, KVPool, blocks_for

_native = extension.kernels

IMPLS: tuple[str, ...] = _native.paged_decode_attention_impls()
"""The C kernel's builds this CPU runs, best first (``avx512``, ``avx2``, ``base``): the first is the one used."""

PREFILL_IMPLS: tuple[str, ...] = _native.paged_prefill_attention_impls()
"""The prefill kernel's builds this CPU runs, best first (``avx2``, ``base``)."""

EIGHT_BIT_DTYPES = (torch.int8, torch.float8_e4m3fn)
"""8-bit pools' quants: int8 or float8 e4m3, each row's scale after its layer's quants
(:class:`~kvtier.layout.KVLayout`)."""

WIDENED_DTYPES = (torch.float16, *EIGHT_BIT_DTYPES)
"""Pools whose dtype is not the model's: the C kernels widen their K/V to q's float32 or bfloat16 as they read."""

NATIVE_DTYPES = (torch.float32, torch.bfloat16, *WIDENED_DTYPES)
"""Pools the C kernels read: the model's own float32 or bfloat16, and the widened ones."""
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256


@dataclass(frozen=True)
class PagedBlocks:
    """Several sequences' block tables flattened for the C kernel (built once per forward, used by every layer).

    Sequence *s* holds positions ``[0, lengths[s])`` in blocks
    ``ids[starts[s]:starts[s + 1]]``, only as many as those positions need.
    """

    ids: torch.Tensor  # int32 [total blocks]
    starts: torch.Tensor  # int32 [S + 1]
    lengths: torch.Tensor  # int32 [S]

    @classmethod
    def of(cls, tables: Sequence[BlockTable], lengths: Sequence[int], block_size: int) -> PagedBlocks:
        used = [t.block_ids[: blocks_for(n, block_size)] for t, n in zip(tables, lengths, strict=True)]
        starts = [0]
        for ids in used:
            starts.append(starts[-1] + len(ids))
        return cls(
            ids=torch.tensor([b for ids in used for b in ids], dtype=torch.int32),
            starts=torch.tensor(starts, dtype=torch.int32),
            lengths=torch.tensor(list(lengths), dtype=torch.int32),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)


def native_fits(layer_kv: torch.Tensor, num_heads: int) -> bool:
    """Whether the C kernel can attend over this pool layer (``[blocks, 2, kv_heads, block, dim]``)."""
    _, _, kv_heads, block, dim = layer_kv.shape
    return (
        layer_kv.device.type == "cpu"
        and layer_kv.dtype in NATIVE_DTYPES
        and (layer_kv.dtype not in EIGHT_BIT_DTYPES or layer_kv.stride(1) == kv_heads * block * dim)  # scales after
        and layer_kv.stride(-1) == 1
        and layer_kv.stride(-2) == dim
        and num_heads % kv_heads == 0
        and num_heads // kv_heads <= MAX_GROUP
        and dim % 16 == 0
        and dim <= MAX_HEAD_DIM
        and block <= MAX_BLOCK
    )


def paged_attention(
    layer_kv: torch.Tensor,
    blocks: PagedBlocks,
    q: torch.Tensor,
    *,
    threads: int | None = None,
    impl: str | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention of ``q [S, heads, dim]`` over one pool layer, by the C kernel; ``[S, heads, dim]``.

    ``layer_kv`` is a pool layer ``[blocks, 2, kv_heads, block_size, dim]``
    (``pool.layers[l]``); the C side checks every block id against it and
    each sequence's block count against its length. See :class:`NativeDecode`
    for ``threads`` and ``impl``.
    """
    return NativeDecode([layer_kv], blocks, q.shape[1], threads=threads, impl=impl, window=window).attend(0, q)


def gathered_attention(keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The torch path: ``q [S, heads, D]`` against gathered ``keys``/``values [S, kv_heads, T, D]``.

    ``mask [S, 1, 1, T]`` is True where a position exists. Plain ``matmul →
    softmax → matmul`` measured a little faster than SDPA with the padding
    mask (see kvtier/engine/llama.py); the softmax runs in float32, as SDPA's
    kernel does internally.
    """
    s, heads, dim = q.shape
    kv_heads = keys.shape[1]
    q = q.reshape(s, kv_heads, heads // kv_heads, dim)  # heads i*group.. share KV i
    scores = (q @ keys.transpose(-1, -2)).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores * dim**-0.5, dim=-1, dtype=torch.float32).to(values.dtype)
    return (probs @ values).reshape(s, heads, dim)


def element_args(layer: torch.Tensor) -> dict[str, Any]:
    """What a pool layer's elements are, as the C kernels' keywords (attention and the rope writer alike):
    for an 8-bit pool where a block's scales start in its layer range (its K and V quants' bytes; -1 for a
    float pool) and whether its quants are float8 e4m3, and whether the pool is float16."""
    scales = 2 * layer.stride(1) if layer.dtype in EIGHT_BIT_DTYPES else -1
    return {"int8_scales": scales, "fp8": layer.dtype == torch.float8_e4m3fn, "f16": layer.dtype == torch.float16}


def _pool_args(layers: Sequence[torch.Tensor]) -> tuple[list[int], tuple[tuple[int, ...], int], dict[str, Any]]:
    """What both C attention kernels take of a pool: each layer's address, (strides, block count), and
    :func:`element_args`."""
    first = layers[0]  # all views of one pool tensor: the same shape, strides and dtype
    return [t.data_ptr() for t in layers], (first.stride()[:4], first.shape[0]), element_args(first)


def _q_fits(q: torch.Tensor, want: tuple[torch.dtype, torch.device, torch.Size], pool_dtype: torch.dtype) -> None:
    """Refuses a q of another shape or device than planned, or another dtype than the pool's (a widened pool's
    q is float32 or bfloat16, the model's)."""
    dtype, device, shape = want
    ok_dtype = q.dtype in (torch.float32, torch.bfloat16) if pool_dtype in WIDENED_DTYPES else q.dtype == dtype
    if not ok_dtype or q.device != device or q.shape != shape:
        raise ValueError(f"q {q.dtype} {tuple(q.shape)} on {q.device} does not fit this plan's {want}")


class DecodePlan(Protocol):
    """A batch of decoding sequences, planned once per forward; ``attend`` runs one layer."""

    @property
    def native(self) -> bool:
        """Whether the C kernel runs it."""
        ...

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...


class NativeDecode:
    """The C kernel over a pool's layers for one batch, every argument but q worked out once per forward.

    Per layer that leaves one C call and an output allocation: building the
    arguments every layer would cost Python more than the call itself.
    ``threads`` defaults to torch's intra-op thread count: torch's own
    threads sit idle during the call, and the result is the same bits
    whatever the count. ``impl`` picks one of :data:`IMPLS`
    rather than the best (for tests). ``window``: a sliding-window layer's,
    each token seeing its last ``window`` positions; the kernel reads
    nothing before them, which a windowed load may have left unloaded.
    """

    native: ClassVar[bool] = True

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        blocks: PagedBlocks,
        num_heads: int,
        *,
        threads: int | None = None,
        impl: str | None = None,
        window: int | None = None,
    ) -> None:
        first = layers[0]  # all views of one pool tensor: the same shape, strides and dtype
        if not native_fits(first, num_heads):
            raise ValueError(f"the C kernel does not take a {first.dtype} pool {tuple(first.shape)} on {first.device}")
        self._window = window or 0
        _, _, kv_heads, block, dim = first.shape
        self.layers, self.blocks = layers, blocks  # kept alive while C reads them by address
        self._q = (first.dtype, first.device, torch.Size((blocks.num_seqs, num_heads, dim)))
        self._addrs, self._pool, self._kv8 = _pool_args(layers)
        self._rest = (
            *(t.data_ptr() for t in (blocks.ids, blocks.starts, blocks.lengths)),
            blocks.num_seqs,
            kv_heads,
            num_heads // kv_heads,
            dim,
            block,
            dim**-0.5,
            threads or torch.get_num_threads(),
        )
        self._impl = impl

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        _q_fits(q, self._q, self.layers[0].dtype)
        q = q.contiguous()
        out = torch.empty_like(q)
        bf16 = q.dtype == torch.bfloat16
        args = (self._addrs[layer], *self._pool, bf16, q.data_ptr(), out.data_ptr(), *self._rest)
        if self._impl is None:
            _native.paged_decode_attention(*args, window=self._window, **self._kv8)
        else:
            _native._paged_decode_attention_using(self._impl, *args, window=self._window, **self._kv8)
        return out


@dataclass(frozen=True)
class TorchDecode:
    """The torch path: each layer's K/V gathered into one padded buffer (:meth:`KVPool.plan_gather`), then
    :func:`gathered_attention` with the padding masked."""

    pool: KVPool
    gather: Gather
    mask: torch.Tensor  # bool [S, 1, 1, padded length], True where a cached position exists
    native: ClassVar[bool] = False

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        keys, values = self.pool.gather(layer, self.gather)
        return gathered_attention(keys, values, self.mask, q)


class NativePrefill:
    """One sequence's new tokens against its cached and new positions, by the C kernel, across a forward's layers.

    The arguments but q are worked out once per forward; every layer is one
    C call. The new tokens' K/V must be in the pool before :meth:`attend`
    (the forward writes each layer's first). ``threads`` and ``impl`` as for
    :class:`NativeDecode`; the result is the same bits on any thread count.
    ``window``: a sliding-window layer's (each token sees its last ``window``
    positions); a token's result is the same bits however the prompt was cut.
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        table: BlockTable,
        start: int,
        tokens: int,
        num_heads: int,
        *,
        threads: int | None = None,
        impl: str | None = None,
        window: int | None = None,
    ) -> None:
        first = layers[0]
        self._window = window or 0
        if not native_fits(first, num_heads):
            raise ValueError(
                f"the prefill kernel does not take a {first.dtype} pool {tuple(first.shape)} on {first.device}"
            )
        _, _, kv_heads, block, dim = first.shape
        self.layers = layers  # kept alive while C reads them by address
        self.ids = torch.tensor(table.block_ids[: blocks_for(start + tokens, block)], dtype=torch.int32)
        self._q = (first.dtype, first.device, torch.Size((tokens, num_heads, dim)))
        self._addrs, self._pool, self._kv8 = _pool_args(layers)
        self._rest = (
            self.ids.data_ptr(),
            len(self.ids),
            start,
            tokens,
            kv_heads,
            num_heads // kv_heads,
            dim,
            block,
            dim**-0.5,
            threads or torch.get_num_threads(),
            impl,
        )

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q [tokens, heads, dim]`` of this layer's new tokens; their attention output, the same shape."""
        _q_fits(q, self._q, self.layers[0].dtype)
        q = q.contiguous()
        out = torch.empty_like(q)
        bf16 = q.dtype == torch.bfloat16
        _native.paged_prefill_attention(
            self._addrs[layer],
            *self._pool,
            bf16,
            q.data_ptr(),
            out.data_ptr(),
            *self._rest,
            window=self._window,
            **self._kv8,
        )
        return out


def plan_prefill(
    pool: KVPool, table: BlockTable, start: int, tokens: int, num_heads: int, *, window: int | None = None
) -> NativePrefill | None:
    """The C kernel for ``tokens`` new positions after ``start`` cached ones, or None where it does not fit.

    After cached positions always (no gather, no mask). At position 0 only
    for a bfloat16 pool: there it is faster than SDPA's flash kernel, and
    its reduction order does not depend on where the prompt was cut, so the
    KV of every token is the same bits whatever the chunks were (what makes
    bf16 reuse exact); in float32 SDPA is the faster of the two there. And
    always for a pool not in the model's dtype (8-bit or float16): every
    token must attend to the K/V the pool holds, as a later turn reading
    them from a tier will, never to the unrounded ones SDPA would be handed.
    """
    if start == 0 and pool.layers[0].dtype == torch.float32:
        return None
    if native_fits(pool.layers[0], num_heads):
        return NativePrefill(pool.layers, table, start, tokens, num_heads, window=window)
    return None


def plan_decode(
    pool: KVPool, tables: Sequence[BlockTable], lengths: Sequence[int], num_heads: int, *, window: int | None = None
) -> DecodePlan:
    """The decode attention for these sequences (each attending to its first ``lengths[i]`` positions).

    ``window``: a sliding-window layer's, each token seeing only its last
    ``window`` positions (the C kernel starts each sequence at its window;
    torch's path masks the rest).
    """
    if native_fits(pool.layers[0], num_heads):
        return NativeDecode(pool.layers, PagedBlocks.of(tables, lengths, pool.block_size), num_heads, window=window)
    gather = pool.plan_gather(tables, lengths)
    width = gather.num_blocks * pool.block_size
    n = torch.tensor(list(lengths))
    positions = torch.arange(width)[None, :]
    mask = positions < n[:, None]
    if window is not None:
        mask &= positions >= n[:, None] - window
    mask = mask.view(len(lengths), 1, 1, width)
    return TorchDecode(pool, gather, mask.to(pool.device))
