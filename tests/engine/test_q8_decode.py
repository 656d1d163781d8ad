"""``engine.decode_activations: q8``: decode's products in int8, and reuse exact all the same.

Decode with 8-bit activations computes a reply's KV with other arithmetic
than a prefill of the same tokens, so such blocks are never cached
(``decoded_kv``: ``auto`` skips them, ``cache`` is refused); what a cached
run reuses are prompt blocks a prefill computed, the very bits an uncached
run computes. Four chat turns on the real model in float32 (where ``auto``
would otherwise cache a reply's blocks), cold against cached runs.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from kvtier.config import Config
from kvtier.engine import quant
from kvtier.engine.runtime import LoadedModel, cache_decoded, make_engine, open_cache, q8_decode
from tests.engine.test_engine import check_reuse, config, converse

pytestmark = pytest.mark.skipif(not quant.Q8, reason="this CPU has no AVX-512 VNNI")


@pytest.fixture(scope="module")
def q8_model(loaded_model: LoadedModel) -> LoadedModel:
    """The session's float32 model, its decode products in int8 (the same weights, shared)."""
    model = copy.copy(loaded_model.model)
    model.q8_decode = True
    return dataclasses.replace(loaded_model, model=model)


def test_the_setting_resolves_and_refuses_to_cache_decoded_kv(tmp_path: Path) -> None:
    cfg = config(tmp_path, decode_activations="q8")
    assert q8_decode(cfg) and not cache_decoded(cfg)  # float32: auto would cache a reply's blocks otherwise
    assert cache_decoded(config(tmp_path)) and not q8_decode(config(tmp_path))
    tree = cfg.model_dump()
    tree["engine"]["decoded_kv"] = "cache"
    with pytest.raises(ValidationError, match="reuse would no longer be exact"):
        Config.model_validate(tree)


def test_greedy_output_with_the_cache_is_the_output_without_it(q8_model: LoadedModel, tmp_path: Path) -> None:
    cold_cfg = config(tmp_path / "cold", decode_activations="q8")
    cold = converse(make_engine(q8_model, cold_cfg, cache=None, keep_resident=False), q8_model)
    for keep_resident in (False, True):
        cfg = config(tmp_path / str(keep_resident), decode_activations="q8", keep_resident=keep_resident)
        with open_cache(q8_model, cfg) as cache:
            engine = make_engine(q8_model, cfg, cache=cache, keep_resident=keep_resident)
            assert not engine.publisher.cache_decoded
            turns = converse(engine, q8_model)
        check_reuse(turns, cold, replies_cached=False)  # the prompts' blocks only, never a reply's


def test_decode_logits_move_by_the_rounding_only(loaded_model: LoadedModel) -> None:
    """The int8 build ran (logits differ from exact products) and agrees with them to 8-bit rounding."""
    head = loaded_model.model.lm_head_blocks
    x = torch.randn(3, head.cols, generator=torch.Generator().manual_seed(1))
    exact, q8 = head(x), head(x, q8=True)
    assert not torch.equal(exact, q8)
    assert ((q8 - exact).norm() / exact.norm()).item() < 2e-2
    assert torch.equal(exact.argmax(dim=1), q8.argmax(dim=1))
