"""Choosing the next token: greedy, or temperature / top-k / top-p with a seed.

Each request owns a ``torch.Generator`` seeded from its ``seed``, so a sampled
request gives the same tokens whether it runs alone or batched with others,
and whether its prefix came from the cache or was recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Sampler:
    params: SamplingParams
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = torch.Generator()
        if self.params.seed is not None:
            self.generator.manual_seed(self.params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """Pick one token from a ``[vocab]`` row of logits (any float dtype)."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
            drop = cum - torch.softmax(sorted_scores, dim=-1) >= p.top_p  # keep the token that crosses top_p
            drop[0] = False  # a top_p that rounds to 0 in float32 must still leave the most likely token
            scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
