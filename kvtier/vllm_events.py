"""KV events in vLLM's wire format: what kvtier publishes and what ``kvtier route`` reads, from kvtier and vLLM alike.

vLLM publishes its prefix cache's changes over ZMQ (``--kv-events-config``,
``vllm/distributed/kv_events.py``): a PUB socket sends multipart messages
``(topic, sequence number as 8 bytes big-endian, payload)``, the payload a
msgpack ``KVEventBatch``, ``[ts, events, data_parallel_rank]``, whose events
are maps tagged by ``"type"``: ``BlockStored``, ``BlockRemoved`` and
``AllBlocksCleared``. A ROUTER socket answers a request carrying a start
sequence number (8 bytes big-endian) with every buffered message from there,
each as ``(identity, b"", topic, seq, payload)``, then ``(identity, b"", b"",
END_SEQ, b"")``. Routers built for vLLM (llm-d's precise prefix-cache
scorer, Dynamo's KV router) read exactly this, so kvtier speaks it.

What kvtier adds stays inside what vLLM's own decoder accepts (a test
decodes kvtier's batches with vLLM's classes):

- **An incarnation.** A batch carries two trailing fields, which vLLM's
  array-like decoder ignores: ``incarnation`` (random per publisher start)
  and ``root`` (the key chain's origin for the default namespace; equal roots
  mean equal keys). A consumer seeing a new incarnation knows the node
  restarted and that its sequence numbers began again.
- **A snapshot.** A replay request from a sequence number the buffer no
  longer holds (or :data:`SNAPSHOT`, all ones) is answered by the node's whole
  state, stamped with the last published sequence number: first
  ``AllBlocksCleared``, then ``BlockStored`` of every key per medium. Events
  are set assignments, so applying the messages after that number converges
  whatever the snapshot already reflects.
- **Heartbeats.** An empty batch when nothing else was published for
  :data:`~kvtier.events.PING_S`: a consumer that hears nothing for several is
  cut off, and a restarted node is noticed even when idle.

Block hashes are kvtier's block keys (16 bytes, :meth:`kvtier.keys.KeyHasher.keys`):
xxh3-128 chained over each block's tokens as little-endian int32 from a
root that binds the deployment's secret, model, KV layout, block size and
namespace. A router holding the secret computes them from token ids exactly
(``kvtier route`` does); one without it can still count a prompt's blocks by
the hashes it learns, but cannot name new ones. Events carry no token ids
(``token_ids`` is empty): they would be the prompts themselves.
"""

from __future__ import annotations

import msgspec

from kvtier.tiers.base import TierKind

VllmHash = bytes | int
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last message of an answer carries this sequence number (vLLM's ``END_SEQ``)."""
SNAPSHOT = END_SEQ
"""A replay request from this sequence number asks for the node's whole state instead of its buffer."""

MEDIUM: dict[TierKind, str] = {
    TierKind.DEVICE: "GPU",
    TierKind.HOST: "CPU",
    TierKind.DISK: "DISK",
    TierKind.REMOTE: "REMOTE",
}
"""The ``medium`` of each tier's events: vLLM's names for the first two (GPU for the engine's pool on any device)."""
TIER_OF_MEDIUM: dict[str | None, TierKind] = {
    None: TierKind.DEVICE,
    "STORAGE": TierKind.DISK,  # vLLM's offloading connectors
    **{medium: tier for tier, medium in MEDIUM.items()},
}


class BlockStored(msgspec.Struct, tag="BlockStored"):
    """vLLM's fields, every one without a default written (vLLM's decoder requires them)."""

    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[VllmHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    """vLLM's ``KVEventBatch`` and kvtier's two trailing fields (absent in vLLM's own batches)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    incarnation: int | None = None
    root: bytes | None = None


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def split(frames: list[bytes]) -> tuple[int, bytes]:
    """``(sequence number, payload)`` of one published message ``(topic, seq, payload)``."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise msgspec.DecodeError(f"not a vLLM KV event message: {len(frames)} frames")
    return int.from_bytes(frames[1], "big"), frames[2]


__all__ = [
    "END_SEQ",
    "MEDIUM",
    "SNAPSHOT",
    "TIER_OF_MEDIUM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "split",
]
