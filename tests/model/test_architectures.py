"""Every architecture the engine serves, against transformers on the same random weights.

Each model is written to GGUF by :mod:`tests.model.hf_gguf` and read back
by kvtier's own loader; the engine's logits at every position of a prompt,
computed in one prefill and again in pieces on top of the pool (the path a
cache hit takes), must match transformers' within 1e-4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.engine import BlockTable, LlamaModel, SeqInput
from kvtier.model import load_gguf
from kvtier.model.config import Architecture
from tests.model.hf_gguf import VOCAB, head_dim_of, random_model, write_gguf

TOLERANCE = 1e-4
PROMPT = [(i * 37 + 11) % VOCAB for i in range(70)]


@pytest.fixture(scope="module", params=list(Architecture), ids=lambda a: a.value)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch: Architecture = request.param
    reference = random_model(arch)
    path = write_gguf(reference, arch, tmp_path_factory.mktemp(arch.value) / f"{arch.value}.gguf")
    config, weights, _ = load_gguf(path, progress=False)
    return arch, reference, LlamaModel(config, weights)


def test_the_file_reads_back_as_its_architecture(pair) -> None:
    arch, reference, model = pair
    assert model.config.architecture is arch
    assert model.config.head_dim == head_dim_of(reference.config)
    assert (model.layers[0].bqkv is not None) == (arch is Architecture.QWEN2)
    assert (model.layers[0].q_norm is not None) == (arch in (Architecture.QWEN3, Architecture.GEMMA3))
    assert model.config.sliding_layers == ((True, False) if arch is Architecture.GEMMA3 else ())


def test_logits_match_transformers_in_one_prefill_and_on_top_of_the_pool(pair) -> None:
    _, reference, model = pair
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0]
    pool = model.make_pool(16, 12)
    whole = BlockTable()
    pool.grow(whole, len(PROMPT))
    (got,) = model.forward_all([SeqInput(PROMPT, 0, whole)], pool)
    assert (got - want).abs().max().item() < TOLERANCE
    pieces, out = BlockTable(), []
    for a, b in [(0, 32), (32, 45), (45, 69)]:  # a cached prefix, then a tail on top of it
        pool.grow(pieces, b)
        out += model.forward_all([SeqInput(PROMPT[a:b], a, pieces)], pool)
    pool.grow(pieces, len(PROMPT))
    last = model.forward([SeqInput(PROMPT[69:], 69, pieces)], pool)  # a decode step
    assert (torch.cat(out) - want[:69]).abs().max().item() < TOLERANCE
    assert (last[0] - want[69]).abs().max().item() < TOLERANCE


def test_an_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    write_gguf(random_model(Architecture.LLAMA), Architecture.LLAMA, path)
    data = bytearray(path.read_bytes())
    at = data.index(b"llama", data.index(b"general.architecture"))
    data[at : at + 5] = b"mamba"  # same length: the file stays well formed
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'"):
        load_gguf(path, progress=False)
