"""The shape of a Llama-family model, however it was stored (GGUF or safetensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Architecture(enum.StrEnum):
    """A GGUF ``general.architecture`` the forward pass serves: the Llama layer, with the named hooks of each."""

    LLAMA = "llama"  # Llama 2/3.x, SmolLM, Mistral-style: the plain layer
    QWEN2 = "qwen2"  # + biases on Q, K and V
    QWEN3 = "qwen3"  # + an RMSNorm over each head of Q and of K, before RoPE


@dataclass(frozen=True)
class ArchitectureTraits:
    """What a :class:`Architecture` adds to the plain Llama layer, as data the loader and forward read."""

    qkv_bias: bool = False
    qk_norm: bool = False
    interleaved_qk: bool = False  # llama.cpp stored Q/K rows permuted for its interleaved RoPE (undone on load)


TRAITS: dict[Architecture, ArchitectureTraits] = {
    Architecture.LLAMA: ArchitectureTraits(interleaved_qk=True),
    Architecture.QWEN2: ArchitectureTraits(qkv_bias=True),
    Architecture.QWEN3: ArchitectureTraits(qk_norm=True),
}


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
    The :attr:`architecture`'s hooks add their own tensors: Q/K/V biases
    (``...q_proj.bias``), per-head Q/K norms (``...self_attn.q_norm.weight``,
    ``...k_norm.weight``).
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
    architecture: Architecture = Architecture.LLAMA

    @property
    def traits(self) -> ArchitectureTraits:
        return TRAITS[self.architecture]
