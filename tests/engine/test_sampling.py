from __future__ import annotations

import pytest
import torch

from kvtier.engine.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5])


def draws(params: SamplingParams, n: int = 200) -> list[int]:
    sampler = Sampler(params)
    return [sampler(LOGITS) for _ in range(n)]


def test_greedy_is_argmax() -> None:
    assert draws(SamplingParams(), 3) == [1, 1, 1]


def test_top_k_one_and_tiny_top_p_are_argmax() -> None:
    assert set(draws(SamplingParams(temperature=1.0, top_k=1, seed=1))) == {1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.01, seed=1))) == {1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=5e-324, seed=1))) == {1}  # 0 in float32


def test_top_k_restricts_the_support() -> None:
    assert set(draws(SamplingParams(temperature=5.0, top_k=2, seed=3))) == {1, 2}


def test_top_p_keeps_the_token_that_crosses_the_mass() -> None:
    probs = torch.softmax(LOGITS, -1)
    mass = float(probs[1] + 0.5 * probs[2])  # inside the second token's share
    assert set(draws(SamplingParams(temperature=1.0, top_p=mass, seed=4))) == {1, 2}


def test_seed_makes_sampling_repeatable() -> None:
    p = SamplingParams(temperature=1.0, seed=42)
    assert draws(p) == draws(p)
    assert draws(p) != draws(SamplingParams(temperature=1.0, seed=43))


@pytest.mark.parametrize("bad", [{"max_tokens": -1}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_k": -2}])
def test_bad_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)
