"""KV events in vLLM's format (:mod:`kvtier.vllm_events`) into the router's index, from vLLM and kvtier alike.

A kvtier node's batches carry its root (:class:`~kvtier.vllm_events.KVEventBatch`),
and their block hashes are kvtier's keys: they go into the index as they
are, once the root agrees with the router's. vLLM's own batches carry no
root, and vLLM names blocks by hashes the router cannot compute. A
``BlockStored`` carries its blocks' token ids and its parent's hash, so
:class:`VllmKeys` computes the kvtier key of each block from its parent's
(:meth:`~kvtier.keys.KeyHasher.keys` with ``parent``) and remembers vLLM's
hash -> kvtier key; a removal is then a lookup. A block whose parent the
router never saw stored (it subscribed late) cannot be keyed and is skipped:
a request is then routed by load, never wrongly. vLLM has no tenants, so its
blocks are keyed in the router's default namespace.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from kvtier.keys import KEY_BYTES, BlockKey, KeyHasher
from kvtier.route.index import BlockIndex, RoutedPrefixes
from kvtier.tiers.base import TierKind
from kvtier.vllm_events import (
    DECODER,
    TIER_OF_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    VllmHash,
    split,
)

log = logging.getLogger("kvtier.route")

MAX_HASHES = 1_000_000  # vLLM hash -> kvtier key, least recently stored forgotten first


@dataclass
class VllmCounts:
    stored: int = 0
    removed: int = 0
    skipped: int = 0  # blocks whose parent was never seen, or of another block size


class VllmKeys:
    """One vLLM backend's hashes, translated to kvtier keys and applied to the index."""

    def __init__(
        self, backend: str, hasher: KeyHasher, namespace: str, index: BlockIndex, guesses: RoutedPrefixes | None = None
    ) -> None:
        self.backend = backend
        self.counts = VllmCounts()
        self._hasher = hasher
        self._namespace = namespace
        self._index = index
        self._guesses = guesses  # what the router sent there: a removal ends the guess too
        self._keys: OrderedDict[VllmHash, BlockKey] = OrderedDict()

    def apply(self, payload: bytes) -> None:
        """One ZMQ payload (a msgpack ``KVEventBatch``); raises ``msgspec.DecodeError`` on anything else."""
        self.apply_batch(DECODER.decode(payload))

    def apply_batch(self, batch: KVEventBatch) -> None:
        """A decoded batch: a kvtier node's keys as they are (its root checked by the caller), vLLM's translated."""
        if batch.root is not None:
            self._apply_keys(batch)
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self._forget(self._index.cleared(self.backend, TierKind.DEVICE))

    def _apply_keys(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):  # every medium; a snapshot's stores follow
                self._index.drop(self.backend)
                if self._guesses is not None:
                    self._guesses.drop(self.backend)
                continue
            keys = [BlockKey(h) for h in event.block_hashes if isinstance(h, bytes) and len(h) == KEY_BYTES]
            tier = TIER_OF_MEDIUM.get(event.medium, TierKind.HOST)
            if isinstance(event, BlockStored):
                self._index.stored(self.backend, tier, keys)
                self.counts.stored += len(keys)
            else:
                self._forget(self._index.removed(self.backend, tier, keys))
                self.counts.removed += len(keys)

    def _stored(self, event: BlockStored) -> None:
        n = len(event.block_hashes)
        parent = None
        if event.parent_block_hash is not None:
            parent = self._keys.get(event.parent_block_hash)
        if event.block_size != self._hasher.block_size or (event.parent_block_hash is not None and parent is None):
            self.counts.skipped += n
            return
        keys = self._hasher.keys(event.token_ids[: n * event.block_size], self._namespace, parent=parent)
        for vllm_hash, key in zip(event.block_hashes, keys, strict=False):
            self._keys[vllm_hash] = key
            self._keys.move_to_end(vllm_hash)
        while len(self._keys) > MAX_HASHES:
            self._keys.popitem(last=False)
        self._index.stored(self.backend, TIER_OF_MEDIUM.get(event.medium, TierKind.HOST), keys)
        self.counts.stored += len(keys)

    def _removed(self, event: BlockRemoved) -> None:
        keys = [k for h in event.block_hashes if (k := self._keys.get(h)) is not None]
        self._forget(self._index.removed(self.backend, TIER_OF_MEDIUM.get(event.medium, TierKind.HOST), keys))
        self.counts.removed += len(keys)

    def _forget(self, gone: list[BlockKey]) -> None:
        if self._guesses is not None:
            self._guesses.forget(self.backend, gone)


__all__ = ["VllmKeys", "split"]
