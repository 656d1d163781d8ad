"""The shape of a Llama-family model, however it was stored (GGUF or safetensors)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters the forward pass needs; read from the file's metadata.

    Weights travel beside it as ``dict[str, torch.Tensor]`` in Hugging Face
    Llama names (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_proj.weight``,
    ``...k_proj``, ``...v_proj``, ``...o_proj``, ``model.layers.{i}.input_layernorm.weight``,
    ``model.layers.{i}.post_attention_layernorm.weight``, ``model.layers.{i}.mlp.gate_proj.weight``,
    ``...up_proj``, ``...down_proj``, ``model.norm.weight``, and ``lm_head.weight`` unless tied),
    with Q and K rows in Hugging Face (rotate-half RoPE) order: a GGUF loader
    undoes llama.cpp's interleaving permutation before handing them over.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
