"""SGLang's HiCache host pages as kvtier blocks: where each byte of a page goes, and what a page is called.

SGLang offloads KV from the GPU into a host pool (``MHATokenToKVPoolHost``)
whose one tensor, ``kv_buffer``, is laid out in one of several orders
(``--hicache-mem-layout``). HiCache moves a *page* at a time (``page_size``
tokens, every layer of this rank, K and V) between that pool and an L3
storage backend, under a string key SGLang computes per page: a SHA-256
chained over the page's tokens and every token before it.

kvtier stores one page as one named block, in its own layer-major order
``[layers][K|V][kv_heads][page_size][head_dim]`` (:mod:`kvtier.layout`),
whatever SGLang's order: the bytes of a block mean the same thing to every
tier and every tool, and a page saved from a ``page_first`` pool loads into a
``layer_first`` one. A copy between the two orders is strided rather than one
memcpy; it is still the only copy each way.

Each supported host layout is one row of :data:`BUFFER_AXES` (the axes of
``kv_buffer`` in memory order, as SGLang's ``init_kv_buffer`` allocates them);
every view below is derived from that row, so the orders are never spelled
out twice. Pure torch, no SGLang import: this module is tested without it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.layout import KVLayout

SGLANG_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The KV dtypes of SGLang host pools kvtier carries."""


class Axis(enum.Enum):
    KV = "kv"  # 0 = K, 1 = V
    LAYER = "layer"
    PAGE = "page"  # a page number (only where the buffer is cut into pages)
    TOKEN = "token"  # a token index: over the whole pool, or inside a page where PAGE exists
    HEAD = "head"
    DIM = "dim"


BLOCK_AXES = (Axis.LAYER, Axis.KV, Axis.HEAD, Axis.TOKEN, Axis.DIM)
"""kvtier's block, :attr:`kvtier.layout.LayoutOrder.LAYER_MAJOR`."""


class HostLayout(enum.StrEnum):
    """SGLang's MHA host layouts kvtier stores (``page_unified`` packs heads in groups, and is refused)."""

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"


A = Axis
BUFFER_AXES: dict[HostLayout, tuple[Axis, ...]] = {
    HostLayout.LAYER_FIRST: (A.KV, A.LAYER, A.TOKEN, A.HEAD, A.DIM),
    HostLayout.PAGE_FIRST: (A.KV, A.TOKEN, A.LAYER, A.HEAD, A.DIM),
    HostLayout.PAGE_FIRST_DIRECT: (A.KV, A.PAGE, A.LAYER, A.TOKEN, A.HEAD, A.DIM),
    HostLayout.PAGE_HEAD: (A.KV, A.PAGE, A.HEAD, A.TOKEN, A.LAYER, A.DIM),
}


@dataclass(frozen=True)
class PageGeometry:
    """One rank's page: its layers and KV heads (this rank's slice of them), tokens, head dim, dtype."""

    layout: HostLayout
    num_layers: int
    num_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def kv_layout(self) -> KVLayout:
        """The kvtier block one page is: the service must hold exactly this (its handshake checks)."""
        return KVLayout(self.num_layers, self.num_heads, self.head_dim, self.page_size, self.dtype)

    @property
    def buffer_axes(self) -> tuple[Axis, ...]:
        return BUFFER_AXES[self.layout]

    @property
    def page_axes(self) -> tuple[Axis, ...]:
        """One page's axes in SGLang's memory order: the buffer's, less the page number."""
        return tuple(a for a in self.buffer_axes if a is not Axis.PAGE)

    def _size(self, axis: Axis, pool_pages: int) -> int:
        sizes = {Axis.KV: 2, Axis.LAYER: self.num_layers, Axis.HEAD: self.num_heads, Axis.DIM: self.head_dim}
        if axis is Axis.PAGE:
            return pool_pages
        if axis is Axis.TOKEN:
            return self.page_size if Axis.PAGE in self.buffer_axes else pool_pages * self.page_size
        return sizes[axis]

    def buffer_shape(self, pool_pages: int) -> tuple[int, ...]:
        return tuple(self._size(a, pool_pages) for a in self.buffer_axes)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """The shape of one page in SGLang's order: also what its flat data pages hold, flattened."""
        return tuple(self.page_size if a is Axis.TOKEN else self._size(a, 1) for a in self.page_axes)

    @property
    def to_block(self) -> tuple[int, ...]:
        """The permutation that takes a page's axes to :data:`BLOCK_AXES`."""
        return tuple(self.page_axes.index(a) for a in BLOCK_AXES)

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat data page (SGLang's ``get_data_page(flat=True)``, ``get_dummy_flat_data_page``) in block order."""
        return flat.view(self.page_shape).permute(self.to_block)


class HostPages:
    """One SGLang host pool's ``kv_buffer``, read and written a page at a time as kvtier blocks."""

    def __init__(self, buffer: torch.Tensor, geometry: PageGeometry) -> None:
        self.geometry = geometry
        if geometry.dtype not in SGLANG_KV_DTYPES:  # fp8 pages are carried for vLLM only, where they are tested
            raise ValueError(f"unsupported KV dtype {geometry.dtype} for SGLang: float32, bfloat16 or float16")
        self.layout = geometry.kv_layout
        g = geometry
        pages = 0
        if buffer.dim() == len(g.buffer_axes):
            axis = Axis.PAGE if Axis.PAGE in g.buffer_axes else Axis.TOKEN
            pages = buffer.shape[g.buffer_axes.index(axis)] // (1 if axis is Axis.PAGE else g.page_size)
        want = g.buffer_shape(max(pages, 1))
        if tuple(buffer.shape) != want or buffer.dtype != g.dtype:
            raise ValueError(
                f"SGLang's host KV buffer is {tuple(buffer.shape)} {buffer.dtype}; a {g.layout.value} MHA pool"
                f" of this geometry is {want} {g.dtype}"
            )
        if buffer.device.type != "cpu":
            raise ValueError(f"SGLang's host KV buffer is on {buffer.device}; kvtier copies from host memory")
        self.buffer = buffer
        self.num_pages = pages

    def page(self, index: int) -> torch.Tensor:
        """The page that starts at token ``index`` of the pool, as a view in block order (no copy)."""
        g = self.geometry
        if index % g.page_size or not 0 <= index < self.num_pages * g.page_size:
            raise IndexError(f"token {index} does not start one of the pool's {self.num_pages} pages of {g.page_size}")
        if Axis.PAGE in g.buffer_axes:
            view = self.buffer.select(g.buffer_axes.index(Axis.PAGE), index // g.page_size)
        else:
            view = self.buffer.narrow(g.buffer_axes.index(Axis.TOKEN), index, g.page_size)
        return view.permute(g.to_block)

    def read(self, index: int, out: torch.Tensor) -> None:
        """Copy the page at ``index`` into ``out``, one block's ``uint8`` payload (a slot of the service's slab)."""
        self.layout.as_blocks(out).copy_(self.page(index))

    def write(self, index: int, payload: torch.Tensor) -> None:
        """Copy one block's ``uint8`` payload into the page at ``index``: the one copy of a load."""
        self.page(index).copy_(self.layout.as_blocks(payload))


def host_pages(pool: Any) -> HostPages:
    """The pages of SGLang host pool ``pool``; ``ValueError`` naming what kvtier cannot store.

    Read through the attributes every ``MHATokenToKVPoolHost`` has rather than
    its class, so that this module needs no SGLang import; an MLA pool, a
    K-only pool or an asymmetric one (V narrower than K) fails the checks.
    """
    name = type(pool).__name__
    raw = getattr(pool, "layout", None)
    try:
        layout = HostLayout(raw)
    except ValueError:
        supported = ", ".join(v.value for v in HostLayout)
        raise ValueError(f"kvtier stores SGLang host layouts {supported}; {name} is {raw!r}") from None
    buffer = getattr(pool, "kv_buffer", None)
    head_dim = getattr(pool, "head_dim", None)
    if not isinstance(buffer, torch.Tensor) or head_dim is None or not hasattr(pool, "head_num"):
        raise ValueError(f"SGLang's {name} is not an MHA K and V host pool; kvtier stores only those")
    if getattr(pool, "v_head_dim", head_dim) != head_dim:
        raise ValueError(f"SGLang's {name} has V heads of {pool.v_head_dim}, K heads of {head_dim}: not supported")
    geometry = PageGeometry(layout, pool.layer_num, pool.head_num, pool.page_size, head_dim, pool.dtype)
    try:
        return HostPages(buffer, geometry)
    except ValueError as err:
        raise ValueError(f"SGLang's {name}: {err}") from None


# -- names -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """Which slice of every page this process holds: its tensor-, pipeline- and context-parallel ranks.

    SGLang's page key is computed from tokens alone, so every rank of a
    tensor-parallel group stores a page under the same key, each with its own
    heads; and every pipeline stage with its own layers. Their blocks are the
    same size (the layout cannot tell them apart), so the shard goes into the
    namespace: a rank never reads another's slice. Data-parallel replicas hold
    the same slice for the same tokens and share it.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def tag(self) -> str:
        parts = [f"tp{self.tp_rank}of{self.tp_size}"]
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        if self.cp_size > 1:
            parts.append(f"cp{self.cp_rank}of{self.cp_size}")
        return "-".join(parts)


def page_namespace(base: str, shard: Shard) -> str:
    """The kvtier namespace of one shard's pages: the tenant's namespace, the engine, the shard."""
    return f"{base}/sglang/{shard.tag}"


def page_names(keys: Sequence[str]) -> list[bytes]:
    """kvtier block names of SGLang page keys: the keys' UTF-8 bytes (the service hashes them with its secret)."""
    return [k.encode() for k in keys]


def page_starts(host_indices: torch.Tensor, pages: int, page_size: int) -> list[int] | None:
    """The first token index of each of ``pages`` pages in ``host_indices``; None when they do not cover them.

    SGLang passes a batch's host slots token by token, ``page_size`` per page.
    """
    if host_indices.numel() != pages * page_size:
        return None
    return host_indices.reshape(-1)[::page_size].tolist()
