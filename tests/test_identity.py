"""The identity a cache service and its clients agree on, from the model's files alone."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvtier.identity import hf_shape, kv_identity_for
from kvtier.layout import LayoutOrder
from kvtier.model import default_gguf_path


def hf_dir(root: Path, weights: bytes = b"weights") -> Path:
    root.mkdir()
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "model.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text("{}")  # not part of the KV's identity
    return root


def test_hf_directory_shape_and_fingerprint(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "m")
    assert hf_shape(model) == (30, 3, 64)
    layout, fp = kv_identity_for(model, torch.float32, 128, tmp_path / "data", order=LayoutOrder.HEAD_MAJOR)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) == (30, 3, 64, 128)
    assert layout.layer_shape == (3, 2, 128, 64)
    assert layout.descriptor.startswith("head_major:")
    assert fp.startswith("hf-sha256:") and fp.endswith(":float32")
    # a restart agrees; other dtypes, other weights do not; files outside the weights do not count
    assert kv_identity_for(model, torch.float32, 128, tmp_path / "data")[1] == fp
    assert kv_identity_for(model, torch.bfloat16, 128, tmp_path / "data")[1] != fp
    (model / "tokenizer.json").write_text('{"changed": 1}')
    assert kv_identity_for(model, torch.float32, 128, tmp_path / "data")[1] == fp
    other = hf_dir(tmp_path / "other", weights=b"other weights")
    assert kv_identity_for(other, torch.float32, 128, tmp_path / "data")[1] != fp


def test_gguf_identity_matches_the_engine(tmp_path: Path) -> None:
    layout, fp = kv_identity_for(default_gguf_path(), torch.float32, 16, tmp_path)
    assert layout.descriptor == "layer_major:L30:H3:D64:B16:float32"
    assert fp.startswith("sha256:") and fp.endswith(":float32")
