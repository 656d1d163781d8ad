"""The shape of a Llama-family model, however it was stored (GGUF or safetensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Architecture(enum.StrEnum):
    """A GGUF ``general.architecture`` the forward pass serves: the Llama layer, with the named hooks of each."""

    LLAMA = "llama"  # Llama 2/3.x, SmolLM, Mistral-style: the plain layer
    QWEN2 = "qwen2"  # + biases on Q, K and V
    QWEN3 = "qwen3"  # + an RMSNorm over each head of Q and of K, before RoPE
    GEMMA3 = "gemma3"  # + Q/K norms, norms after attention and MLP, GeGLU, scaled embeddings, sliding windows


class Activation(enum.StrEnum):
    """The MLP's gate: ``act(gate) * up``."""

    SILU = "silu"  # SwiGLU
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation (Gemma)


@dataclass(frozen=True)
class ArchitectureTraits:
    """What a :class:`Architecture` adds to the plain Llama layer, as data the loader and forward read.

    Values llama.cpp fixes per architecture rather than reading from the
    file (Gemma 3's pattern of sliding-window layers and their RoPE base)
    are fixed here the same way, so both compute the same model.
    """

    qkv_bias: bool = False
    qk_norm: bool = False
    interleaved_qk: bool = False  # llama.cpp stored Q/K rows permuted for its interleaved RoPE (undone on load)
    post_norms: bool = False  # an RMSNorm on the attention's and the MLP's output, before each residual add
    scaled_embedding: bool = False  # embeddings times sqrt(hidden_size)
    activation: Activation = Activation.SILU
    sliding_pattern: int = 0  # every n-th layer global, the others sliding-window (0: none); the file may say
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base


TRAITS: dict[Architecture, ArchitectureTraits] = {
    Architecture.LLAMA: ArchitectureTraits(interleaved_qk=True),
    Architecture.QWEN2: ArchitectureTraits(qkv_bias=True),
    Architecture.QWEN3: ArchitectureTraits(qk_norm=True),
    Architecture.GEMMA3: ArchitectureTraits(
        qk_norm=True,
        post_norms=True,
        scaled_embedding=True,
        activation=Activation.GELU_TANH,
        sliding_pattern=6,
        local_rope_theta=10000.0,
    ),
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
    ``...k_norm.weight``); with post-norms (Gemma), the norm before the MLP
    is ``pre_feedforward_layernorm`` and ``post_attention_layernorm`` /
    ``post_feedforward_layernorm`` norm the two outputs. Every norm is a
    plain RMSNorm times its weight: Gemma's ``1 + w`` was folded in by
    llama.cpp's converter, as it is in the GGUF.
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
    sliding_window: int | None = None  # positions a sliding-window layer sees (its own included)
    sliding_layers: tuple[bool, ...] = ()  # per layer: a sliding-window one? (empty: none is)
    local_rope_theta: float | None = None  # the sliding-window layers' RoPE base (None: rope_theta)

    @property
    def traits(self) -> ArchitectureTraits:
        return TRAITS[self.architecture]

    def window(self, layer: int) -> int | None:
        """Positions layer ``layer`` attends to back from a token, itself included; None: all of them."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None
