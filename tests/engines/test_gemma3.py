"""Gemma 3 270M (Q4_K_M, from its registry package) on the built-in engine, against llama.cpp on the same file.

Tokens: kvtier's SentencePiece tokenizer against llama.cpp's own on the
corpus of ``tests/engines/corpus.py``. Every id must be the same.

Logits:
Teacher-forced over text nobody here wrote (CPython's own ``json`` module
source, docs and code, about 1,500 tokens: three times the 512-position
sliding window): at every position the engine's most likely next token is
compared with llama.cpp's (``bench/runners/llamacpp_logits.py`` in
llama-cpp-python's venv, which also tokenizes). llama.cpp itself changes
its choice at near ties under rounding alone (its K/V in float16 vs
float32), so the bar is set by llama.cpp: the engine agrees with it at least
as often as llama.cpp agrees with itself across those two, and never where
llama.cpp's choice leads by a clear margin. Runs under ``--engines``.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.bench.llamacpp_oracle import corpus_texts, llamacpp_choices, llamacpp_tokens
from kvtier.config import load_config
from kvtier.engine import BlockTable, LlamaModel, SeqInput
from kvtier.engine.runtime import load_model, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.model import load_gguf, load_tokenizer, read_gguf_metadata
from kvtier.model.config import Architecture
from kvtier.model.locate import gemma3_270m_path
from kvtier.tiers.base import TierKind

pytestmark = pytest.mark.engines

CLEAR = 1.0  # a lead in logits no rounding of either engine overturns


@pytest.fixture(scope="module")
def gguf() -> Path:
    return gemma3_270m_path()


def test_tokens_are_llama_cpps_on_text_from_this_machine(gguf: Path, llama_python: Path, tmp_path: Path) -> None:
    texts = corpus_texts(tmp_path)
    theirs = llamacpp_tokens(llama_python, gguf, texts)
    tokenizer = load_tokenizer(read_gguf_metadata(gguf))
    differ = [p.name for p, text in texts.items() if tokenizer.encode_text(text) != theirs[p]]
    assert not differ, f"{len(differ)} of {len(texts)} texts tokenized otherwise than llama.cpp: {differ}"
    assert sum(len(ids) for ids in theirs.values()) > 10_000
    for path, text in texts.items():
        assert tokenizer.decode(theirs[path], skip_special_tokens=True) == text


@pytest.fixture(scope="module")
def llamacpp(gguf: Path, llama_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    text = tmp_path_factory.mktemp("corpus") / "json.py.txt"
    text.write_text(inspect.getsource(json)[:5000], encoding="utf-8")
    return llamacpp_choices(llama_python, gguf, text, 2)


def test_next_token_agrees_with_llama_cpp_as_often_as_llama_cpp_with_itself(gguf: Path, llamacpp: dict) -> None:
    config, weights, _ = load_gguf(gguf, progress=False)
    assert config.architecture is Architecture.GEMMA3 and config.sliding_window == 512
    model = LlamaModel(config, weights)
    ids = llamacpp["ids"]
    assert len(ids) >= 1000
    pool = model.make_pool(16, len(ids) // 16 + 1)
    table = BlockTable()
    pool.grow(table, len(ids))
    (logits,) = model.forward_all([SeqInput(ids, 0, table)], pool)
    ours = logits.argmax(-1).numpy()
    f32, f16 = (np.array(llamacpp[kv]["argmax"]) for kv in ("f32", "f16"))
    itself = float((f32 == f16).mean())
    agree = {kv: ours == np.array(llamacpp[kv]["argmax"]) for kv in ("f32", "f16")}
    assert min(float(a.mean()) for a in agree.values()) >= itself - 0.005, (agree, itself)
    for kv, same in agree.items():
        margin = np.array(llamacpp[kv]["margin"])
        assert (margin[~same] < CLEAR).all(), f"a clear choice of llama.cpp ({kv} K/V) differs"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_with_the_cache_is_the_output_without_it_past_the_window(
    tmp_path: Path, gguf: Path, dtype: str
) -> None:
    """A second prompt sharing 1,000+ tokens with the first (twice the sliding window) hits them in host memory, then
    on disk after a restart; either way its greedy tokens are the ones a full recompute gives. In bfloat16 that
    holds because the sliding-window layers, like the others, run the C kernel, whose rows do not depend on where
    the prompt was cut (a masked SDPA there changed turn 9 of the demo)."""
    env = {
        "KVTIER_DATA_DIR": str(tmp_path / "data"),
        "KVTIER_ENGINE__MODEL_PATH": str(gguf),
        "KVTIER_ENGINE__DTYPE": dtype,
        "KVTIER_CACHE__WRITE_MODE": "write_through",
        "KVTIER_ENGINE__MAX_STEP_TOKENS": "384",  # prefills in chunks, cut inside and across windows
    }
    config = load_config(environ=env)
    loaded = load_model(config, progress=False)
    # Q5_0, Q8_0, Q4_K and Q6_K matrices, all read as blocks by decode steps
    assert loaded.model.decode_layers is not None and loaded.model.lm_head_blocks is not None
    text = inspect.getsource(json)[:5000]
    first = loaded.tokenizer.encode(text[:4000])
    second = loaded.tokenizer.encode(text)
    params = SamplingParams(max_tokens=12)
    (cold,) = make_engine(loaded, config, cache=None, keep_resident=False).generate([second], params)
    with open_cache(loaded, config) as cache:
        engine = make_engine(loaded, config, cache=cache, keep_resident=False)
        engine.generate([first], params)
        engine.drain_stores()
        (warm,) = engine.generate([second], params)
    assert warm.cached_tokens >= 2 * 512 and warm.served_from == {TierKind.HOST: warm.cached_tokens}
    assert warm.token_ids == cold.token_ids
    with open_cache(loaded, config) as cache:  # a new process's tiers: host empty, disk not
        (restarted,) = make_engine(loaded, config, cache=cache, keep_resident=False).generate([second], params)
    assert restarted.cached_tokens > warm.cached_tokens  # the second prompt was stored too
    assert restarted.served_from == {TierKind.DISK: restarted.cached_tokens}
    assert restarted.token_ids == cold.token_ids
