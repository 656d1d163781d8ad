"""SGLang host pages <-> kvtier blocks, and the names and namespaces of pages (no SGLang needed).

The oracle is written out per layout from SGLang's ``MHATokenToKVPoolHost``
(``init_kv_buffer``'s dims, ``get_data_page``'s slices), element by element,
apart from the axis table the module derives its views from.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.connectors.sglang_pages import (
    HostLayout,
    HostPages,
    PageGeometry,
    Shard,
    host_pages,
    page_names,
    page_namespace,
    page_starts,
)
from kvtier.layout import KVLayout, LayoutOrder

L, H, P, D = 3, 2, 4, 5
PAGES = 6
SIZE = PAGES * P


def element(buf: torch.Tensor, layout: HostLayout, kv: int, layer: int, token: int, head: int, dim: int) -> float:
    """One element of an SGLang host buffer, addressed as SGLang's own dims say (``token`` over the whole pool)."""
    page, t = divmod(token, P)
    match layout:
        case HostLayout.LAYER_FIRST:  # (2, layer_num, size, head_num, head_dim)
            return buf[kv, layer, token, head, dim].item()
        case HostLayout.PAGE_FIRST:  # (2, size, layer_num, head_num, head_dim)
            return buf[kv, token, layer, head, dim].item()
        case HostLayout.PAGE_FIRST_DIRECT:  # (2, page_num, layer_num, page_size, head_num, head_dim)
            return buf[kv, page, layer, t, head, dim].item()
        case HostLayout.PAGE_HEAD:  # (2, page_num, head_num, page_size, layer_num, head_dim)
            return buf[kv, page, head, t, layer, dim].item()
    raise AssertionError(layout)


def sglang_flat_page(buf: torch.Tensor, layout: HostLayout, index: int) -> torch.Tensor:
    """SGLang's ``get_data_page(index, flat=True)``, as its source writes it."""
    if layout is HostLayout.LAYER_FIRST:
        page = buf[:, :, index : index + P, :, :]
    elif layout is HostLayout.PAGE_FIRST:
        page = buf[:, index : index + P, :, :, :]
    else:
        page = buf[:, index // P : index // P + 1, :, :, :, :]
    return page.flatten()


def geometry(layout: HostLayout, dtype: torch.dtype = torch.float32) -> PageGeometry:
    return PageGeometry(layout, L, H, P, D, dtype)


def numbered(layout: HostLayout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host buffer whose every element differs from every other (exactly, in float32)."""
    shape = geometry(layout).buffer_shape(PAGES)
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


def fake_pool(layout: str, buf: torch.Tensor, **over) -> SimpleNamespace:
    attrs = dict(layout=layout, kv_buffer=buf, layer_num=L, head_num=H, head_dim=D, page_size=P, dtype=buf.dtype)
    return SimpleNamespace(**{**attrs, **over})


@pytest.mark.parametrize("layout", list(HostLayout))
def test_a_page_view_puts_every_element_at_its_block_position(layout: HostLayout) -> None:
    buf = numbered(layout)
    pages = host_pages(fake_pool(layout.value, buf))
    assert pages.num_pages == PAGES
    for index in (0, 2 * P, (PAGES - 1) * P):
        block = pages.page(index)  # [layers, K|V, heads, tokens, head_dim]
        assert block.shape == (L, 2, H, P, D)
        for layer in range(L):
            for kv in range(2):
                for head in range(H):
                    for t in range(P):
                        for dim in range(D):
                            want = element(buf, layout, kv, layer, index + t, head, dim)
                            assert block[layer, kv, head, t, dim].item() == want


@pytest.mark.parametrize("src_layout", list(HostLayout))
@pytest.mark.parametrize("dst_layout", [HostLayout.LAYER_FIRST, HostLayout.PAGE_HEAD])
def test_a_page_read_into_a_block_writes_back_into_any_layout_and_nothing_else(
    src_layout: HostLayout, dst_layout: HostLayout
) -> None:
    src = numbered(src_layout)
    dst = torch.full(geometry(dst_layout).buffer_shape(PAGES), -1.0)
    kv_layout = geometry(src_layout).kv_layout
    payload = torch.zeros(kv_layout.block_bytes, dtype=torch.uint8)
    host_pages(fake_pool(src_layout.value, src)).read(P, payload)
    host_pages(fake_pool(dst_layout.value, dst)).write(4 * P, payload)
    for layer in range(L):
        for kv in range(2):
            for head in range(H):
                for t in range(P):
                    for dim in range(D):
                        got = element(dst, dst_layout, kv, layer, 4 * P + t, head, dim)
                        assert got == element(src, src_layout, kv, layer, P + t, head, dim)
    assert int((dst == -1.0).sum()) == dst.numel() - L * 2 * H * P * D  # every other page untouched


@pytest.mark.parametrize("layout", list(HostLayout))
def test_sglangs_flat_data_page_is_the_same_page_in_block_order(layout: HostLayout) -> None:
    buf = numbered(layout)
    pages = host_pages(fake_pool(layout.value, buf))
    flat = sglang_flat_page(buf, layout, 3 * P)
    assert torch.equal(pages.geometry.flat_page(flat), pages.page(3 * P))
    # and a block written into SGLang's dummy flat page is the page SGLang's set_from_flat_data_page reads
    dummy = torch.zeros(flat.numel())
    pages.geometry.flat_page(dummy).copy_(pages.page(3 * P))
    assert torch.equal(dummy, flat)


def test_one_page_is_one_layer_major_kvtier_block() -> None:
    g = geometry(HostLayout.PAGE_FIRST, torch.bfloat16)
    assert g.kv_layout == KVLayout(L, H, D, P, torch.bfloat16, LayoutOrder.LAYER_MAJOR)
    assert g.kv_layout.block_bytes == 2 * L * H * P * D * 2


def test_pools_kvtier_cannot_store_are_refused_with_the_reason() -> None:
    buf = numbered(HostLayout.LAYER_FIRST)
    with pytest.raises(ValueError, match="page_unified"):
        host_pages(fake_pool("page_unified", buf))
    with pytest.raises(ValueError, match="V heads of 3"):
        host_pages(fake_pool("layer_first", buf, v_head_dim=3))
    mla = torch.zeros(L, SIZE, 1, 12)  # an MLA pool: one latent vector per token and layer
    with pytest.raises(ValueError, match="MHA pool"):
        host_pages(fake_pool("layer_first", mla))
    with pytest.raises(ValueError, match="not an MHA K and V host pool"):
        host_pages(SimpleNamespace(layout="layer_first", kv_buffer=None))
    fp8 = torch.zeros(geometry(HostLayout.LAYER_FIRST).buffer_shape(PAGES), dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        host_pages(fake_pool("layer_first", fp8))


def test_a_page_starts_on_a_page_boundary_inside_the_pool() -> None:
    pages = HostPages(numbered(HostLayout.PAGE_FIRST), geometry(HostLayout.PAGE_FIRST))
    with pytest.raises(IndexError):
        pages.page(1)
    with pytest.raises(IndexError):
        pages.page(PAGES * P)


def test_page_starts_take_the_first_slot_of_each_page() -> None:
    idx = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    assert page_starts(idx, 2, P) == [8, 0]
    assert page_starts(idx, 3, P) is None  # SGLang gave slots for another number of pages


def test_every_shard_names_its_pages_in_its_own_namespace() -> None:
    spaces = {
        page_namespace("default", Shard()),
        page_namespace("default", Shard(tp_rank=0, tp_size=2)),
        page_namespace("default", Shard(tp_rank=1, tp_size=2)),
        page_namespace("default", Shard(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2)),
        page_namespace("default", Shard(cp_rank=1, cp_size=2)),
        page_namespace("tenant-b", Shard()),
    }
    assert len(spaces) == 6
    assert page_namespace("default", Shard()) == "default/sglang/tp0of1"
    assert page_names(["ab12", "cd34"]) == [b"ab12", b"cd34"]
