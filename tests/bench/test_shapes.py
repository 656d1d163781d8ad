"""Random-weight shapes: the file a benchmark builds reads back as that shape, with SmolLM2's tokenizer.

The quantizing step is llama.cpp's own (``make test-engines`` and ``kvtier
bench peer --model qwen2.5-1.5b-random`` run it); here the F16 file it starts
from, written by :func:`kvtier.model.hf_gguf.write_gguf`, is checked against
the transformers model that wrote it, and ``kvtier export-hf`` (vLLM's copy)
against both.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kvtier.bench import peer, shapes
from kvtier.engine import BlockTable, LlamaModel, SeqInput
from kvtier.model import default_gguf_path, load_gguf, load_tokenizer, read_gguf_metadata
from kvtier.model.hf_gguf import write_gguf

TINY = dataclasses.replace(shapes.QWEN2_SMALL, name="qwen2-tiny-random", hidden=64, intermediate=128, layers=2, heads=4)
TINY = dataclasses.replace(TINY, vocab=49152 + 64)  # rows past the tokenizer's last id, as Qwen's padded vocabulary
TEXT = "def lookup(keys):\n    return [k for k in keys if k in index]  # café, 東京 2026"
PROMPT = list(range(100, 160))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    model = shapes.random_model(TINY, seed=3)
    with torch.no_grad():  # what the F16 file will hold: the matrices rounded to half precision
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())
    path = tmp_path_factory.mktemp("shape") / "tiny.gguf"
    extra = {"general.name": TINY.name, shapes.RANDOM_KEY: True}
    smollm2 = read_gguf_metadata(default_gguf_path())
    write_gguf(model, TINY.arch, path, tokenizer=smollm2, matrices=GGMLQuantizationType.F16, extra=extra)
    return model, path


def test_the_file_carries_smollm2s_tokenizer_padded_and_says_its_weights_are_random(built) -> None:
    _, path = built
    metadata = read_gguf_metadata(path)
    assert shapes.random_weights(metadata) and not shapes.random_weights(read_gguf_metadata(default_gguf_path()))
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == TINY.vocab and tokens[-1] == f"[PAD{TINY.vocab - 1}]"
    smollm2 = load_tokenizer(read_gguf_metadata(default_gguf_path()))
    assert load_tokenizer(metadata).encode(TEXT) == smollm2.encode(TEXT)
    types = {t.name: t.tensor_type for t in GGUFReader(path).tensors}
    assert "output.weight" not in types  # tied: the converter leaves the copy out, llama.cpp reuses token_embd
    assert types["blk.0.ffn_down.weight"] == GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32


def test_the_engine_reads_the_shape_back_as_transformers_computes_it(built) -> None:
    reference, path = built
    config, weights, _ = load_gguf(path, progress=False)
    assert (config.architecture, config.num_layers, config.num_kv_heads) == (TINY.arch, TINY.layers, TINY.kv_heads)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
    model = LlamaModel(config, weights)
    pool = model.make_pool(16, 8)
    table = BlockTable()
    pool.grow(table, len(PROMPT))
    (got,) = model.forward_all([SeqInput(PROMPT, 0, table)], pool)
    assert (got - want).abs().max().item() < 1e-3 * want.abs().max().item()


def test_a_model_named_by_its_path_is_that_file_and_vllm_copies_sit_beside_each_other(tmp_path: Path) -> None:
    given = tmp_path / "some-model-q4_k_m.gguf"
    assert peer.resolve_model(str(given), llama_python=tmp_path / "python") == given
    assert peer.resolve_model(None, llama_python=tmp_path / "python") is None
    assert peer.hf_dir_for(None) == peer.hf_dir_for(default_gguf_path()) == Path("bench/.peer/smollm2-hf")
    assert peer.hf_dir_for(given) == Path("bench/.peer/some-model-q4_k_m-hf")
    with pytest.raises(shapes.KVTierError, match="quantizer"):
        shapes.random_gguf(TINY, tokenizer=read_gguf_metadata(default_gguf_path()), llama_python=tmp_path / "no")


def test_vllms_copy_of_another_architecture_is_that_architecture_with_the_same_weights(built, tmp_path: Path) -> None:
    from kvtier.model.hf_export import export_hf

    transformers = pytest.importorskip("transformers")
    reference, path = built
    out = export_hf(path, tmp_path / "tiny-hf")
    copy = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(copy).__name__ == "Qwen2ForCausalLM" and copy.config.tie_word_embeddings
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
        got = copy(torch.tensor([PROMPT])).logits[0]
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
