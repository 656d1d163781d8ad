"""Putting an engine together from the config: model file → weights, tokenizer, template → engine + cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier import cache as seam
from kvtier import hardware
from kvtier.cache import Cache
from kvtier.config import ComputeDtype, Config, DecodeActivations, DecodedKV, DecodeWeights
from kvtier.engine import quant
from kvtier.engine.engine import Engine
from kvtier.engine.llama import LlamaModel
from kvtier.engine.speculate import PromptLookup
from kvtier.engine.verify import ShadowVerifier, VerifySettings
from kvtier.hardware import compute_dtype, cpu_isa, engine_device
from kvtier.keys import KeyHasher
from kvtier.layout import dtype_from_name
from kvtier.model import (
    ChatTemplate,
    ChatTemplateError,
    Tokenizer,
    default_gguf_path,
    load_chat_template,
    load_gguf,
    load_gguf_with_blocks,
    load_tokenizer,
    model_fingerprint,
)
from kvtier.model.chat import chat_ids

log = logging.getLogger("kvtier")


@dataclass(frozen=True)
class LoadedModel:
    path: Path
    model: LlamaModel
    tokenizer: Tokenizer
    chat: ChatTemplate | None  # None: a base model's file has none; it serves completions only
    fingerprint: str  # binds block keys and the disk tier to these exact weights and dtype

    def chat_ids(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        """A conversation's ids; :class:`ChatTemplateError` when the file has no chat template."""
        if self.chat is None:
            raise ChatTemplateError(f"{self.path.name} has no chat template (a base model): send completions")
        return chat_ids(self.tokenizer, self.chat, messages, add_generation_prompt=add_generation_prompt)


def load_model(config: Config, *, progress: bool = True) -> LoadedModel:
    path = config.engine.model_path or default_gguf_path()
    chosen = compute_dtype(config)
    dtype = dtype_from_name(chosen.value)
    device = engine_device(config)
    if config.engine.dtype is ComputeDtype.AUTO:
        log.info("engine dtype %s (auto, on %s with %s)", chosen.value, device.type, " ".join(cpu_isa()) or "no ISA")
    blocks = None
    if config.engine.decode_weights is DecodeWeights.GGUF and device.type == "cpu":  # the C kernels are CPU code
        (cfg, weights, metadata), blocks = load_gguf_with_blocks(path, dtype, progress=progress)
    else:
        cfg, weights, metadata = load_gguf(path, dtype, progress=progress)
    model = LlamaModel(
        cfg, weights, dtype, blocks=blocks, device=device, q8_decode=q8_decode(config), kv_dtype=kv_dtype(config)
    )
    return LoadedModel(
        path=Path(path),
        model=model,
        tokenizer=load_tokenizer(metadata),
        chat=load_chat_template(metadata) if metadata.chat_template else None,
        fingerprint=model_fingerprint(path, dtype, config.data_dir),
    )


def kv_dtype(config: Config) -> torch.dtype:
    """``engine.kv_dtype`` resolved (:func:`kvtier.hardware.kv_dtype`), as the pool's torch dtype."""
    return dtype_from_name(hardware.kv_dtype(config))


def q8_decode(config: Config) -> bool:
    """``engine.decode_activations: q8`` where this CPU runs it (AVX-512 VNNI); else exact, said in the log."""
    if config.engine.decode_activations is not DecodeActivations.Q8:
        return False
    if not quant.Q8:
        log.warning(
            "engine.decode_activations q8 needs AVX-512 VNNI, which this CPU lacks: decoding with exact products"
        )
        return False
    return True


def open_cache(loaded: LoadedModel, config: Config) -> Cache:
    """The tiers in this process, or a client of the node's cache service (:func:`kvtier.cache.open_cache`)."""
    layout = loaded.model.kv_layout(config.cache.block_size)
    return seam.open_cache(config, layout, model_fingerprint=loaded.fingerprint)


def make_engine(
    loaded: LoadedModel,
    config: Config,
    *,
    cache: Cache | None,
    keep_resident: bool | None = None,
    hasher: KeyHasher | None = None,
) -> Engine:
    """An engine over ``loaded``; ``cache=None`` and ``keep_resident=False`` give a full-recompute baseline.

    Keeping blocks resident needs block keys: from ``cache``, or from ``hasher``
    for an engine that uses only its own pool.
    """
    e = config.engine
    block_bytes = loaded.model.kv_layout(config.cache.block_size).block_bytes
    resident = e.keep_resident if keep_resident is None else keep_resident
    hasher = hasher or (cache.hasher if cache is not None else None)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        pool_blocks=max(1, int(e.pool_bytes) // block_bytes),
        block_size=config.cache.block_size,
        cache=cache,
        hasher=hasher,
        keep_resident=resident and hasher is not None,
        max_batch=e.max_batch,
        max_step_tokens=e.max_step_tokens,
        namespace=config.cache.namespace,
        prefetch=config.transfer.prefetch,
        layerwise=config.transfer.layerwise,
        speculative=prompt_lookup(config),
        cache_decoded=cache_decoded(config),
        windowed_loads=e.windowed_loads,
    )
    if cache is not None and config.verify.shadow_fraction > 0:
        engine.verifier = shadow_verifier(loaded.model, config)
    return engine


def cache_decoded(config: Config) -> bool:
    """``engine.decoded_kv`` resolved: ``auto`` caches decode-computed blocks in float32 with exact products only."""
    e = config.engine
    if e.decoded_kv is DecodedKV.AUTO:
        q8 = e.decode_activations is DecodeActivations.Q8
        return kv_dtype(config) == torch.float32 and not q8
    return e.decoded_kv is DecodedKV.CACHE


def shadow_verifier(model: LlamaModel, config: Config) -> ShadowVerifier:
    v = config.verify
    settings = VerifySettings(v.shadow_fraction, v.queue_size, v.max_tokens)
    return ShadowVerifier(model, config.cache.block_size, settings, config.engine.max_step_tokens)


def prompt_lookup(config: Config) -> PromptLookup | None:
    """The engine's drafting policy, or None where ``engine.speculative.prompt_lookup`` is off."""
    spec = config.engine.speculative
    if not spec.prompt_lookup:
        return None
    return PromptLookup(spec.num_draft_tokens, spec.min_ngram, spec.max_ngram)
