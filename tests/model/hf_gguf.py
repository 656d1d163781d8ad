"""Tiny random-weight Hugging Face models of each architecture, written to GGUF as llama.cpp's converter does.

Nothing here downloads: the weights are ``transformers``' own random
initialisation (seeded), so the oracle for a file is the model that wrote it.
The file is F32, with the metadata keys and tensor names of
``convert_hf_to_gguf.py`` for that architecture, including its Q/K row
permutation for ``llama`` (undone by :mod:`kvtier.model.gguf`) and Gemma's
norm weights stored as ``1 + w``, so a loader that gets any of it wrong
fails the comparison. The Gemma 3 model has a window of 16 positions and
one sliding layer before one global one, so a short prompt crosses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from kvtier.model.config import Architecture

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
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_LAYER = _LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: rotate-half rows to interleaved pairs, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model: transformers.PreTrainedModel,
    arch: Architecture,
    path: Path,
    formats: Mapping[str, GGMLQuantizationType] | None = None,
) -> Path:
    """``model`` as a GGUF of ``arch`` at ``path``: F32, but for matrices ``formats`` names.

    ``formats`` maps a suffix of a Hugging Face weight name (``"q_proj.weight"``)
    to a block format ``gguf``'s own quantizer writes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0).
    """
    c = model.config
    head_dim = head_dim_of(c)
    writer = GGUFWriter(str(path), arch.value)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(c))
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_vocab_size(c.vocab_size)
    if arch is Architecture.GEMMA3:
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    writer.add_file_type(0)  # all F32
    for name, tensor in model.state_dict().items():
        array = tensor.detach().to(torch.float32).numpy()
        stored = _as_stored(name, arch, c, array)
        fmt = next((f for suffix, f in (formats or {}).items() if name.endswith(suffix)), None)
        if fmt is None:
            writer.add_tensor(_gguf_name(name, arch, c, array), stored)
        else:
            writer.add_tensor(_gguf_name(name, arch, c, array), quantize(stored, fmt), raw_dtype=fmt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def head_dim_of(c: transformers.PretrainedConfig) -> int:
    """The config's own ``head_dim`` where it has one (Qwen3), else hidden / heads."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _rope_theta(c: transformers.PretrainedConfig) -> float:
    """transformers 5 keeps RoPE's base in ``rope_parameters``; older releases in ``rope_theta``."""
    parameters = getattr(c, "rope_parameters", None) or {}
    parameters = parameters.get("full_attention", parameters)  # Gemma 3: one per layer type
    return float(parameters.get("rope_theta") or c.rope_theta)


def _gguf_name(name: str, arch: Architecture, c: transformers.PretrainedConfig, array: np.ndarray) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA_LAYER if arch is Architecture.GEMMA3 else _LAYER)[module]}.{kind}"


def _as_stored(name: str, arch: Architecture, c: transformers.PretrainedConfig, array: np.ndarray) -> np.ndarray:
    if arch is Architecture.LLAMA and name.endswith("q_proj.weight"):
        return np.ascontiguousarray(_permute(array, c.num_attention_heads))
    if arch is Architecture.LLAMA and name.endswith("k_proj.weight"):
        return np.ascontiguousarray(_permute(array, c.num_key_value_heads))
    if arch is Architecture.GEMMA3 and name.endswith("norm.weight"):
        return np.ascontiguousarray(array + 1)  # Gemma's RMSNorm multiplies by 1 + w: the converter folds the 1 in
    return np.ascontiguousarray(array)
