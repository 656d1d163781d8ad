"""A Hugging Face model written to GGUF as llama.cpp's converter does: what random-shape models load from.

The metadata keys and tensor names are ``convert_hf_to_gguf.py``'s for each
architecture, including its Q/K row permutation for ``llama`` (undone by
:mod:`kvtier.model.gguf`) and Gemma's norm weights stored as ``1 + w``, so a
loader that gets any of it wrong fails against the model that wrote the
file. A tokenizer can be carried over from another GGUF whole: its
vocabulary is padded with unused ``[PAD{id}]`` entries up to the model's
embedding rows, as the converter pads Qwen's.

Used by the tests' tiny models and by :mod:`kvtier.bench.shapes`; imports
transformers' config types only through the model it is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

from kvtier.model.config import Architecture

if TYPE_CHECKING:
    from pathlib import Path

    import transformers

    from kvtier.model.gguf import GGUFMetadata

TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)
"""What a carried-over tokenizer takes besides its tokens, their types and scores, where the source has it."""


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
    *,
    tokenizer: GGUFMetadata | None = None,
    matrices: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """``model`` as a GGUF of ``arch`` at ``path``.

    ``formats`` maps a suffix of a Hugging Face weight name (``"q_proj.weight"``)
    to a block format ``gguf``'s own quantizer writes (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0); other matrices are ``matrices`` (F32 or F16), vectors F32.
    ``tokenizer``: another GGUF's metadata whose tokenizer the file carries;
    ``extra``: more metadata, key to value.
    A tied output matrix is left out, as the converter leaves it.
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
    writer.add_file_type(int(matrices is GGMLQuantizationType.F16))  # llama.cpp's ALL_F32 / MOSTLY_F16
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer, c.vocab_size)
    for key, value in (extra or {}).items():
        _add_value(writer, key, value)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        array = tensor.detach().to(torch.float32).numpy()
        stored = _as_stored(name, arch, c, array)
        fmt = next((f for suffix, f in (formats or {}).items() if name.endswith(suffix)), None)
        if fmt is None and stored.ndim == 2 and matrices is GGMLQuantizationType.F16:
            writer.add_tensor(_gguf_name(name, arch, c, array), stored.astype(np.float16))
        elif fmt is None:
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


def _add_tokenizer(writer: GGUFWriter, source: GGUFMetadata, vocab_size: int) -> None:
    tokens = list(source["tokenizer.ggml.tokens"])
    if len(tokens) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, over the model's {vocab_size} embedding rows")
    types = list(source.get("tokenizer.ggml.token_type", [int(TokenType.NORMAL)] * len(tokens)))
    pad = range(len(tokens), vocab_size)
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in pad])
    writer.add_token_types(types + [int(TokenType.UNUSED)] * len(pad))
    if "tokenizer.ggml.scores" in source:
        writer.add_token_scores(list(source["tokenizer.ggml.scores"]) + [-1000.0] * len(pad))
    for key in TOKENIZER_KEYS:
        if key in source:
            _add_value(writer, key, source[key])


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))
