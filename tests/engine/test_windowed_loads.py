"""Hits on a model with sliding-window layers load those layers only inside the window, and stay exact.

The model is the random 2-layer Gemma 3 of ``tests/model/hf_gguf.py``: layer
0 slides over 16 positions, layer 1 is global. Blocks of 4 tokens, so a hit
of 100 tokens leaves 21 of its 25 blocks out of layer 0. Every output is
compared with a full recompute (no cache) of the same prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.config import Config, load_config
from kvtier.engine.llama import LlamaModel
from kvtier.engine.onboard import SlidingWindow
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.model import default_gguf_path, load_gguf_with_blocks, load_tokenizer, model_fingerprint, read_gguf_metadata
from kvtier.model.config import Architecture
from kvtier.tiers.base import TierKind
from tests.model.hf_gguf import VOCAB, WINDOW, random_model, write_gguf

BLOCK = 4
GREEDY = SamplingParams(max_tokens=10)
PROMPT = [int(t) for t in torch.randint(3, VOCAB, (140,), generator=torch.Generator().manual_seed(11))]
FIRST = PROMPT[:101]  # stored whole: 25 blocks (the last token is computed, never stored as a prompt block)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The random Gemma 3 file; SmolLM2's tokenizer stands in (ids below 512 decode fine, nothing is chatted)."""
    folder = tmp_path_factory.mktemp("gemma3")
    path = write_gguf(random_model(Architecture.GEMMA3), Architecture.GEMMA3, folder / "gemma3.gguf")
    (config, weights, _), blocks = load_gguf_with_blocks(path, progress=False)
    model = LlamaModel(config, weights, blocks=blocks)
    tokenizer = load_tokenizer(read_gguf_metadata(default_gguf_path()))
    return LoadedModel(path, model, tokenizer, None, model_fingerprint(path, torch.float32, folder))


def settings(tmp: Path, **engine: object) -> Config:
    cfg = load_config(
        environ={
            "KVTIER_DATA_DIR": str(tmp / "data"),
            "KVTIER_ENGINE__DTYPE": "float32",
            "KVTIER_CACHE__BLOCK_SIZE": str(BLOCK),
            "KVTIER_CACHE__WRITE_MODE": "write_through",
            "KVTIER_HOST__CAPACITY_BYTES": "64MiB",
            "KVTIER_DISK__CAPACITY_BYTES": "64MiB",
            "KVTIER_VERIFY__SHADOW_FRACTION": "1",
        }
    )
    tree = cfg.model_dump()
    tree["engine"] = {**tree["engine"], "pool_bytes": 256 * 1024**2 // 64, "max_step_tokens": 16, **engine}
    return Config.model_validate(tree)


@pytest.fixture(scope="module")
def cold(gemma: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[int]]:
    """Greedy output of a full recompute, by prompt length."""
    engine = make_engine(gemma, settings(tmp_path_factory.mktemp("cold")), cache=None, keep_resident=False)
    return {len(p): engine.generate([p], GREEDY)[0].token_ids for p in (FIRST, PROMPT, PROMPT[:60], PROMPT[:77])}


def test_a_hit_loads_the_sliding_layer_only_inside_the_window_and_stays_exact(
    gemma: LoadedModel, tmp_path: Path, cold: dict[int, list[int]]
) -> None:
    window = SlidingWindow.of(gemma.model.config)
    assert window == SlidingWindow(WINDOW, frozenset({0}))
    cfg = settings(tmp_path, keep_resident=False)
    with open_cache(gemma, cfg) as cache:
        engine = make_engine(gemma, cfg, cache=cache)
        assert engine.generate([FIRST], GREEDY)[0].token_ids == cold[len(FIRST)]
        engine.drain_stores()
        (hit,) = engine.generate([PROMPT], GREEDY)  # resumes at a block boundary after the cached ones
        assert hit.token_ids == cold[len(PROMPT)]
        assert hit.served_from.get(TierKind.HOST, 0) >= 100
        loaded = hit.served_from[TierKind.HOST] // BLOCK
        inside = loaded - window.first_block(loaded * BLOCK, BLOCK)  # blocks layer 0 still gets
        layer_bytes = gemma.model.kv_layout(BLOCK).layer_bytes
        assert engine.onboarded_full_bytes == loaded * 2 * layer_bytes
        assert engine.onboarded_bytes == (loaded + inside) * layer_bytes
        assert engine.onboarded_bytes < 0.6 * engine.onboarded_full_bytes
        while engine.verify_pending:  # the served global layers match a recompute; the left-out ones are not judged
            engine.verify_idle()
        counters = engine.verifier.counters
        assert counters.verified >= 1 and counters.mismatched_blocks == 0
    with open_cache(gemma, cfg) as cache:  # a new process: host empty, disk not
        engine = make_engine(gemma, cfg, cache=cache)
        (restarted,) = engine.generate([PROMPT], GREEDY)
        assert restarted.served_from.get(TierKind.DISK, 0) > 100
        assert restarted.token_ids == cold[len(PROMPT)]
        assert engine.onboarded_bytes < engine.onboarded_full_bytes


def test_off_every_layer_is_loaded(gemma: LoadedModel, tmp_path: Path, cold: dict[int, list[int]]) -> None:
    cfg = settings(tmp_path, keep_resident=False, windowed_loads=False)
    with open_cache(gemma, cfg) as cache:
        engine = make_engine(gemma, cfg, cache=cache)
        engine.generate([FIRST], GREEDY)
        engine.drain_stores()
        assert engine.generate([PROMPT], GREEDY)[0].token_ids == cold[len(PROMPT)]
        assert engine.onboarded_bytes == engine.onboarded_full_bytes > 0


def test_partial_resident_blocks_serve_only_requests_whose_window_misses_them(
    gemma: LoadedModel, tmp_path: Path, cold: dict[int, list[int]]
) -> None:
    """A windowed hit kept resident holds partial blocks. The next turn (a longer prompt) shares them all; a
    request that branches off inside them shares only blocks before its window, loads the rest, and every
    output is the recompute's."""
    cfg = settings(tmp_path)
    with open_cache(gemma, cfg) as cache:
        writer = make_engine(gemma, cfg, cache=cache, keep_resident=False)
        writer.generate([FIRST], GREEDY)
        writer.drain_stores()
        engine = make_engine(gemma, cfg, cache=cache)
        (first,) = engine.generate([FIRST], GREEDY)  # from the cache, windowed, then kept resident
        assert first.token_ids == cold[len(FIRST)] and first.served_from.get(TierKind.HOST, 0) == 100
        resident = engine.resident
        assert resident is not None
        (again,) = engine.generate([PROMPT], GREEDY)  # its window starts after the partial blocks
        assert again.token_ids == cold[len(PROMPT)]
        assert again.served_from.get(TierKind.DEVICE, 0) >= 100
        # 60 tokens resume at 56, whose window reaches back into partial blocks however far the run is cut back:
        # nothing resident is shared, the cache serves, and blocks 10-14 are kept complete after. 77 resume at 76:
        # blocks 15-18 are partial, so the run ends at 15 blocks, whose window (from block 11) is complete.
        for length, device in ((60, 0), (77, 60)):
            (branch,) = engine.generate([PROMPT[:length]], GREEDY)
            assert branch.token_ids == cold[length]
            assert branch.served_from.get(TierKind.DEVICE, 0) == device
            assert branch.served_from.get(TierKind.HOST, 0) == (length - 1) // BLOCK * BLOCK - device
