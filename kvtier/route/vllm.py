"""vLLM's KV events, read into the router's index, so the router can front vLLM instances too.

vLLM publishes its prefix cache's changes over ZMQ (``--kv-events-config``,
``vllm/distributed/kv_events.py``): a PUB socket sends multipart messages
``(topic, sequence number as 8 bytes big-endian, payload)``, the payload a
msgpack ``KVEventBatch``: ``[ts, events, data_parallel_rank]`` whose events
are maps tagged by ``"type"``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``medium``, ...),
``BlockRemoved`` (``block_hashes``, ``medium``) and ``AllBlocksCleared``.
The structs below mirror those fields (unknown ones are ignored), so
nothing of vLLM is imported.

vLLM names blocks by its own hashes, which the router cannot compute. A
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

import msgspec

from kvtier.keys import BlockKey, KeyHasher
from kvtier.route.index import BlockIndex, RoutedPrefixes
from kvtier.tiers.base import TierKind

log = logging.getLogger("kvtier.route")

VllmHash = bytes | int
MEDIUM_TIER = {None: TierKind.DEVICE, "GPU": TierKind.DEVICE, "CPU": TierKind.HOST, "STORAGE": TierKind.DISK}
MAX_HASHES = 1_000_000  # vLLM hash -> kvtier key, least recently stored forgotten first


class BlockStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[VllmHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


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
        for event in DECODER.decode(payload).events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            else:
                self._forget(self._index.cleared(self.backend, TierKind.DEVICE))

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
        self._index.stored(self.backend, MEDIUM_TIER.get(event.medium, TierKind.HOST), keys)
        self.counts.stored += len(keys)

    def _removed(self, event: BlockRemoved) -> None:
        keys = [k for h in event.block_hashes if (k := self._keys.get(h)) is not None]
        self._forget(self._index.removed(self.backend, MEDIUM_TIER.get(event.medium, TierKind.HOST), keys))
        self.counts.removed += len(keys)

    def _forget(self, gone: list[BlockKey]) -> None:
        if self._guesses is not None:
            self._guesses.forget(self.backend, gone)


def split(frames: list[bytes]) -> tuple[int, bytes]:
    """``(sequence number, payload)`` of one published message ``(topic, seq, payload)``."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise msgspec.DecodeError(f"not a vLLM KV event message: {len(frames)} frames")
    return int.from_bytes(frames[1], "big"), frames[2]
