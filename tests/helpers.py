"""Shared toy shapes for the tests: small enough to be fast; real files and real LMDB underneath."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.config import Config, load_config
from kvtier.keys import DIGEST_BYTES, BlockDigest, BlockKey, KeyHasher, Secret
from kvtier.layout import KVLayout
from kvtier.tiers.base import BlockRecord

BLOCK = 4


def toy_layout(dtype: torch.dtype = torch.float32, block_size: int = BLOCK) -> KVLayout:
    """3 layers x 2 KV heads x head dim 8: 1,536 B per fp32 block, one 4 KiB slot."""
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=block_size, dtype=dtype)


def payload(layout: KVLayout, seed: int) -> torch.Tensor:
    """A typed block payload whose values identify ``seed`` (so crossed wires show)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.block_shape, generator=g).to(layout.dtype)


def record(i: int, parent: BlockKey | None = None) -> BlockRecord:
    """A record whose digest names ``i``: tiers compare digests as bytes, so tier tests need no hasher."""
    return BlockRecord(BlockDigest(i.to_bytes(DIGEST_BYTES, "little")), parent)


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


@contextlib.contextmanager
def read_only(root: Path) -> Iterator[None]:
    """Make ``root`` and everything under it really unwritable for this process, then restore it.

    Permission bits do not stop root, so root gets the immutable attribute
    (``chattr +i``: no file may be created, removed, or opened for writing);
    anyone else gets the write bits removed. Skips where neither is possible.
    """
    paths = [root, *sorted(root.rglob("*"))]
    if os.geteuid() != 0:
        modes = {p: stat.S_IMODE(p.stat().st_mode) for p in paths}
        for p in reversed(paths):
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p in paths:
                p.chmod(modes[p])
        return
    if shutil.which("chattr") is None:
        pytest.skip("root needs chattr +i to make a directory read-only")
    done = subprocess.run(["chattr", "-R", "+i", str(root)], capture_output=True, text=True)
    try:
        if done.returncode != 0:
            pytest.skip(f"chattr +i refused here: {done.stderr.strip()}")
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(root)], capture_output=True, check=False)


class Clock:
    """A clock a test steps (``clock.now += ttl``): TTLs pass without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
