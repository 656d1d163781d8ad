"""The engine on a GPU: the pool in device memory, reuse from the host tier and the resident pool still exact.

``loaded_model`` puts the weights where ``engine.device: auto`` does, so on a
machine with CUDA the whole of ``tests/engine/test_engine.py`` runs on the
GPU too; this module says so explicitly and is what ``bench/gpu.sh`` runs
first. Skipped without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from tests.engine.test_engine import check_reuse, config, converse

pytestmark = pytest.mark.cuda


def test_the_engine_runs_on_the_gpu_and_reuse_from_host_and_pool_is_exact(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    assert loaded_model.model.device.type == "cuda"
    cold = converse(make_engine(loaded_model, config(tmp_path / "cold"), cache=None, keep_resident=False), loaded_model)
    for keep_resident in (False, True):
        cfg = config(tmp_path / str(keep_resident), keep_resident=keep_resident)
        with open_cache(loaded_model, cfg) as cache:
            engine = make_engine(loaded_model, cfg, cache=cache, keep_resident=keep_resident)
            assert engine.pool.kv.device.type == "cuda" and cache.host is not None and cache.host.pinned
            check_reuse(converse(engine, loaded_model), cold)
            served = cache.stats().tiers["host"].hit_tokens
            assert (len(engine.resident) > 0) if keep_resident else served > 0
