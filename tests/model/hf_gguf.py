"""Tiny random-weight Hugging Face models of each architecture, written to GGUF as llama.cpp's converter does.

Nothing here downloads: the weights are ``transformers``' own random
initialisation (seeded), so the oracle for a file is the model that wrote it.
The file is F32, written by :func:`kvtier.model.hf_gguf.write_gguf` as
llama.cpp's converter writes it. The Gemma 3 model has a window of 16
positions and one sliding layer before one global one, so a short prompt
crosses it.
"""

from __future__ import annotations

import torch
import transformers

from kvtier.bench.shapes import redraw
from kvtier.model.config import Architecture
from kvtier.model.hf_gguf import head_dim_of, write_gguf

__all__ = ["SHAPE", "VOCAB", "WINDOW", "head_dim_of", "random_model", "write_gguf"]

VOCAB = 512
WINDOW = 16
SHAPE = {  # 2 layers, GQA, head_dim != hidden / heads where the architecture allows it
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def random_model(arch: Architecture, seed: int = 0) -> transformers.PreTrainedModel:
    """A seeded random ``arch`` model in float32, weights scaled up so that logits differ visibly."""
    torch.manual_seed(seed)
    if arch is Architecture.LLAMA:
        config = transformers.LlamaConfig(**SHAPE, rope_theta=10000.0)
    elif arch is Architecture.QWEN2:
        config = transformers.Qwen2Config(**SHAPE, rope_theta=1000000.0)
    elif arch is Architecture.QWEN3:
        config = transformers.Qwen3Config(**SHAPE, head_dim=32, rope_theta=1000000.0)
    else:
        config = transformers.Gemma3TextConfig(
            **SHAPE,
            head_dim=32,
            query_pre_attn_scalar=32,  # llama.cpp scales by head_dim ** -0.5 for every Gemma 3 but the 27B
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return redraw(model, lambda name, p: 0.08)
