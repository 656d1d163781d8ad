"""kvtier inside llama-cpp-python: a ``LlamaCache`` whose saved states live in the node's cache service.

Use it with::

    llm = Llama(model_path=GGUF, ...)
    KVTierLlamaCache.attach(llm, "unix:///path/to/cache.sock")

beside ``kvtier cache serve --model GGUF --dtype float16 --block-size 16``
(float16: llama.cpp's KV type; 16 tokens a block, a chunk of
``layout.block_bytes``, about the KV of one block of tokens).

What llama-cpp-python (0.3.36) does with a cache: before a completion,
``Llama._create_completion`` asks ``self.cache[prompt_tokens]`` and loads the
state it gets (``load_state``) when that state shares more leading tokens
with the prompt than the context already holds; ``Llama.generate`` then
drops the state's KV past the shared prefix and evaluates the rest. After
the completion it stores ``self.cache[prompt + completion] = save_state()``.
So ``__getitem__`` returns the state sharing the longest prefix (KeyError
when none), and neither call may fail the completion: a cache service that
is down, gone, or holding damaged bytes is a miss (KeyError, False, nothing
stored), counted in :attr:`KVTierLlamaCache.counters`, and llama.cpp
recomputes. States are found by kvtier block keys over their tokens and
stored as named blocks (:mod:`.llamacpp_store`), in a format with no pickle
(:mod:`.llamacpp_format`), shared by every process of the node and, with
the service's disk tier, kept across restarts.

What is kept of a ``LlamaState``, and why it gives identical output:

- ``input_ids[:n_tokens]``, ``n_tokens``, ``seed``. ``load_state`` makes the
  returned ``input_ids`` llama's own buffer and ``eval`` writes past
  ``n_tokens`` into it, so it comes back as long as the context
  (``n_ctx``), zero past ``n_tokens``: nothing reads those as tokens
  (``generate`` compares ``_input_ids``, which stops at ``n_tokens``).
- ``llama_state``, whole: llama.cpp's own serialisation of the context (the
  KV of ``n_tokens`` tokens). Decoding continues from exactly that.
- ``scores``: by default only its shape. With ``logits_all=False`` (the
  default) llama-cpp-python never writes ``scores`` (sampling reads
  llama.cpp's logits; ``eval`` no longer copies them), so the rows a state
  carries are uninitialised memory: up to ``n_batch x n_vocab`` float32,
  more bytes than the KV of a small model, and meaningless. And after
  ``load_state`` llama always evaluates at least one token before it samples
  (``_requires_eval``), so the first token comes from fresh logits either
  way. A state comes back with one zero row, which ``load_state`` broadcasts
  over the rows it resets. With ``logits_all=True`` the rows are real logits
  that ``logprobs`` read for prompt tokens: pass ``keep_scores=True`` (exact
  float32), and states saved without them are not used.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from llama_cpp.llama import Llama, LlamaState
from llama_cpp.llama_cache import BaseLlamaCache

from kvtier.cache import NodeService, connect_service
from kvtier.config import load_config
from kvtier.connectors.llamacpp_format import Marker, SavedState, StateHeader, pack_state
from kvtier.connectors.llamacpp_store import MARK_EVERY, SaveOutcome, StateStore
from kvtier.identity import kv_identity_for
from kvtier.keys import KeyHasher, Secret

log = logging.getLogger(__name__)

KV_DTYPE = torch.float16  # llama.cpp's KV cache type unless type_k / type_v say otherwise
BLOCK_SIZE = 16
# Positions are chained with a public constant, not a secret: they become names, and the service keys
# every name with the deployment's own secret before it reaches a tier.
_POSITIONS = Secret(hashlib.sha256(b"kvtier llama.cpp state positions").digest())


@dataclass
class Counters:
    """What this cache did, for the engine's operator (and the tests)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0  # prompt tokens the states returned share with their prompts (what llama skips)
    last_hit_tokens: int = 0
    saves: Counter[SaveOutcome] = field(default_factory=Counter)
    service_failures: int = 0


def flavour_of(llm: Llama) -> str:
    """The context settings that change llama.cpp's state bytes: states of two flavours never meet."""
    p = llm.context_params
    names = ("type_k", "type_v", "flash_attn_type", "swa_full", "n_seq_max", "kv_unified")
    return ",".join(f"{n}={getattr(p, n, None)}" for n in names)


def socket_path(socket: str | os.PathLike[str]) -> Path:
    """``unix:///abs/path`` or a plain path."""
    text = os.fspath(socket)
    return Path(text.removeprefix("unix://"))


class KVTierLlamaCache(BaseLlamaCache):
    def __init__(
        self,
        socket: str | os.PathLike[str],
        model_path: str | os.PathLike[str],
        *,
        n_ctx: int | None = None,
        flavour: str = "",
        namespace: str | None = None,
        config: str | os.PathLike[str] | None = None,
        keep_scores: bool = False,
        mark_every: int = MARK_EVERY,
    ) -> None:
        """A cache for a ``Llama`` over ``model_path``; :meth:`attach` fills ``n_ctx`` and ``flavour`` from one.

        ``n_ctx``: the context of the Llama it serves (states longer are
        misses, shorter ones come back padded to it); None: as saved.
        ``config``: a kvtier YAML file (its data directory memoises the
        model's fingerprint; its namespace is the default).
        """
        super().__init__(capacity_bytes=0)
        cfg = load_config(config)
        self.socket = socket_path(socket)
        self.namespace = namespace or cfg.cache.namespace
        self.n_ctx = n_ctx
        self.keep_scores = keep_scores
        self.layout, self.fingerprint = kv_identity_for(model_path, KV_DTYPE, BLOCK_SIZE, cfg.data_dir)
        self._hasher = KeyHasher(
            _POSITIONS,
            model_fingerprint=self.fingerprint,
            layout_descriptor=self.layout.descriptor,
            block_size=BLOCK_SIZE,
        )
        self._flavour = flavour
        self._mark_every = mark_every
        self.counters = Counters()
        self._link = connect_service(
            self.socket, self.layout, self.fingerprint, count_failures=self._count_failures,
            miss_message="llama.cpp states are misses",
        )  # fmt: skip
        self._last_prompt = np.empty(0, dtype=np.int32)
        self.last_saved: Marker | None = None  # where the last state stored (or found held) sits

    @classmethod
    def attach(cls, llm: Llama, socket: str | os.PathLike[str], **kwargs: Any) -> KVTierLlamaCache:
        """A cache for ``llm`` (its model, context length and state flavour), set as its cache."""
        cache = cls(socket, llm.model_path, n_ctx=llm.n_ctx(), flavour=flavour_of(llm), **kwargs)
        llm.set_cache(cache)
        return cache

    # -- the service -------------------------------------------------------------------------------
    def _count_failures(self, n: int) -> None:
        self.counters.service_failures += n

    def _service(self) -> NodeService | None:
        return self._link.client()

    @property
    def service_failures(self) -> int:
        """Every service failure so far: those counted plus the live client's not yet counted."""
        return self.counters.service_failures + self._link.unreported_failures()

    def _store(self) -> StateStore | None:
        client = self._service()
        if client is None:
            return None
        return StateStore(
            client,
            self._hasher,
            self.namespace,
            chunk_bytes=self.layout.block_bytes,
            token_bytes=self.layout.block_bytes // BLOCK_SIZE,
            flavour=self._flavour,
            mark_every=self._mark_every,
            # a quarter of the host tier per load, as kvtier's own engine asks: others' loads still fit beside it
            max_pinned=max(1, client.welcome.slab_bytes // client.welcome.slot_bytes // 4),
        )

    # -- llama-cpp-python's cache interface -----------------------------------------------------------
    @property
    def cache_size(self) -> int:
        """Bytes the service's tiers hold (a block on host and disk both counts twice); 0 while it is away."""
        client = self._service()
        stats = client.stats() if client is not None else None
        return 0 if stats is None else sum(t.used_bytes for t in stats.tiers.values())

    def _find_longest_prefix_key(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        """The longest full-block prefix of ``key`` that a stored state covers (by its names alone: no state read)."""
        store = self._store()
        if store is None:
            return None
        best = store.candidates(store.positions(np.asarray(key, dtype=np.int32)))
        return tuple(key[: (best[0].block + 1) * BLOCK_SIZE]) if best else None

    def __contains__(self, key: Sequence[int]) -> bool:
        """Whether a stored state covers a full block of ``key`` (one round trip: it may still fail to load)."""
        return self._find_longest_prefix_key(tuple(key)) is not None

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        tokens = np.asarray(key, dtype=np.int32)
        self._last_prompt = tokens
        self.counters.lookups += 1
        store = self._store()
        found = store.find(tokens, self._fits) if store is not None else None
        if found is None:
            self.counters.misses += 1
            raise KeyError("kvtier holds no llama.cpp state sharing a full block with these tokens")
        shared = _shared_prefix(found.state.input_ids, tokens)
        self.counters.hits += 1
        self.counters.hit_tokens += shared
        self.counters.last_hit_tokens = shared
        return self._llama_state(found.state)

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        """Store ``value`` under its own tokens (``input_ids[:n_tokens]``: what its KV covers), not ``key``.

        ``key`` is the prompt and the completion; the completion's last
        token was sampled but never evaluated, so the state covers one
        token less. The prompt asked for just before (``__getitem__``) marks
        where the next prompt most likely leaves this state.
        """
        tokens = np.asarray(value.input_ids[: value.n_tokens], dtype=np.int32)
        prompt = self._last_prompt
        prompt_tokens = len(prompt) if np.array_equal(tokens[: len(prompt)], prompt) else 0
        store = self._store()
        if store is None:
            self.counters.saves[SaveOutcome.FAILED] += 1
            return
        payload = pack_state(value, self.layout.block_bytes, keep_scores=self.keep_scores)
        saved = store.save(tokens, payload, prompt_tokens)
        self.counters.saves[saved.outcome] += 1
        self.last_saved = saved.where
        if saved.where is None:
            log.info("kvtier: a llama.cpp state of %d tokens was not stored (%s)", len(tokens), saved.outcome)

    # -- states ---------------------------------------------------------------------------------------
    def _fits(self, header: StateHeader) -> bool:
        """Whether llama can load a state: it fits the context, and carries scores wherever they are wanted."""
        fits = self.n_ctx is None or header.n_tokens <= self.n_ctx
        return fits and (header.scores_kept or not self.keep_scores)

    def _llama_state(self, saved: SavedState) -> LlamaState:
        h = saved.header
        ids = np.zeros(max(h.n_ctx, self.n_ctx or 0), dtype=np.intc)
        ids[: h.n_tokens] = saved.input_ids
        scores = saved.scores if saved.scores is not None else np.zeros((1, h.n_vocab), dtype=np.single)
        return LlamaState(
            input_ids=ids,
            scores=scores,
            n_tokens=h.n_tokens,
            llama_state=bytes(saved.llama_state),
            llama_state_size=h.llama_state_size,
            seed=h.seed,
        )

    def close(self) -> None:
        self._link.close()


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
