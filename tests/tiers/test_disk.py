from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import torch

from kvtier.config import FsyncMode, OnMismatch
from kvtier.errors import TierMismatchError
from kvtier.keys import BlockKey
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk import DiskTier
from tests.helpers import as_bytes, payload, toy_layout

ROOT = Path(__file__).resolve().parents[2]


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def rec(i: int) -> BlockRecord:
    return BlockRecord.of([i, i + 1, i + 2, i + 3], key(i - 1) if i else None)


def open_disk(path: Path, dtype: torch.dtype = torch.float32, **kw) -> DiskTier:
    kw.setdefault("model_fingerprint", "toy-model")
    return DiskTier(path, toy_layout(dtype), kw.pop("capacity", 16 * 4096), **kw)


def read(tier: DiskTier, i: int) -> torch.Tensor | None:
    out = torch.empty(tier.layout.block_bytes, dtype=torch.uint8)
    return out if tier.get(key(i), out) else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fsync", list(FsyncMode))
def test_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype, fsync: FsyncMode) -> None:
    tier = open_disk(tmp_path, dtype, fsync=fsync)
    layout = tier.layout
    blocks = [payload(layout, i) for i in range(6)]
    assert tier.put_many([key(i) for i in range(6)], blocks, [rec(i) for i in range(6)]) == [True] * 6
    for i, block in enumerate(blocks):
        out = read(tier, i)
        assert out is not None and torch.equal(out, as_bytes(block))
        layer = torch.empty(layout.layer_bytes, dtype=torch.uint8)
        assert tier.get_layer(key(i), 2, layer)
        assert torch.equal(layer.view(dtype).view(layout.layer_shape), block[2])
    tier.close()
    again = open_disk(tmp_path, dtype, fsync=fsync)
    assert len(again) == 6
    assert all(torch.equal(read(again, i), as_bytes(b)) for i, b in enumerate(blocks))
    assert again.record(key(3)).parent == key(2)


def test_slots_are_aligned_for_direct_io(tmp_path: Path) -> None:
    tier = open_disk(tmp_path, capacity=10 * 4096, file_bytes=4 * 4096)
    assert tier.slot_bytes % 4096 == 0
    assert not list(tmp_path.glob("slab-*.bin"))  # files are made as slots are first used
    tier.put_many([key(i) for i in range(5)], [payload(tier.layout, i) for i in range(5)], [rec(i) for i in range(5)])
    assert sorted(p.name for p in tmp_path.glob("slab-*.bin")) == ["slab-0000.bin", "slab-0001.bin"]
    tier.put_many(
        [key(i) for i in range(5, 10)], [payload(tier.layout, i) for i in range(5, 10)], [rec(i) for i in range(5, 10)]
    )
    files = sorted(p.name for p in tmp_path.glob("slab-*.bin"))
    assert files == ["slab-0000.bin", "slab-0001.bin", "slab-0002.bin"]
    assert [os.path.getsize(tmp_path / f) for f in files] == [4 * 4096, 4 * 4096, 2 * 4096]
    for slot in range(10):
        _, offset = tier.slab_path(slot)
        assert offset % 4096 == 0


def test_capacity_is_never_exceeded(tmp_path: Path) -> None:
    tier = open_disk(tmp_path, capacity=3 * 4096)
    ok = tier.put_many(
        [key(i) for i in range(5)], [payload(tier.layout, i) for i in range(5)], [rec(i) for i in range(5)]
    )
    assert ok == [True, True, True, False, False]
    assert tier.used_bytes == tier.capacity_bytes == 3 * 4096
    assert tier.stats.rejected_stores == 2


def test_corrupt_byte_is_a_counted_miss_and_leaves_the_index(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    layout = tier.layout
    tier.put_many([key(i) for i in range(3)], [payload(layout, i) for i in range(3)], [rec(i) for i in range(3)])
    path, offset = tier.slab_path(tier.slot_of(key(1)))
    with open(path, "r+b") as f:
        f.seek(offset + layout.layer_bytes + 7)  # a byte inside layer 1
        byte = f.read(1)
        f.seek(offset + layout.layer_bytes + 7)
        f.write(bytes([byte[0] ^ 0x40]))
    tier.drop_page_cache()
    assert read(tier, 1) is None
    assert tier.stats.checksum_failures == 1
    assert not tier.contains(key(1))
    for i in (0, 2):
        assert torch.equal(read(tier, i), as_bytes(payload(layout, i)))
    tier.close()
    again = open_disk(tmp_path)
    assert not again.contains(key(1)) and len(again) == 2  # removed from the index on disk too


def test_header_mismatch_is_an_error_or_an_explicit_wipe(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    tier.put(key(0), payload(tier.layout, 0), rec(0))
    tier.close()
    with pytest.raises(TierMismatchError, match="model_fingerprint"):
        open_disk(tmp_path, model_fingerprint="another-model")
    with pytest.raises(TierMismatchError, match="layout"):
        open_disk(tmp_path, torch.bfloat16)
    assert len(open_disk(tmp_path)) == 1  # the failed opens changed nothing
    wiped = open_disk(tmp_path, model_fingerprint="another-model", on_mismatch=OnMismatch.WIPE)
    assert len(wiped) == 0 and wiped.free_blocks() == wiped.capacity_blocks


def test_colliding_key_keeps_the_first_block(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    assert tier.put(key(0), payload(tier.layout, 0), rec(0))
    assert not tier.put(key(0), payload(tier.layout, 1), rec(5))
    assert torch.equal(read(tier, 0), as_bytes(payload(tier.layout, 0)))


def test_write_error_is_a_counted_failed_store(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    os.close(tier._file(0))  # the slab fd goes bad under the tier (fault injection)
    tier._fds[0] = os.open(os.devnull, os.O_RDONLY)
    assert tier.put(key(0), payload(tier.layout, 0), rec(0)) is False
    assert tier.stats.errors == 1 and not tier.contains(key(0))
    assert tier.free_blocks() == tier.capacity_blocks  # the slot went back


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.tiers.test_disk import key, open_disk, rec
    from tests.helpers import payload
    from kvtier.config import FsyncMode
    from kvtier.tiers.disk import DiskTier

    tier = open_disk(Path(sys.argv[1]), fsync=FsyncMode(sys.argv[2]))
    mode = sys.argv[3]
    if mode == "ack":
        for i in range(int(sys.argv[4])):
            assert tier.put(key(i), payload(tier.layout, i), rec(i))
            print("ACK", i, flush=True)
        signal.pause()
    else:  # "torn": the payload reaches the slab, the process dies before the index commit
        assert tier.put(key(0), payload(tier.layout, 0), rec(0))
        DiskTier._commit = lambda self, entries: os.kill(os.getpid(), signal.SIGKILL)
        tier.put(key(1), payload(tier.layout, 1), rec(1))
    """
)


def run_child(path: Path, fsync: FsyncMode, *args: str) -> subprocess.Popen[str]:
    script = CHILD.format(root=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path), fsync.value, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize("fsync", [FsyncMode.ALWAYS, FsyncMode.BATCH])
def test_acknowledged_blocks_survive_sigkill(tmp_path: Path, fsync: FsyncMode) -> None:
    n = 8
    child = run_child(tmp_path, fsync, "ack", str(n))
    assert child.stdout is not None
    acked = [int(child.stdout.readline().split()[1]) for _ in range(n)]
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL and acked == list(range(n))
    tier = open_disk(tmp_path, fsync=fsync)
    for i in acked:
        assert torch.equal(read(tier, i), as_bytes(payload(tier.layout, i)))


def test_torn_store_is_never_served_and_its_slot_is_reclaimed(tmp_path: Path) -> None:
    child = run_child(tmp_path, FsyncMode.ALWAYS, "torn")
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    tier = open_disk(tmp_path)
    assert tier.contains(key(0)) and not tier.contains(key(1))
    assert read(tier, 1) is None
    assert tier.free_blocks() == tier.capacity_blocks - 1  # the orphaned slot is free again
    assert tier.put(key(2), payload(tier.layout, 2), rec(2))
    assert torch.equal(read(tier, 2), as_bytes(payload(tier.layout, 2)))


def test_index_is_real_lmdb(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    tier.put(key(0), payload(tier.layout, 0), rec(0))
    tier.close()
    env = lmdb.open(str(tmp_path / "index.lmdb"), max_dbs=2, readonly=True)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        assert txn.get(key(0)) is not None
    env.close()
