"""``KVTierStorage`` over a real cache service, in this venv: the calls SGLang makes, and a service that is away.

SGLang itself is not installed here; when it is absent, a stand-in for the
one thing the backend imports from it (the ``HiCacheStorage`` base class) is
put in ``sys.modules`` for these tests alone. The backend inside real SGLang,
its real base class and host pool, is ``tests/engines/test_sglang.py``.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvtier.connectors
from kvtier.connectors.sglang_pages import BUFFER_AXES, HostLayout, PageGeometry
from kvtier.identity import kv_identity_for
from kvtier.service import CacheService
from tests.helpers import make_config

L, H, D, P = 3, 2, 8, 4
CONNECTOR = "kvtier.connectors.sglang"
POOL_PAGES = 8


class _HiCacheStorage:
    """SGLang's ``HiCacheStorage`` as far as the backend uses it (the registration it inherits)."""

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host


@pytest.fixture
def backend_class(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    try:
        importlib.import_module("sglang.srt.mem_cache.hicache_storage")
        stand_in = False
    except ImportError:
        stand_in = True
    if stand_in:
        names = ["sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.hicache_storage"]
        for name in names:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        sys.modules[names[-1]].HiCacheStorage = _HiCacheStorage
        sys.modules.pop(CONNECTOR, None)
    yield importlib.import_module(CONNECTOR).KVTierStorage
    if stand_in:  # built on the stand-in: never left behind for another test
        sys.modules.pop(CONNECTOR, None)
        vars(kvtier.connectors).pop("sglang", None)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    cfg = {"num_hidden_layers": L, "num_attention_heads": 2 * H, "num_key_value_heads": H, "hidden_size": 2 * H * D}
    (root / "config.json").write_text(json.dumps({**cfg, "head_dim": D}))
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    return root


@pytest.fixture
def service(tmp_path: Path, model: Path) -> Iterator[CacheService]:
    config = make_config(tmp_path)
    layout, fp = kv_identity_for(model, torch.float32, P, config.data_dir)
    svc = CacheService(config, layout, model_fingerprint=fp, socket_path=tmp_path / "cache.sock", slab_dir=tmp_path)
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    yield svc
    svc.close()
    thread.join(timeout=30)


def storage_config(tmp_path: Path, model: Path, **over: Any) -> SimpleNamespace:
    (tmp_path / "kvtier.yaml").write_text(f"data_dir: {tmp_path / 'data'}\n")
    extra = {"socket": str(tmp_path / "cache.sock"), "config": str(tmp_path / "kvtier.yaml")}
    fields = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1)
    fields |= dict(is_mla_model=False, model_name=str(model), extra_config=extra)
    return SimpleNamespace(**{**fields, **over})


def pool(layout: HostLayout, seed: int | None) -> SimpleNamespace:
    """An SGLang-shaped host pool: random pages (``seed``), or all -1 (None)."""
    shape = PageGeometry(layout, L, H, P, D, torch.float32).buffer_shape(POOL_PAGES)
    buf = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) if seed is not None else -torch.ones(shape)
    return SimpleNamespace(
        layout=layout.value, kv_buffer=buf, layer_num=L, head_num=H, head_dim=D, page_size=P, dtype=torch.float32
    )


def attached(cls: type, tmp_path: Path, model: Path, host: SimpleNamespace, **over: Any) -> Any:
    backend = cls(storage_config(tmp_path, model, **over), {})
    backend.register_mem_pool_host(host)
    return backend


def slots(*pages: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


KEYS = ["a1", "b2", "c3"]


def test_v1_pages_stored_by_one_backend_load_into_another_pool_of_another_layout(
    backend_class: type, tmp_path: Path, model: Path, service: CacheService
) -> None:
    src = attached(backend_class, tmp_path, model, pool(HostLayout.PAGE_FIRST, seed=1))
    assert src.batch_set_v1(KEYS, slots(5, 0, 3)) == [True] * 3
    assert src.batch_set_v1(KEYS, slots(5, 0, 3)) == [True] * 3  # held already: still True, nothing rewritten
    assert src.counters["stored_pages"] == 3
    dst = attached(backend_class, tmp_path, model, pool(HostLayout.PAGE_HEAD, seed=None))
    assert dst.batch_exists(KEYS) == 3 and dst.batch_exists(["a1", "zz", "c3"]) == 1
    assert dst.batch_get_v1([*KEYS, "zz"], slots(1, 2, 4, 6)) == [True, True, True, False]
    for s, d in ((5, 1), (0, 2), (3, 4)):
        assert torch.equal(dst.pages.page(d * P), src.pages.page(s * P))
    assert bool((dst.pages.page(6 * P) == -1).all())  # the missing page's slots are not written


def test_the_staging_forms_move_sglangs_flat_pages(
    backend_class: type, tmp_path: Path, model: Path, service: CacheService
) -> None:
    host = pool(HostLayout.LAYER_FIRST, seed=2)
    backend = attached(backend_class, tmp_path, model, host)
    flat = host.kv_buffer[:, :, 2 * P : 3 * P].flatten()  # SGLang's get_data_page(2 * P) for layer_first
    assert backend.set("k", flat)
    assert backend.exists("k") and not backend.exists("other")
    assert torch.equal(backend.get("k", torch.zeros_like(flat)), flat)
    assert torch.equal(backend.get("k"), flat)  # no staging page given: one is made
    assert backend.get("other", torch.zeros_like(flat)) is None
    assert backend.batch_get(["k", "other"], [torch.zeros_like(flat)] * 2)[1] is None


def test_a_service_that_is_not_there_is_a_miss_for_every_call(backend_class: type, tmp_path: Path, model: Path) -> None:
    host = pool(HostLayout.PAGE_FIRST, seed=3)
    backend = attached(backend_class, tmp_path, model, host)
    assert backend.batch_set_v1(KEYS, slots(0, 1, 2)) == [False] * 3
    assert backend.batch_get_v1(KEYS, slots(0, 1, 2)) == [False] * 3
    assert backend.batch_exists(KEYS) == 0 and not backend.exists("a1")
    assert backend.get("a1") is None and not backend.set("a1", host.kv_buffer[:, :P].flatten())
    assert backend.counters["service_failures"] >= 1


def test_a_batch_whose_slots_do_not_cover_its_pages_is_a_miss(
    backend_class: type, tmp_path: Path, model: Path, service: CacheService
) -> None:
    backend = attached(backend_class, tmp_path, model, pool(HostLayout.PAGE_FIRST, seed=4))
    assert backend.batch_set_v1(KEYS, slots(0, 1)) == [False] * 3
    assert backend.batch_get_v1(KEYS, slots(0, 1)) == [False] * 3


def test_what_kvtier_cannot_store_is_refused_when_sglang_attaches(
    backend_class: type, tmp_path: Path, model: Path
) -> None:
    with pytest.raises(ValueError, match="MLA"):
        backend_class(storage_config(tmp_path, model, is_mla_model=True), {})
    with pytest.raises(ValueError, match="'model'"):
        backend_class(storage_config(tmp_path, model, model_name="org/some-hub-name"), {})
    backend = backend_class(storage_config(tmp_path, model), {})
    with pytest.raises(ValueError, match="page_unified"):
        backend.register_mem_pool_host(
            SimpleNamespace(**{**vars(pool(HostLayout.PAGE_FIRST, 0)), "layout": "page_unified"})
        )
    assert set(BUFFER_AXES) == set(HostLayout)


def test_tensor_parallel_ranks_keep_their_pages_apart(
    backend_class: type, tmp_path: Path, model: Path, service: CacheService
) -> None:
    rank0 = attached(backend_class, tmp_path, model, pool(HostLayout.PAGE_FIRST, seed=5), tp_rank=0, tp_size=2)
    rank1 = attached(backend_class, tmp_path, model, pool(HostLayout.PAGE_FIRST, seed=6), tp_rank=1, tp_size=2)
    assert rank0.batch_set_v1(KEYS, slots(0, 1, 2)) == [True] * 3
    assert rank1.batch_exists(KEYS) == 0  # the same SGLang keys, another rank's heads: not rank 1's pages
