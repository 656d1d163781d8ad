from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
import torch

from kvtier import errors
from kvtier.config import FsyncMode, OnMismatch
from kvtier.errors import KVTierError, TierMismatchError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk import FORMAT_VERSION, DiskTier, IOMode
from tests.helpers import as_bytes, payload, toy_layout

ROOT = Path(__file__).resolve().parents[2]


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def rec(i: int) -> BlockRecord:
    return BlockRecord.of([i, i + 1, i + 2, i + 3], key(i - 1) if i else None)


def open_disk(path: Path, dtype: torch.dtype = torch.float32, **kw) -> DiskTier:
    kw.setdefault("model_fingerprint", "toy-model")
    return DiskTier(path, kw.pop("layout", toy_layout(dtype)), kw.pop("capacity", 16 * 4096), **kw)


@pytest.fixture(params=[IOMode.BUFFERED, IOMode.DIRECT], ids=["buffered", "direct"])
def io_mode(request: pytest.FixtureRequest, tmp_path: Path) -> IOMode:
    """Buffered I/O always; O_DIRECT where the test's directory allows it (tmpfs and some overlays refuse)."""
    if request.param is IOMode.DIRECT and (why := native.probe_direct(tmp_path)) is not None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT ({why}); the direct-I/O cases need a filesystem that allows it")
    return request.param


def read(tier: DiskTier, i: int) -> torch.Tensor | None:
    out = torch.empty(tier.layout.block_bytes, dtype=torch.uint8)
    return out if tier.get(key(i), out) else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fsync", list(FsyncMode))
def test_round_trip_is_bit_exact(tmp_path: Path, dtype: torch.dtype, fsync: FsyncMode, io_mode: IOMode) -> None:
    tier = open_disk(tmp_path, dtype, fsync=fsync, io_mode=io_mode)
    assert tier.io_mode is io_mode
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
    again = open_disk(tmp_path, dtype, fsync=fsync, io_mode=io_mode)
    assert len(again) == 6
    assert all(torch.equal(read(again, i), as_bytes(b)) for i, b in enumerate(blocks))
    assert again.record(key(3)).parent == key(2)


def test_slots_are_aligned_for_direct_io(tmp_path: Path, io_mode: IOMode) -> None:
    tier = open_disk(tmp_path, capacity=10 * 4096, file_bytes=4 * 4096, io_mode=io_mode)
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


def test_capacity_is_never_exceeded(tmp_path: Path, io_mode: IOMode) -> None:
    tier = open_disk(tmp_path, capacity=3 * 4096, io_mode=io_mode)
    ok = tier.put_many(
        [key(i) for i in range(5)], [payload(tier.layout, i) for i in range(5)], [rec(i) for i in range(5)]
    )
    assert ok == [True, True, True, False, False]
    assert tier.used_bytes == tier.capacity_bytes == 3 * 4096
    assert tier.stats.rejected_stores == 2


def test_corrupt_byte_is_a_counted_miss_and_leaves_the_index(tmp_path: Path, io_mode: IOMode) -> None:
    tier = open_disk(tmp_path, io_mode=io_mode)
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
    again = open_disk(tmp_path, io_mode=io_mode)
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


def test_colliding_key_keeps_the_first_block(tmp_path: Path, io_mode: IOMode) -> None:
    tier = open_disk(tmp_path, io_mode=io_mode)
    assert tier.put(key(0), payload(tier.layout, 0), rec(0))
    assert not tier.put(key(0), payload(tier.layout, 1), rec(5))
    assert torch.equal(read(tier, 0), as_bytes(payload(tier.layout, 0)))


def test_write_error_is_a_counted_failed_store(tmp_path: Path, io_mode: IOMode) -> None:
    tier = open_disk(tmp_path, io_mode=io_mode)
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
    from kvtier.tiers.disk import DiskTier, IOMode

    tier = open_disk(Path(sys.argv[1]), fsync=FsyncMode(sys.argv[2]), io_mode=IOMode(sys.argv[3]))
    assert tier.io_mode.value == sys.argv[3]
    mode = sys.argv[4]
    if mode == "ack":
        for i in range(int(sys.argv[5])):
            assert tier.put(key(i), payload(tier.layout, i), rec(i))
            print("ACK", i, flush=True)
        signal.pause()
    else:  # "torn": the payload reaches the slab, the process dies before the index commit
        assert tier.put(key(0), payload(tier.layout, 0), rec(0))
        DiskTier._commit = lambda self, entries: os.kill(os.getpid(), signal.SIGKILL)
        tier.put(key(1), payload(tier.layout, 1), rec(1))
    """
)


def run_child(path: Path, fsync: FsyncMode, io_mode: IOMode, *args: str) -> subprocess.Popen[str]:
    script = CHILD.format(root=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path), fsync.value, io_mode.value, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


@pytest.mark.parametrize("fsync", [FsyncMode.ALWAYS, FsyncMode.BATCH])
def test_acknowledged_blocks_survive_sigkill(tmp_path: Path, fsync: FsyncMode, io_mode: IOMode) -> None:
    n = 8
    child = run_child(tmp_path, fsync, io_mode, "ack", str(n))
    assert child.stdout is not None
    acked = [int(child.stdout.readline().split()[1]) for _ in range(n)]
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL and acked == list(range(n))
    tier = open_disk(tmp_path, fsync=fsync, io_mode=io_mode)
    for i in acked:
        assert torch.equal(read(tier, i), as_bytes(payload(tier.layout, i)))


def test_torn_store_is_never_served_and_its_slot_is_reclaimed(tmp_path: Path, io_mode: IOMode) -> None:
    child = run_child(tmp_path, FsyncMode.ALWAYS, io_mode, "torn")
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    tier = open_disk(tmp_path, io_mode=io_mode)
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


# -- I/O mode, native calls, CRC-32C records -------------------------------------------------------------------------
def test_auto_io_mode_is_direct_where_the_filesystem_allows_it(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    assert tier.io_mode is (IOMode.DIRECT if native.probe_direct(tmp_path) is None else IOMode.BUFFERED)
    assert tier.io_backend == native.BACKEND.name  # the C extension where it is built (tests/tiers/test_native.py)


def test_direct_slabs_are_opened_with_o_direct(tmp_path: Path, io_mode: IOMode) -> None:
    import fcntl

    tier = open_disk(tmp_path, io_mode=io_mode)
    tier.put(key(0), payload(tier.layout, 0), rec(0))
    direct = bool(fcntl.fcntl(tier._file(0), fcntl.F_GETFL) & os.O_DIRECT)
    assert direct is (io_mode is IOMode.DIRECT)


def test_refused_o_direct_is_buffered_io_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "probe_direct", lambda *_: "Invalid argument (errno 22)")
    monkeypatch.setattr(errors, "_seen", set())
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        tiers = [open_disk(tmp_path / name) for name in ("a", "b")]
    assert [t.io_mode for t in tiers] == [IOMode.BUFFERED, IOMode.BUFFERED]
    assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    assert tiers[0].put(key(0), payload(tiers[0].layout, 0), rec(0))
    assert torch.equal(read(tiers[0], 0), as_bytes(payload(tiers[0].layout, 0)))
    with pytest.raises(KVTierError, match="O_DIRECT"):
        open_disk(tmp_path / "c", io_mode=IOMode.DIRECT)


@dataclasses.dataclass
class CallCounter:
    """Wraps a backend's batch calls to count them and the buffers in each."""

    reads: list[int] = dataclasses.field(default_factory=list)
    writes: list[int] = dataclasses.field(default_factory=list)

    def backend(self, inner: native.IOBackend) -> native.IOBackend:
        def preadv_crc32c_batch(fd, buffers, *rest):
            self.reads.append(len(buffers))
            return inner.preadv_crc32c_batch(fd, buffers, *rest)

        def pwritev_crc32c_batch(fd, buffers, *rest):
            self.writes.append(len(buffers))
            return inner.pwritev_crc32c_batch(fd, buffers, *rest)

        return dataclasses.replace(
            inner, preadv_crc32c_batch=preadv_crc32c_batch, pwritev_crc32c_batch=pwritev_crc32c_batch
        )


@pytest.mark.parametrize(("fsync", "writes"), [(FsyncMode.BATCH, [6]), (FsyncMode.ALWAYS, [1] * 6)])
def test_a_batch_is_one_native_call(tmp_path: Path, io_mode: IOMode, fsync: FsyncMode, writes: list[int]) -> None:
    calls = CallCounter()
    tier = open_disk(tmp_path, io_mode=io_mode, fsync=fsync, backend=calls.backend(native.BACKEND))
    stored = tier.put_many(
        [key(i) for i in range(6)], [payload(tier.layout, i) for i in range(6)], [rec(i) for i in range(6)]
    )
    assert stored == [True] * 6 and calls.writes == writes
    outs = [torch.empty(tier.layout.block_bytes, dtype=torch.uint8) for _ in range(8)]
    asked = [0, 9, 1, 2, 8, 3, 4, 5]  # 8 and 9 were never stored
    assert tier.get_many([key(i) for i in asked], outs) == [i < 6 for i in asked]
    assert calls.reads == [6]
    assert torch.equal(outs[2], as_bytes(payload(tier.layout, 1)))


def test_python_fallback_backend_is_interchangeable(tmp_path: Path, io_mode: IOMode) -> None:
    slow = open_disk(tmp_path, io_mode=io_mode, backend=native.PYTHON)
    assert slow.io_backend == "python" and slow.io_mode is io_mode
    layout = slow.layout
    stored = slow.put_many(
        [key(i) for i in range(3)], [payload(layout, i) for i in range(3)], [rec(i) for i in range(3)]
    )
    assert stored == [True] * 3
    layer = torch.empty(layout.layer_bytes, dtype=torch.uint8)
    assert slow.get_layer(key(2), 1, layer) and torch.equal(
        layer.view(layout.dtype).view(layout.layer_shape), payload(layout, 2)[1]
    )
    slow.close()
    fast = open_disk(tmp_path, io_mode=io_mode)  # same bytes, same checksums
    assert all(torch.equal(read(fast, i), as_bytes(payload(layout, i))) for i in range(3))
    path, offset = fast.slab_path(fast.slot_of(key(0)))
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        f.write(b"\xff\x00")
    fast.close()
    slow = open_disk(tmp_path, io_mode=io_mode, backend=native.PYTHON)
    assert read(slow, 0) is None and slow.stats.checksum_failures == 1


def test_aligned_and_unaligned_outs_read_the_same(tmp_path: Path, io_mode: IOMode) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
    assert layout.block_bytes == 8192  # whole pages: an aligned out needs no bounce under O_DIRECT
    tier = open_disk(tmp_path, layout=layout, capacity=8 * 8192, io_mode=io_mode)
    stored = tier.put_many(
        [key(i) for i in range(4)], [payload(layout, i) for i in range(4)], [rec(i) for i in range(4)]
    )
    assert stored == [True] * 4
    aligned = torch.frombuffer(native.alloc_aligned(4 * 8192), dtype=torch.uint8).view(4, 8192)
    skewed = torch.empty(4 * 8192 + 64, dtype=torch.uint8)[64:].view(4, 8192)
    assert tier.get_many([key(i) for i in range(4)], list(aligned)) == [True] * 4
    assert tier.get_many([key(i) for i in range(4)], list(skewed)) == [True] * 4
    for i in range(4):
        assert torch.equal(aligned[i], as_bytes(payload(layout, i))) and torch.equal(skewed[i], aligned[i])


def test_bounce_buffers_are_per_thread_and_reused(tmp_path: Path, io_mode: IOMode) -> None:
    import threading

    tier = open_disk(tmp_path, io_mode=io_mode)
    mine = tier._bounce()
    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(tier._bounce()))
    thread.start()
    thread.join()
    if io_mode is IOMode.BUFFERED:
        assert mine is None and other == [None]
    else:
        assert tier._bounce() is mine and other[0] is not mine
        assert native.address_of(mine) % 4096 == 0


def test_records_carry_one_crc32c_per_layer(tmp_path: Path) -> None:
    import struct

    tier = open_disk(tmp_path)
    layout = tier.layout
    tier.put(key(0), payload(layout, 0), rec(0))
    tier.close()
    env = lmdb.open(str(tmp_path / "index.lmdb"), max_dbs=2, readonly=True)
    with env.begin(db=env.open_db(b"blocks", create=False)) as txn:
        value = txn.get(key(0))
    env.close()
    data = as_bytes(payload(layout, 0)).numpy().tobytes()
    lb = layout.layer_bytes
    head = struct.calcsize("<IQB16s")
    assert struct.unpack_from(f"<{layout.num_layers}I", value, head) == tuple(
        native.PYTHON.crc32c(data[i * lb : (i + 1) * lb]) for i in range(layout.num_layers)
    )
    assert len(value) == head + 4 * layout.num_layers + 4 * layout.block_size


def test_a_format_1_tier_is_refused(tmp_path: Path) -> None:
    import json

    open_disk(tmp_path).close()
    env = lmdb.open(str(tmp_path / "index.lmdb"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        header = json.loads(txn.get(b"header"))
        txn.put(b"header", json.dumps({**header, "format_version": 1}, sort_keys=True).encode())
    env.close()
    assert FORMAT_VERSION == 2
    with pytest.raises(TierMismatchError, match="format_version"):
        open_disk(tmp_path)


def test_wrong_sized_buffers_are_refused_not_spilled(tmp_path: Path, io_mode: IOMode) -> None:
    tier = open_disk(tmp_path, io_mode=io_mode)
    with pytest.raises(ValueError, match="payload"):
        tier.put(key(0), torch.zeros(tier.layout.block_bytes + 1, dtype=torch.uint8), rec(0))
    assert tier.free_blocks() == tier.capacity_blocks
    tier.put(key(0), payload(tier.layout, 0), rec(0))
    assert not tier.get(key(0), torch.empty(tier.layout.block_bytes + 4096, dtype=torch.uint8))
    assert tier.stats.errors == 1
