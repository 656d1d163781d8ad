"""What the machine allows, next to what the engines did: a hit's arithmetic over the measured matmul rate,
a decode step's bytes over the measured read bandwidth.

A ratio against a peer says who is faster here; a limit says how much
faster anyone could be. A hit of N cached + 64 new tokens has to do the new
tokens' arithmetic (their projections and MLP, attention over every
position each one sees, the head on the last), so it cannot take less than
those FLOPs over the best rate this CPU sustains: a large square matmul in
the engine's dtype on the same threads. A decode step has to read every
weight once and the K/V of every position once, so it cannot take less than
those bytes over the rate one pass of reading a large tensor reaches. Both
rates are measured in the run, on the threads the engines get.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.bench.tiers import median_s
from kvtier.engine.llama import LlamaModel
from kvtier.model.config import ModelConfig

MATMUL_N = 2048  # a square matmul this size runs at the CPU's sustained rate, well past cache effects
READ_BYTES = 512 * 1024**2  # far past the last-level cache
REPS = 5


def hit_flops(c: ModelConfig, cached: int, new: int) -> int:
    """Floating-point operations (2 per multiply-add) of ``new`` tokens after ``cached`` ones, first token out."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    weights = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attended = sum(cached + t + 1 for t in range(new))  # causal: token t sees the cache and itself
    attention = 2 * q * attended  # scores and the weighted sum of values, q-width each
    return 2 * (c.num_layers * (new * weights + attention) + c.hidden_size * c.vocab_size)


def decode_bytes(model: LlamaModel, context: int, kv_itemsize: int) -> int:
    """Bytes one decode step reads at ``context``: the weights its products use, and the K/V of every position."""
    c = model.config
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * context * kv_itemsize
    if model.decode_layers is not None and model.lm_head_blocks is not None:
        mats = [m for layer in model.decode_layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        return sum(m.nbytes for m in mats) + model.lm_head_blocks.nbytes + kv
    dense = [t for layer in model.layers for t in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    return sum(t.numel() * t.element_size() for t in (*dense, model.lm_head)) + kv


def matmul_gflops(dtype: torch.dtype, n: int = MATMUL_N) -> float:
    """The rate of one ``[n, n] @ [n, n]`` in ``dtype``, GFLOP/s: the best this CPU sustains through torch."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / median_s(lambda: a @ b, REPS) / 1e9


def read_gbs(nbytes: int = READ_BYTES) -> float:
    """The rate of one pass that reads ``nbytes`` (a float32 sum), GB/s."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / median_s(x.sum, REPS) / 1e9


@dataclass(frozen=True)
class Limits:
    """The two measured rates, and what they allow each hit size and the decode step."""

    matmul_gflops: float
    read_gbs: float
    new_tokens: int
    hit_gflop: dict[int, float]  # cached tokens -> the hit's GFLOP
    decode_context: int
    decode_mb: float

    def hit_s(self, cached: int) -> float:
        return self.hit_gflop[cached] / self.matmul_gflops

    @property
    def decode_tok_s(self) -> float:
        return self.read_gbs * 1e3 / self.decode_mb

    def as_json(self) -> dict[str, Any]:
        return {
            "matmul_gflops": round(self.matmul_gflops, 1),
            "matmul": f"[{MATMUL_N}, {MATMUL_N}] @ [{MATMUL_N}, {MATMUL_N}] in the engine's dtype",
            "read_gbs": round(self.read_gbs, 1),
            "read": f"one float32 sum over {READ_BYTES // 1024**2} MiB",
            "hit": [
                {"cached": n, "new": self.new_tokens, "gflop": round(g, 2), "min_s": round(self.hit_s(n), 4)}
                for n, g in self.hit_gflop.items()
            ],
            "decode": {
                "context": self.decode_context,
                "mb_per_token": round(self.decode_mb, 1),
                "max_tok_s": round(self.decode_tok_s, 1),
            },
        }


def measure(model: LlamaModel, sizes: Sequence[int], new: int, decode_context: int) -> Limits:
    """Both rates on this machine, with the threads torch is set to, and the limits for ``model``."""
    kv_itemsize = torch.empty((), dtype=model.dtype).element_size()
    return Limits(
        matmul_gflops=matmul_gflops(model.dtype),
        read_gbs=read_gbs(),
        new_tokens=new,
        hit_gflop={n: hit_flops(model.config, n, new) / 1e9 for n in sizes},
        decode_context=decode_context,
        decode_mb=decode_bytes(model, decode_context, kv_itemsize) / 1e6,
    )
