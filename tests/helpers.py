"""Shared toy shapes for the tests: small enough to be fast; real files and real LMDB underneath."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvtier.config import Config, load_config
from kvtier.keys import KeyHasher, Secret
from kvtier.layout import KVLayout

BLOCK = 4


def toy_layout(dtype: torch.dtype = torch.float32, block_size: int = BLOCK) -> KVLayout:
    """3 layers x 2 KV heads x head dim 8: 1,536 B per fp32 block, one 4 KiB slot."""
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=block_size, dtype=dtype)


def payload(layout: KVLayout, seed: int) -> torch.Tensor:
    """A typed block payload whose values identify ``seed`` (so crossed wires show)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=g).to(layout.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def make_config(tmp: Path, **sections: dict) -> Config:
    env = {"KVTIER_DATA_DIR": str(tmp / "data"), "KVTIER_CACHE__BLOCK_SIZE": str(BLOCK)}
    cfg = load_config(environ=env)
    tree = cfg.model_dump()
    for name, values in sections.items():
        tree[name] = {**tree[name], **values}
    return Config.model_validate(tree)


def make_hasher(tmp: Path, layout: KVLayout, **kw) -> KeyHasher:
    return KeyHasher(
        Secret.load_or_create(tmp / "data"),
        model_fingerprint=kw.pop("model_fingerprint", "toy-model"),
        layout_descriptor=layout.descriptor,
        block_size=layout.block_size,
        **kw,
    )


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 49152, size=n, dtype=np.int32)


def shared_full_blocks(prompt: list[int], seen: list[list[int]], block_size: int = 16) -> int:
    """Tokens of the longest whole-block prefix ``prompt`` shares with a sequence whose KV was computed.

    Capped so one prompt token is always left to compute (the engine needs a logit to sample from).
    """
    best = 0
    for seq in seen:
        n = 0
        while n < min(len(prompt), len(seq)) and prompt[n] == seq[n]:
            n += 1
        best = max(best, n)
    return min(best // block_size, (len(prompt) - 1) // block_size) * block_size
