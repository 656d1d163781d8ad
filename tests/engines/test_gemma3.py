"""Gemma 3 270M (Q4_K_M, from its registry package) on the built-in engine, against llama.cpp on the same file.

Teacher-forced over text nobody here wrote (CPython's own ``json`` module
source, docs and code, about 1,500 tokens: three times the 512-position
sliding window): at every position the engine's most likely next token is
compared with llama.cpp's (``tests/engines/runners/llamacpp_logits.py`` in
llama-cpp-python's venv, which also tokenizes). llama.cpp itself changes
its choice at near ties under rounding alone (its K/V in float16 vs
float32), so the bar is set by llama.cpp: the engine agrees with it at least
as often as llama.cpp agrees with itself across those two, and never where
llama.cpp's choice leads by a clear margin. Runs under ``--engines``.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kvtier.engine import BlockTable, LlamaModel, SeqInput
from kvtier.model import load_gguf
from kvtier.model.config import Architecture
from kvtier.model.locate import gemma3_270m_path

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PYTHON = Path(os.environ.get("ENGINES_LLAMACPP_PYTHON", ROOT / ".venv-peer-llamacpp" / "bin" / "python"))
RUNNER = ROOT / "tests" / "engines" / "runners" / "llamacpp_logits.py"
CLEAR = 1.0  # a lead in logits no rounding of either engine overturns


@pytest.fixture(scope="module")
def gguf() -> Path:
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def llamacpp(gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    if not LLAMA_PYTHON.exists():
        pytest.skip(f"no llama-cpp-python venv at {LLAMA_PYTHON} (make .venv-peer-llamacpp/.kvtier builds it)")
    text = tmp_path_factory.mktemp("corpus") / "json.py.txt"
    text.write_text(inspect.getsource(json)[:5000], encoding="utf-8")
    run = subprocess.run(
        [str(LLAMA_PYTHON), str(RUNNER), str(gguf), str(text), "2"], capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout)


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
