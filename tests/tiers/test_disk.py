from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch

from kvtier import errors
from kvtier.config import FsyncMode, OnCorrupt, OnMismatch
from kvtier.errors import DiskCorruptError, DiskLockedError, DiskUnavailableError, KVTierError, TierMismatchError
from kvtier.keys import DIGEST_BYTES, BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk import FORMAT_VERSION, DiskTier, IOMode
from tests.helpers import as_bytes, payload, read_only, record, toy_layout

ROOT = Path(__file__).resolve().parents[2]


def key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def rec(i: int) -> BlockRecord:
    return record(i, key(i - 1) if i else None)


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
    same = open_disk(tmp_path)
    assert len(same) == 1  # the failed opens changed nothing
    same.close()
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
    assert torch.equal(read(slow, 2), as_bytes(payload(layout, 2)))
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
    assert len(value) == head + 4 * layout.num_layers + DIGEST_BYTES
    assert value[head + 4 * layout.num_layers :] == rec(0).digest  # the digest, never the token ids


def set_header(path: Path, **fields: object) -> None:
    import json

    env = lmdb.open(str(path / "index.lmdb"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        header = json.loads(txn.get(b"header"))
        txn.put(b"header", json.dumps({**header, **fields}, sort_keys=True).encode())
    env.close()


def test_an_older_format_is_wiped_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = open_disk(tmp_path)
    tier.put(key(0), payload(tier.layout, 0), rec(0))
    tier.close()
    set_header(tmp_path, format_version=2)  # format 2 kept plain token ids: unreadable here, and not to be kept
    assert FORMAT_VERSION == 3
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        again = open_disk(tmp_path)  # whatever on_mismatch says: the default is error
    assert len(again) == 0 and again.free_blocks() == again.capacity_blocks
    assert not list(tmp_path.glob("slab-*.bin")) and (tmp_path / "lock").exists()
    wiped = [r.getMessage() for r in caplog.records if "wiping" in r.getMessage()]
    assert len(wiped) == 1 and "format 2" in wiped[0]
    again.close()
    set_header(tmp_path, format_version=4)  # a newer kvtier's tier is not this version's to erase
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


# -- opening: damage, lost slabs, one owner, read-only, privacy ------------------------------------------------------
PAGE = os.sysconf("SC_PAGE_SIZE")  # LMDB's page size


def dkey(i: int) -> BlockKey:
    """A key whose bytes occur nowhere else in the index, so a test can find the page holding it."""
    return BlockKey(hashlib.blake2b(b"dkey-%d" % i, digest_size=16).digest())


def fill(path: Path, n: int, **kw) -> DiskTier:
    """A tier holding ``n`` blocks under :func:`dkey`, all written in one index transaction."""
    tier = open_disk(path, capacity=max(16, n) * 4096, **kw)
    keys = [dkey(i) for i in range(n)]
    records = [record(i) for i in range(n)]  # no parents: each key is written once, in its own leaf page
    assert tier.put_many(keys, [payload(tier.layout, i) for i in range(n)], records) == [True] * n
    return tier


def leaf_page(path: Path, n: int) -> int:
    """A live leaf page of the blocks index: one holding a key that no other page holds.

    Every key was written by one transaction, so no older copy of its page
    exists; a key found on two pages is also a separator in a branch page.
    """
    data = (path / "index.lmdb" / "data.mdb").read_bytes()
    for i in range(n):
        pages = {m.start() // PAGE for m in re.finditer(re.escape(dkey(i)), data)}
        if len(pages) == 1:
            return pages.pop()
    raise AssertionError("every key is on two pages")


def overwrite_page(path: Path, page: int, data: bytes) -> None:
    with open(path / "index.lmdb" / "data.mdb", "r+b") as f:
        f.seek(page * PAGE)
        f.write(data)


PROBE = textwrap.dedent(
    """
    import json, logging, os, resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, os.getcwd())
    from tests.tiers.test_disk import key, open_disk, rec
    from tests.helpers import payload

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    mode, path = sys.argv[1], Path(sys.argv[2])
    if mode == "fsize":  # no file of this process may grow past 64 KiB: a 256 KiB slab cannot be preallocated
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        tier = open_disk(path, capacity=64 * 4096, file_bytes=64 * 4096)
        print(json.dumps({"stored": tier.put(key(0), payload(tier.layout, 0), rec(0)), "errors": tier.stats.errors}))
    elif mode == "hold":
        tier = open_disk(path, capacity=int(sys.argv[3]))
        print("HELD", flush=True)
        signal.pause()
    else:  # "open"
        tier = open_disk(path, capacity=int(sys.argv[3]))
        print(json.dumps({"blocks": len(tier), "quarantined": tier.stats.quarantined}))
    """
)


def probe(mode: str, path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PROBE, mode, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_garbage_in_a_live_index_page_is_quarantined_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fill(tmp_path, 4).close()
    overwrite_page(tmp_path, leaf_page(tmp_path, 4), random.Random(7).randbytes(PAGE))
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        tier = open_disk(tmp_path)
    assert (len(tier), tier.stats.quarantined, tier.free_blocks()) == (0, 1, tier.capacity_blocks)
    (moved,) = (tmp_path / "quarantine").iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["index.lmdb", "slab-0000.bin"]
    assert stat.S_IMODE(moved.stat().st_mode) == 0o700
    said = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(said) == 1 and str(moved) in said[0]
    assert tier.put(key(0), payload(tier.layout, 0), rec(0))  # a working, empty tier
    assert torch.equal(read(tier, 0), as_bytes(payload(tier.layout, 0)))
    tier.close()
    again = open_disk(tmp_path)
    assert (len(again), again.stats.quarantined) == (1, 0)  # the new index is sound: nothing more moved


def test_a_zeroed_index_page_is_quarantined_where_liblmdb_would_abort(tmp_path: Path) -> None:
    n = 200  # several leaf pages under a branch page
    fill(tmp_path, n).close()
    overwrite_page(tmp_path, leaf_page(tmp_path, n), bytes(PAGE))
    walk = (
        "import lmdb, sys; e = lmdb.open(sys.argv[1], max_dbs=2, readonly=True, lock=False)\n"
        "for _ in e.begin(db=e.open_db(b'blocks', create=False)).cursor(): pass"
    )
    raw = subprocess.run([sys.executable, "-c", walk, str(tmp_path / "index.lmdb")], capture_output=True)
    assert raw.returncode != 0  # liblmdb cannot walk it (it aborts: "Assertion 'IS_LEAF(mp)' failed")
    child = probe("open", tmp_path, str(n * 4096))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert json.loads(out) == {"blocks": 0, "quarantined": 1}


def test_on_corrupt_error_refuses_in_one_line_naming_the_file(tmp_path: Path) -> None:
    fill(tmp_path, 4).close()
    overwrite_page(tmp_path, leaf_page(tmp_path, 4), bytes(PAGE))
    with pytest.raises(DiskCorruptError) as refused:
        open_disk(tmp_path, on_corrupt=OnCorrupt.ERROR)
    message = str(refused.value)
    assert "\n" not in message and str(tmp_path / "index.lmdb" / "data.mdb") in message
    assert "disk.on_corrupt" in message
    assert not (tmp_path / "quarantine").exists() and (tmp_path / "slab-0000.bin").exists()  # nothing moved
    tier = open_disk(tmp_path)  # the refusal released the lock; quarantine is the default
    assert tier.stats.quarantined == 1


@pytest.mark.parametrize("damage", ["short record", "two records, one slot"])
def test_a_record_this_format_cannot_have_is_damage(tmp_path: Path, damage: str) -> None:
    fill(tmp_path, 2).close()
    env = lmdb.open(str(tmp_path / "index.lmdb"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        value = txn.get(dkey(0))
        txn.put(dkey(9), value[:-1] if damage == "short record" else value)
    env.close()
    tier = open_disk(tmp_path)
    assert (len(tier), tier.stats.quarantined) == (0, 1)


def test_records_of_missing_or_short_slab_files_are_dropped_at_open(tmp_path: Path) -> None:
    tier = open_disk(tmp_path, capacity=12 * 4096, file_bytes=4 * 4096)  # slots 0-3, 4-7, 8-11 in three files
    tier.put_many(
        [key(i) for i in range(12)], [payload(tier.layout, i) for i in range(12)], [rec(i) for i in range(12)]
    )
    slots = {i: tier.slot_of(key(i)) for i in range(12)}
    tier.close()
    (tmp_path / "slab-0001.bin").unlink()
    os.truncate(tmp_path / "slab-0002.bin", 4096 + 100)  # keeps the block in its first slot whole, not the second
    again = open_disk(tmp_path, capacity=12 * 4096, file_bytes=4 * 4096)
    kept = sorted(i for i in range(12) if again.contains(key(i)))
    assert kept == sorted(i for i, s in slots.items() if s < 4 or s == 8)
    assert again.stats.lost_blocks == 7 and again.free_blocks() == 12 - len(kept)
    assert all(torch.equal(read(again, i), as_bytes(payload(again.layout, i))) for i in kept)
    again.close()
    third = open_disk(tmp_path, capacity=12 * 4096, file_bytes=4 * 4096)
    assert len(third) == len(kept) and third.stats.lost_blocks == 0  # dropped from the index file too


def test_a_slab_truncated_under_the_tier_drops_the_record_on_the_first_short_read(
    tmp_path: Path, io_mode: IOMode
) -> None:
    tier = open_disk(tmp_path, io_mode=io_mode)
    tier.put_many([key(i) for i in range(2)], [payload(tier.layout, i) for i in range(2)], [rec(i) for i in range(2)])
    path, offset = tier.slab_path(tier.slot_of(key(1)))
    os.truncate(path, offset + 100)
    assert read(tier, 1) is None
    assert tier.stats.lost_blocks == 1 and not tier.contains(key(1))
    assert read(tier, 1) is None and tier.stats.lost_blocks == 1  # not read, and not counted, again
    assert torch.equal(read(tier, 0), as_bytes(payload(tier.layout, 0)))


def test_a_second_opener_in_this_process_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    first = open_disk(tmp_path)
    with pytest.raises(DiskLockedError, match=f"in use by pid {os.getpid()} \\(this process\\)") as refused:
        open_disk(tmp_path)
    assert "kvtier cache serve" in str(refused.value) and "\n" not in str(refused.value)
    assert first.put(key(0), payload(first.layout, 0), rec(0))  # the refused opener touched nothing
    first.close()
    second = open_disk(tmp_path)
    assert len(second) == 1


def test_another_process_holding_the_tier_is_named_and_its_death_frees_it(tmp_path: Path) -> None:
    child = probe("hold", tmp_path, str(16 * 4096))
    assert child.stdout is not None and child.stdout.readline().strip() == "HELD"
    try:
        with pytest.raises(DiskLockedError, match=f"in use by pid {child.pid}:"):
            open_disk(tmp_path)
    finally:
        child.kill()
        child.wait(timeout=30)
    open_disk(tmp_path).close()  # the kernel dropped the lock with its holder: no stale lock


def test_a_read_only_directory_is_unavailable_in_one_line(tmp_path: Path) -> None:
    tier = open_disk(tmp_path / "disk")
    tier.put(key(0), payload(tier.layout, 0), rec(0))
    tier.close()
    with read_only(tmp_path):
        for where in (tmp_path / "disk", tmp_path / "not-yet"):
            with pytest.raises(DiskUnavailableError) as refused:
                open_disk(where)
            assert "\n" not in str(refused.value) and str(where) in str(refused.value)
    assert len(open_disk(tmp_path / "disk")) == 1  # writable again: nothing was lost


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_files_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        tier = open_disk(tmp_path / "disk")
        tier.put(key(0), payload(tier.layout, 0), rec(0))
        tier.close()
    finally:
        os.umask(old)
    assert modes(tmp_path / "disk") == expected_modes(tmp_path / "disk")


def test_files_made_before_are_made_private_at_open(tmp_path: Path) -> None:
    tier = open_disk(tmp_path)
    tier.put(key(0), payload(tier.layout, 0), rec(0))
    tier.close()
    for path in (tmp_path, *tmp_path.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    open_disk(tmp_path).close()
    assert modes(tmp_path) == expected_modes(tmp_path)


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in (root, *root.rglob("*"))}


def expected_modes(root: Path) -> dict[str, int]:
    names = {".", "lock", "index.lmdb", "index.lmdb/data.mdb", "index.lmdb/lock.mdb", "slab-0000.bin"}
    names |= {"index.lmdb/seal.json", "index.lmdb/mirror.bin"}  # a clean close's seal (kvtier.tiers.disk.seal)
    assert set(modes(root)) == names
    return {name: 0o700 if (root / name).is_dir() else 0o600 for name in names}


def test_a_capacity_beyond_the_free_space_is_said_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(errors, "_seen", set())
    huge = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2**20, block_size=64, dtype=torch.float32)  # 512 MiB
    free = shutil.disk_usage(tmp_path).free
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        open_disk(tmp_path / "fits", layout=huge, capacity=huge.block_bytes).close()
        assert not [r for r in caplog.records if "free" in r.getMessage()]
        open_disk(tmp_path / "too-big", layout=huge, capacity=free + 2**40).close()
    (said,) = [r.getMessage() for r in caplog.records if "free" in r.getMessage()]
    assert str(tmp_path / "too-big") in said and "disk.capacity_bytes" in said


def test_a_slab_that_cannot_be_preallocated_is_said_naming_the_file(tmp_path: Path) -> None:
    child = probe("fsize", tmp_path)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert json.loads(out) == {"stored": False, "errors": 1}  # nor can it grow: the store fails, counted
    (said,) = [line for line in err.splitlines() if "cannot preallocate" in line]
    assert str(tmp_path / "slab-0000.bin") in said


STORE_ORDER = [5, 1, 9, 3, 12, 0, 7]  # key(i)'s bytes sort by i's low byte: store order is not key order


def closed_after_storing(path: Path, order: list[int]) -> list[int]:
    """A tier at ``path`` that stored ``key(i)`` for each ``i`` in ``order``, then closed cleanly (sealed)."""
    tier = open_disk(path)
    for i in order:
        assert tier.put(key(i), payload(tier.layout, i), rec(i))
    tier.close()
    return order


def test_a_reopened_tier_lists_its_blocks_in_store_order_not_key_order(tmp_path: Path) -> None:
    """The LRU policy ranks a reopened tier by its recency list: oldest store first, whatever LMDB's key order."""
    order = closed_after_storing(tmp_path, STORE_ORDER)
    tier = open_disk(tmp_path)
    try:
        assert tier.recency.oldest(100) == [key(i) for i in order]
        assert [k for k, _ in tier.entries()] == [key(i) for i in order]
        assert all(tier.record(key(i)) == rec(i) for i in order) and read(tier, 9) is not None
    finally:
        tier.close()


# -- the clean close's seal ------------------------------------------------------------------------------------------
class OpenPath:
    """Counts the slow steps of an open: the page walk over ``data.mdb`` and the cursor pass over its records."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kvtier.tiers.disk import index

        self.walks = self.cursor_reads = 0
        walk, read_records = index.index_damage, index.DiskIndex._read_records

        def counted_walk(*args, **kw):
            self.walks += 1
            return walk(*args, **kw)

        def counted_read(*args, **kw):
            self.cursor_reads += 1
            return read_records(*args, **kw)

        monkeypatch.setattr(index, "index_damage", counted_walk)
        monkeypatch.setattr(index.DiskIndex, "_read_records", counted_read)


def sealed_files(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "index.lmdb").iterdir() if p.name in ("seal.json", "mirror.bin"))


def test_a_cleanly_closed_tier_reopens_from_its_seal_without_a_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order = closed_after_storing(tmp_path, STORE_ORDER)
    assert sealed_files(tmp_path) == ["mirror.bin", "seal.json"]
    path = OpenPath(monkeypatch)
    tier = open_disk(tmp_path)
    try:
        assert (path.walks, path.cursor_reads) == (0, 0)
        assert sealed_files(tmp_path) == []  # taken at open: a crash from here on leaves nothing to trust
        assert tier.recency.oldest(100) == [key(i) for i in order]
        assert all(tier.record(key(i)) == rec(i) for i in order)
        assert all(torch.equal(read(tier, i), as_bytes(payload(tier.layout, i))) for i in order)
        assert tier.put(key(40), payload(tier.layout, 40), rec(40))  # the index takes writes as before
    finally:
        tier.close()
    tier = open_disk(tmp_path)
    try:
        assert (path.walks, path.cursor_reads) == (0, 0)  # sealed again by the second clean close
        assert tier.recency.oldest(100) == [key(i) for i in [*order, 40]]
    finally:
        tier.close()


def test_an_index_changed_after_its_seal_is_walked_and_read_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill(tmp_path, 6).close()
    env = lmdb.open(str(tmp_path / "index.lmdb"), max_dbs=2)
    with env.begin(write=True, db=env.open_db(b"blocks")) as txn:
        assert txn.delete(dkey(2))  # the file no longer matches its seal; the sealed mirror still lists dkey(2)
    env.close()
    path = OpenPath(monkeypatch)
    tier = open_disk(tmp_path)
    try:
        assert (path.walks, path.cursor_reads) == (1, 1)
        assert sorted(i for i in range(6) if tier.contains(dkey(i))) == [0, 1, 3, 4, 5]
        assert tier.stats.quarantined == 0 and sealed_files(tmp_path) == []
    finally:
        tier.close()


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "missing"])
def test_a_damaged_sealed_mirror_is_read_from_the_index_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    order = closed_after_storing(tmp_path, STORE_ORDER)
    mirror = tmp_path / "index.lmdb" / "mirror.bin"
    blob = bytearray(mirror.read_bytes())
    if damage == "flipped byte":
        blob[len(blob) // 2] ^= 0x10
        mirror.write_bytes(blob)
    elif damage == "truncated":
        mirror.write_bytes(blob[:-1])
    else:
        mirror.unlink()
    path = OpenPath(monkeypatch)
    tier = open_disk(tmp_path)
    try:
        assert (path.walks, path.cursor_reads) == (0, 1)  # the index itself is still the sealed one
        assert tier.recency.oldest(100) == [key(i) for i in order]
        assert all(tier.record(key(i)) == rec(i) for i in order) and sealed_files(tmp_path) == []
    finally:
        tier.close()


def test_free_slots_hand_out_the_lowest_free_slot_as_a_heap_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compact free list (a sorted array, then a heap merged in) answers as one heap of every free slot."""
    import heapq

    from kvtier.tiers.disk.slabs import FreeSlots

    monkeypatch.setattr(FreeSlots, "MERGE_AT", 7)  # merge often
    rng = random.Random(5)
    start = sorted(rng.sample(range(500), 200))
    free, model = FreeSlots(np.array(start, dtype=np.uint32)), list(start)
    taken: list[int] = []
    for _ in range(3000):
        if model and (rng.random() < 0.5 or not taken):
            slot = free.pop()
            assert slot == heapq.heappop(model)
            taken.append(slot)
        elif taken:
            slot = taken.pop(rng.randrange(len(taken)))
            free.push(slot)
            heapq.heappush(model, slot)
        assert len(free) == len(model)
    assert [free.pop() for _ in range(len(free))] == sorted(model)
    with pytest.raises(IndexError):
        free.pop()
