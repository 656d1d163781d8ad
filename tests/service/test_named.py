"""Named blocks through the cache service: a real Unix socket, a real shared slab, a real disk tier."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.config import Config, WriteMode
from kvtier.service import CacheClient, CacheService
from kvtier.tiers.base import TierKind
from tests.helpers import as_bytes, make_config, payload, toy_layout

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "toy-model"
NS = "default"


def config(tmp: Path, write_mode: WriteMode = WriteMode.WRITE_BACK) -> Config:
    return make_config(
        tmp, host={"capacity_bytes": 8 * 4096}, disk={"capacity_bytes": 32 * 4096}, cache={"write_mode": write_mode}
    )


class Running:
    """A service on a thread of this process, over ``tmp``'s data directory."""

    def __init__(self, tmp: Path, write_mode: WriteMode = WriteMode.WRITE_BACK) -> None:
        self.svc = CacheService(
            config(tmp, write_mode),
            toy_layout(),
            model_fingerprint=FINGERPRINT,
            socket_path=tmp / "cache.sock",
            slab_dir=tmp,
        )
        self.thread = threading.Thread(target=self.svc.serve_forever, daemon=True)
        self.thread.start()

    def client(self) -> CacheClient:
        return CacheClient(self.svc.socket_path, toy_layout(), model_fingerprint=FINGERPRINT)

    def close(self) -> None:
        self.svc.close()
        self.thread.join(timeout=30)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    r = Running(tmp_path)
    yield r
    r.close()


def names(n: int) -> list[bytes]:
    return [f"state/{i}".encode() for i in range(n)]


def data(n: int, seed: int) -> list[torch.Tensor]:
    return [as_bytes(payload(toy_layout(), seed * 100 + i)) for i in range(n)]


def fill_from(blocks: list[torch.Tensor]):
    def fill(i: int, out: torch.Tensor) -> None:
        out.copy_(blocks[i])

    return fill


OTHER_PROCESS = """
import json, sys
from kvtier.service import CacheClient
from tests.helpers import toy_layout
names = [n.encode() for n in json.loads(sys.argv[2])]
with CacheClient(sys.argv[1], toy_layout(), model_fingerprint="toy-model") as c:
    with c.named_load(names, "default") as load:
        print(json.dumps({"exists": c.named_exists(names, "default"), "sums": [int(b.sum()) for b in load.blocks]}))
"""


def test_named_blocks_stored_by_one_process_load_in_another(running: Running) -> None:
    blocks = data(3, seed=1)
    with running.client() as c:
        assert c.named_store_from(names(3), fill_from(blocks), NS) == 3
        assert c.named_store_from(names(3), fill_from(blocks), NS) == 0  # held: nothing reserved again
        assert c.named_exists([b"state/2", b"nope"], NS) == [True, False]
    out = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, str(running.svc.socket_path), '["state/0", "state/1", "state/2"]'],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    assert json.loads(out.stdout) == {"exists": [True] * 3, "sums": [int(b.sum()) for b in blocks]}
    assert running.svc.manager.stats().pinned_blocks == 0


def test_a_named_load_pins_the_leading_names_until_released(running: Running) -> None:
    blocks = data(3, seed=2)
    with running.client() as c:
        c.named_store_from(names(3), fill_from(blocks), NS)
        with c.named_load([b"state/0", b"state/1", b"absent", b"state/2"], NS) as load:
            assert [torch.equal(v, b) for v, b in zip(load.blocks, blocks, strict=False)] == [True, True]
            assert load.served_from == [TierKind.HOST] * 2
            assert running.svc.manager.stats().pinned_blocks == 2
        assert running.svc.manager.stats().pinned_blocks == 0
        assert c.named_load(names(3), "other-tenant").blocks == []


def test_an_object_larger_than_half_the_host_tier_is_stored_in_rounds(running: Running) -> None:
    blocks = data(11, seed=3)  # host holds 8; the service reserves 4 at a time
    with running.client() as c:
        assert c.named_store_from(names(11), fill_from(blocks), NS) == 11
        assert c.named_exists(names(11), NS) == [True] * 11
        with c.named_load(names(11)[:4], NS) as load:
            assert all(torch.equal(v, b) for v, b in zip(load.blocks, blocks[:4], strict=True))


def test_named_blocks_come_back_from_disk_after_a_service_restart(tmp_path: Path) -> None:
    blocks = data(3, seed=4)
    first = Running(tmp_path)
    try:
        with first.client() as c:
            c.named_store_from(names(3), fill_from(blocks), NS)
    finally:
        first.close()  # write-back: the shutdown flushes host blocks to disk
    second = Running(tmp_path)
    try:
        with second.client() as c:
            assert c.named_exists(names(3), NS) == [True] * 3
            with c.named_load(names(3), NS) as load:
                assert load.served_from == [TierKind.DISK] * 3
                assert all(torch.equal(v, b) for v, b in zip(load.blocks, blocks, strict=True))
    finally:
        second.close()


def test_a_named_block_corrupted_on_disk_is_a_counted_miss(tmp_path: Path) -> None:
    blocks = data(3, seed=5)
    first = Running(tmp_path, WriteMode.WRITE_THROUGH)
    try:
        with first.client() as c:
            c.named_store_from(names(3), fill_from(blocks), NS)
        disk = first.svc.manager.disk
        assert disk is not None
        path, offset = disk.slab_path(disk.slot_of(first.svc.manager.hasher.named(b"state/1", NS)))
    finally:
        first.close()
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    second = Running(tmp_path)
    try:
        with second.client() as c:
            with c.named_load(names(3), NS) as load:
                assert len(load.blocks) == 1 and torch.equal(load.blocks[0], blocks[0])
            assert c.stats().tiers["disk"].checksum_failures == 1
            assert c.named_exists(names(3), NS) == [True, False, True]
            assert c.named_store_from(names(3), fill_from(blocks), NS) == 1  # stored again, whole
            with c.named_load(names(3), NS) as load:
                assert all(torch.equal(v, b) for v, b in zip(load.blocks, blocks, strict=True))
    finally:
        second.close()


def test_a_service_that_went_away_answers_named_calls_with_misses(running: Running) -> None:
    c = running.client()
    c.named_store_from(names(2), fill_from(data(2, seed=6)), NS)
    running.svc.close()
    assert c.named_exists(names(2), NS) == [False, False]
    assert c.named_load(names(2), NS).blocks == []
    assert c.named_store_from(names(2), fill_from(data(2, seed=6)), NS) == 0
    assert c.failures >= 3
    c.close()
