"""The built-in engine (step ④): a Llama forward pass over a paged KV pool, kvtier's device tier."""

from kvtier.engine.llama import LlamaModel, SeqInput
from kvtier.engine.pool import BlockTable, KVPool

__all__ = ["BlockTable", "KVPool", "LlamaModel", "SeqInput"]
