"""The model: its shape, its weights from a GGUF file, its tokenizer and chat template."""

from __future__ import annotations

from kvtier.model.blocks import QuantBlocks, QuantKind
from kvtier.model.chat import ChatTemplate, ChatTemplateError, chat_ids, load_chat_template
from kvtier.model.config import ModelConfig
from kvtier.model.gguf import (
    GGUFMetadata,
    GGUFModel,
    file_sha256,
    load_gguf,
    load_gguf_blocks,
    load_gguf_with_blocks,
    model_fingerprint,
    read_gguf_metadata,
)
from kvtier.model.locate import ModelNotFoundError, default_gguf_path
from kvtier.model.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "GGUFMetadata",
    "GGUFModel",
    "ModelConfig",
    "ModelNotFoundError",
    "QuantBlocks",
    "QuantKind",
    "StreamDecoder",
    "Tokenizer",
    "chat_ids",
    "default_gguf_path",
    "file_sha256",
    "load_chat_template",
    "load_gguf",
    "load_gguf_blocks",
    "load_gguf_with_blocks",
    "load_tokenizer",
    "model_fingerprint",
    "read_gguf_metadata",
]
