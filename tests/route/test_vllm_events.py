"""vLLM's KV event payloads (msgpack, as vLLM's ZMQ publisher sends them) into the router's index."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import pytest

from kvtier.config import EventSource
from kvtier.keys import KeyHasher, Secret
from kvtier.route.backends import Backend, Fleet
from kvtier.route.choice import RoundRobin
from kvtier.route.index import BlockIndex
from kvtier.route.subscribe import follow_zmq
from kvtier.route.vllm import VllmKeys
from kvtier.tiers.base import TierKind
from kvtier.vllm_events import split

B = 4

# What vLLM 0.32.0's publisher sends (its own structs and msgpack encoder) for:
# BlockStored(hashes 11, 12; no parent; tokens 0..7; GPU),
# BlockStored(hash 13; parent 12; tokens 8..11; GPU), BlockRemoved(hash 12; GPU), AllBlocksCleared():
# VLLM_PAYLOAD_SOURCE, run in .venv-peer-vllm, printed these.
VLLM_PAYLOAD_SOURCE = """
from vllm.distributed.kv_events import *
import msgspec
e = [BlockStored([11, 12], None, list(range(8)), 4, None, "GPU", None),
     BlockStored([13], 12, list(range(8, 12)), 4, None, "GPU", None),
     BlockRemoved([12], "GPU"), AllBlocksCleared()]
print(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=e[:2])).hex())
print(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=2.5, events=e[2:3])).hex())
print(msgspec.msgpack.Encoder().encode(KVEventBatch(ts=3.5, events=e[3:])).hex())
"""
STORED, REMOVED, CLEARED = (
    bytes.fromhex(
        "93cb3ff80000000000009288a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b0cb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980001020304050607aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c088a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573910db1706172656e745f626c6f636b5f686173680ca9746f6b656e5f6964739408090a0baa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0c0"
    ),
    bytes.fromhex(
        "93cb40040000000000009183a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573910ca66d656469756da3475055c0"
    ),
    bytes.fromhex("93cb400c0000000000009181a474797065b0416c6c426c6f636b73436c6561726564c0"),
)


def make() -> tuple[VllmKeys, KeyHasher, BlockIndex]:
    hasher = KeyHasher(Secret(b"s" * 32), model_fingerprint="m", layout_descriptor="l", block_size=B)
    index = BlockIndex()
    return VllmKeys("vllm", hasher, "default", index), hasher, index


def test_stored_blocks_get_the_keys_kvtier_computes_for_their_tokens() -> None:
    events, hasher, index = make()
    events.apply(STORED)
    keys = hasher.keys(list(range(12)), "default")
    assert index.match("vllm", keys) == [TierKind.DEVICE] * 3
    events.apply(REMOVED)
    assert index.match("vllm", keys) == [TierKind.DEVICE]  # the chain breaks at the removed block
    events.apply(CLEARED)
    assert index.blocks("vllm") == 0
    assert (events.counts.stored, events.counts.removed, events.counts.skipped) == (3, 1, 0)


def test_a_block_whose_parent_was_never_seen_is_skipped() -> None:
    events, _, index = make()
    late = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [99], "parent_block_hash": 98, "token_ids": [1, 2, 3, 4],
                "block_size": B, "lora_id": None, "medium": "GPU"}]]
    )  # fmt: skip
    events.apply(late)
    assert index.blocks("vllm") == 0 and events.counts.skipped == 1


def test_frames_split_and_garbage_is_refused() -> None:
    assert split([b"", (7).to_bytes(8, "big"), STORED]) == (7, STORED)
    with pytest.raises(msgspec.DecodeError):
        split([b"only one frame"])
    with pytest.raises(msgspec.DecodeError):
        make()[0].apply(b"\x93not msgpack of a batch")


def test_follow_zmq_of_vllm_fills_the_index_and_drops_it_on_a_gap() -> None:
    """A real ZMQ PUB socket sending vLLM's frames; the router's subscriber keeps the backend's index."""
    import zmq

    _, hasher, _ = make()
    prompts = SimpleNamespace(hasher=hasher, namespace="default")
    backend = Backend("http://vllm", up=True)
    fleet = Fleet({backend.url: backend}, RoundRobin(), 16)
    keys = hasher.keys(list(range(12)), "default")
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    async def run() -> None:
        task = asyncio.create_task(follow_zmq(fleet, backend, prompts, EventSource(endpoint=f"tcp://127.0.0.1:{port}")))  # type: ignore[arg-type]
        seq = 0
        while not fleet.index.match(backend.url, keys):  # a SUB socket hears nothing until it has joined
            pub.send_multipart([b"", seq.to_bytes(8, "big"), STORED])
            seq += 1
            await asyncio.sleep(0.02)
        assert fleet.index.match(backend.url, keys) == [TierKind.DEVICE] * 3 and backend.events_live
        pub.send_multipart([b"", (seq + 5).to_bytes(8, "big"), REMOVED])  # five batches lost on the way
        while fleet.index.blocks(backend.url):
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        pub.close(linger=0)
