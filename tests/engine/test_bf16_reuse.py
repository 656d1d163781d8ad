"""bfloat16 reuse, exact by construction: prefill KV independent of the chunks, only prefill-computed blocks cached.

In bf16 the same token's KV computed two ways differs far more than in
float32 (bench/README.md, shadow verification), so outputs with and without
the cache can only be equal if the cached bits are the ones a recompute
makes. Two things give that (:class:`kvtier.config.DecodedKV`,
:func:`kvtier.engine.kernels.plan_prefill`); these tests run four chat turns
on the real model in bf16, cold in one chunk per prompt against cached runs
cut into uneven chunks, and require the same tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from kvtier.config import load_config
from kvtier.engine.llama import LlamaModel, SeqInput
from kvtier.engine.pool import BlockTable
from kvtier.engine.runtime import LoadedModel, load_model, make_engine, open_cache
from tests.engine.test_engine import check_reuse, config, converse

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    data = tmp_path_factory.mktemp("bf16-model")
    cfg = load_config(environ={"KVTIER_DATA_DIR": str(data), "KVTIER_ENGINE__DTYPE": "bfloat16"})
    return load_model(cfg, progress=False)


def prefill_in_chunks(model: LlamaModel, ids: list[int], cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` prefilled from a fresh pool in the chunks ``cuts`` bound: the full blocks' pool bytes (every
    layer) and the last chunk's logits."""
    pool = model.make_pool(16, len(ids) // 16 + 1)
    table = BlockTable([], 0)
    pool.grow(table, len(ids))
    for a, b in itertools.pairwise(cuts):
        logits = model([SeqInput(ids[a:b], a, table)], pool)
    return pool.kv[:, : len(ids) // 16].clone(), logits


def test_a_prompts_kv_is_the_same_bits_in_one_forward_or_in_uneven_chunks(bf16_model: LoadedModel) -> None:
    model = bf16_model.model
    text = "Count from one to forty in words, then back again, and explain each step. " * 24
    ids = bf16_model.chat_ids([{"role": "user", "content": text}])[:300]
    assert len(ids) == 300

    one, one_logits = prefill_in_chunks(model, ids, [0, len(ids)])
    cut, cut_logits = prefill_in_chunks(model, ids, [0, 37, 101, 165, 230, len(ids)])
    assert torch.equal(one, cut) and torch.equal(one_logits, cut_logits)


def test_greedy_output_with_the_cache_is_the_output_without_it(bf16_model: LoadedModel, tmp_path: Path) -> None:
    cold_cfg = config(tmp_path / "cold", dtype="bfloat16")
    cold = converse(make_engine(bf16_model, cold_cfg, cache=None, keep_resident=False), bf16_model)
    for keep_resident in (False, True):
        cfg = config(tmp_path / str(keep_resident), dtype="bfloat16", keep_resident=keep_resident, max_step_tokens=48)
        with open_cache(bf16_model, cfg) as cache:
            engine = make_engine(bf16_model, cfg, cache=cache, keep_resident=keep_resident)
            assert not engine.publisher.cache_decoded  # decoded_kv: auto, in bfloat16
            turns = converse(engine, bf16_model)
        check_reuse(turns, cold, replies_cached=False)  # the prompts' blocks only, never a reply's


@pytest.mark.parametrize(
    ("name", "kv"), [("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn), ("float16", torch.float16)]
)
def test_narrower_kv_in_a_bfloat16_engine_keeps_reuse_exact(
    name: str, kv: torch.dtype, bf16_model: LoadedModel, tmp_path: Path
) -> None:
    """8-bit or float16 KV under bfloat16 compute: the prefill kernel's AVX-512 BF16 build widens them too."""
    model = copy.copy(bf16_model.model)
    model.kv_dtype = kv
    kv8 = dataclasses.replace(bf16_model, model=model)
    cold_cfg = config(tmp_path / "cold", dtype="bfloat16", kv_dtype=name)
    cold = converse(make_engine(kv8, cold_cfg, cache=None, keep_resident=False), kv8)
    cfg = config(tmp_path / "cached", dtype="bfloat16", kv_dtype=name, keep_resident=False, max_step_tokens=48)
    with open_cache(kv8, cfg) as cache:
        engine = make_engine(kv8, cfg, cache=cache, keep_resident=False)
        assert engine.pool.layout.dtype == kv
        turns = converse(engine, kv8)
    check_reuse(turns, cold, replies_cached=False)
