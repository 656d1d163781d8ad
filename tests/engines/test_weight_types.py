"""Each weight type as llama.cpp's own quantizer makes it, against llama.cpp on the very same file.

SmolLM2 is dequantized once to an F32 GGUF (``tests/engines/corpus.py``),
and llama.cpp's ``llama_model_quantize`` (``bench/runners/llamacpp_quantize.py``)
makes each type from it with llama.cpp's usual mix: K-quants where a row is
a multiple of 256 wide (the MLP's down projection here, 1,536), its
fallbacks elsewhere. On each file:

* teacher-forced over CPython's ``json`` source (about 1,500 positions), the
  engine's most likely next token agrees with llama.cpp's at least as often
  as llama.cpp agrees with itself across float32 and float16 K/V (0.958 to
  0.969 here), less 0.01: two standard errors of a rate near 3.5% over 1,500
  positions, since a CPU of another ISA moves near ties of both engines;
  and it never differs where llama.cpp's choice leads by a clear margin;
* greedy decode on the file's blocks (:mod:`kvtier.engine.quant`) gives the
  tokens decode on the dequantized matrices gives.

Runs under ``--engines``: llama.cpp lives in llama-cpp-python's venv.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.bench import llamacpp_oracle
from kvtier.bench.engines import RUNNERS
from kvtier.bench.models import teacher_forced_argmax
from kvtier.engine import BlockTable, LlamaModel, SeqInput
from kvtier.model import default_gguf_path, load_gguf_with_blocks
from kvtier.model.gguf import weight_types
from tests.engines.corpus import write_dense_gguf

pytestmark = pytest.mark.engines

CLEAR = 1.0  # a lead in logits no rounding of either engine overturns
NOISE = 0.01  # see the module docstring
# llama.cpp file type -> block formats its file must hold
TYPES = {
    "Q4_0": {"Q4_0"},
    "Q4_1": {"Q4_1"},
    "Q5_0": {"Q5_0"},
    "Q5_1": {"Q5_1"},
    "Q8_0": {"Q8_0"},
    "Q4_K_M": {"Q4_K", "Q6_K"},
    "Q5_K_M": {"Q5_K", "Q6_K"},
    "Q6_K": {"Q6_K"},
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dense_gguf(default_gguf_path(), tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf")


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "json.txt"
    source = llamacpp_oracle.AGREEMENT_TEXT.read_text(encoding="utf-8")
    path.write_text(source[: llamacpp_oracle.AGREEMENT_CHARS], encoding="utf-8")
    return path


def greedy(model: LlamaModel, prompt: list[int], steps: int) -> list[int]:
    pool, table = model.make_pool(16, (len(prompt) + steps) // 16 + 2), BlockTable()
    pool.grow(table, len(prompt) + steps)
    ids = [int(model.forward([SeqInput(prompt, 0, table)], pool)[-1].argmax())]
    for i in range(steps):
        ids.append(int(model.forward([SeqInput(ids[-1:], len(prompt) + i, table)], pool)[-1].argmax()))
    return ids


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_each_type_agrees_with_llama_cpp_on_its_own_quantization(
    kind: str, llama_python: Path, dense: Path, text: Path, tmp_path: Path
) -> None:
    quantized = tmp_path / f"smollm2-{kind}.gguf"
    subprocess.run(
        [str(llama_python), str(RUNNERS / "llamacpp_quantize.py"), str(dense), str(quantized), kind, "2"],
        check=True,
        capture_output=True,
    )
    assert TYPES[kind] <= set(weight_types(quantized)), weight_types(quantized)
    choices = llamacpp_oracle.llamacpp_choices(llama_python, quantized, text, 2)
    (config, weights, _), blocks = load_gguf_with_blocks(quantized, progress=False)
    model = LlamaModel(config, weights, blocks=blocks)
    assert model.decode_layers is not None  # every matrix in a block format decode reads
    ids = choices["ids"]
    assert len(ids) >= 1000
    ours = teacher_forced_argmax(model, ids)
    f32, f16 = (np.array(choices[kv]["argmax"]) for kv in ("f32", "f16"))
    itself = float((f32 == f16).mean())
    for kv in ("f32", "f16"):
        same = ours == np.array(choices[kv]["argmax"])
        assert float(same.mean()) >= itself - NOISE, (kind, kv, float(same.mean()), itself)
        margin = np.array(choices[kv]["margin"])
        assert (margin[~same] < CLEAR).all(), f"{kind}: a clear choice of llama.cpp ({kv} K/V) differs"

    prompt = ids[:300]
    on_blocks = greedy(model, prompt, 16)
    model.decode_layers, model.lm_head_blocks = None, None
    with torch.inference_mode():
        assert greedy(model, prompt, 16) == on_blocks
