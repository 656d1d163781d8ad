"""What KV a cache holds: the (layout, model fingerprint) pair that roots every block key and the service handshake.

kvtier's own engine reads a GGUF file; vLLM and SGLang read a Hugging Face
directory of the same model, and compute KV in their own dtype and block
order. The cache service is started for one identity and refuses a client
that presents another, so both sides must derive it the same way: this module
is that one way, from the model's files alone (no weights loaded).

A fingerprint names the exact weights (a SHA-256 over their bytes, remembered
by path, size and mtime so a restart does not rehash) and the compute dtype:
the same weights in bfloat16 and float32 give different KV.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from kvtier.layout import KVLayout, LayoutOrder, dtype_name

HF_WEIGHT_SUFFIXES = (".safetensors", ".bin")


def is_hf_dir(path: str | os.PathLike[str]) -> bool:
    return Path(path, "config.json").is_file()


def hf_shape(model_dir: str | os.PathLike[str]) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` from a Hugging Face ``config.json``."""
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    cfg = cfg.get("text_config", cfg)  # multimodal configs nest the language model's
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return int(cfg["num_hidden_layers"]), kv_heads, head_dim


def hf_fingerprint(model_dir: str | os.PathLike[str], dtype: torch.dtype, cache_dir: str | os.PathLike[str]) -> str:
    """``hf-sha256:<hex>:<dtype>`` over ``config.json`` and every weight file, by name, in name order."""
    from kvtier.model import file_sha256

    root = Path(model_dir)
    files = sorted(p for p in root.iterdir() if p.name == "config.json" or p.name.endswith(HF_WEIGHT_SUFFIXES))
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{file_sha256(f, cache_dir)}\n".encode())
    return f"hf-sha256:{h.hexdigest()}:{dtype_name(dtype)}"


def kv_identity_for(
    model_path: str | os.PathLike[str],
    dtype: torch.dtype,
    block_size: int,
    data_dir: str | os.PathLike[str],
    *,
    order: LayoutOrder = LayoutOrder.LAYER_MAJOR,
    kv_dtype: torch.dtype | None = None,
) -> tuple[KVLayout, str]:
    """The layout and fingerprint of KV computed from ``model_path`` (a GGUF file or a Hugging Face directory).

    ``dtype`` is the compute dtype (the fingerprint's); ``kv_dtype`` the KV pool's where it differs
    (``engine.kv_dtype: int8``), else the same. An 8-bit pool in kvtier's own layer-major order carries
    its rows' scales (kvtier's engine writes them); in another order it is that engine's pages as they are
    (vLLM's fp8).
    """
    from kvtier.model import model_fingerprint, read_gguf_metadata

    if is_hf_dir(model_path):
        layers, kv_heads, head_dim = hf_shape(model_path)
        fingerprint = hf_fingerprint(model_path, dtype, data_dir)
    else:
        meta = read_gguf_metadata(model_path)
        arch = meta.architecture
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
        layers = int(meta[f"{arch}.block_count"])
        fingerprint = model_fingerprint(model_path, dtype, data_dir)
    kv = kv_dtype or dtype
    scaled = kv in (torch.int8, torch.float8_e4m3fn) and order is LayoutOrder.LAYER_MAJOR
    return KVLayout(layers, kv_heads, head_dim, block_size, kv, order, row_scales=scaled), fingerprint
