"""The limits `kvtier bench peer` prints next to the engines: the arithmetic of a hit, the bytes of a decode step."""

from __future__ import annotations

import dataclasses
import math

import torch

from kvtier.bench.peer import limits


def test_hit_flops_by_hand(loaded_model) -> None:
    shape = {"vocab_size": 10, "hidden_size": 4, "intermediate_size": 8, "num_heads": 2, "num_kv_heads": 1}
    toy = dataclasses.replace(loaded_model.model.config, **shape, head_dim=2, num_layers=1)
    # per token: Q/K/V 4 x (4 + 2 + 2) + O 4 x 4 + gate/up/down 3 x 4 x 8 = 144 multiply-adds;
    # attention: tokens at 3 and 4 see 4 and 5 positions, scores and values 4 wide each: 2 x 4 x 9 = 72;
    # the head on the last token: 4 x 10 = 40. (2 x 144 + 72 + 40) x 2 = 800
    assert limits.hit_flops(toy, cached=3, new=2) == 800
    two_layers = dataclasses.replace(toy, num_layers=2)
    assert limits.hit_flops(two_layers, cached=3, new=2) == 800 + 2 * (2 * 144 + 72)


def test_decode_bytes_are_the_weights_read_plus_every_position_k_and_v(loaded_model) -> None:
    model = loaded_model.model
    c = model.config
    weights = limits.decode_bytes(model, 0, 4)
    per_position = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert limits.decode_bytes(model, 2048, 4) == weights + 2048 * per_position
    matrices = [t for layer in model.layers for t in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
    dense = sum(t.numel() * t.element_size() for t in (*matrices, model.lm_head))
    if model.decode_layers is None:  # no GGUF blocks: a decode step reads the dense matrices
        assert weights == dense
    else:  # the blocks the decode products read: 4.5-8.5 bits a weight against float32's 32
        quant = [m for layer in model.decode_layers for m in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]
        assert weights == sum(m.nbytes for m in quant) + model.lm_head_blocks.nbytes
        assert dense / 8 < weights < dense / 3


def test_measured_rates_are_rates() -> None:
    assert 0 < limits.matmul_gflops(torch.float32, n=64) < math.inf
    assert 0 < limits.read_gbs(1 << 20) < math.inf
