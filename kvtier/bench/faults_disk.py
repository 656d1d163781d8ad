"""Disk faults: a full filesystem, EIO, a damaged index, a truncated slab, a read-only directory.

The promise each one checks (README, "Guarantees"): a block is indexed only
after its bytes were written and synced, so a failed write or sync leaves
no record; a block that cannot be read is a counted miss, never wrong
bytes; damage found at start is a clear message and a defined outcome
(quarantine and start empty, drop the lost records, or run without the
disk tier), never a crash and never a crash loop; and through all of it the
cache keeps answering from host memory, recomputing what it lost.

Every fault runs the real manager and disk tier on real files (a real
tmpfs where the fault is about the filesystem) at the toy shape of
:mod:`kvtier.bench.faultkit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvtier.bench.faultkit import (
    LAYOUT,
    SLOT,
    as_bytes,
    kv,
    kvtier_log,
    remount_read_only,
    serve,
    tmpfs,
    tokens,
    toy_cache,
    toy_config,
)
from kvtier.bench.faults import Fault, FaultOutcome, fault
from kvtier.config import OnCorrupt
from kvtier.errors import DiskCorruptError
from kvtier.manager import CacheManager
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.native import IOBackend

PROMPTS = 32
BLOCKS = 2  # per prompt
FULL_FS_BYTES = 128 * 1024  # the index and about a third of the 64 configured slots fit


def _store_all(cache: CacheManager, prompts: int = PROMPTS, blocks: int = BLOCKS) -> int:
    return sum(cache.store(cache.keyed(tokens(p, blocks)), kv(p, blocks)) for p in range(prompts))


def _serve_all(cache: CacheManager, prompts: int = PROMPTS, blocks: int = BLOCKS) -> tuple[int, int]:
    """(blocks served, blocks with a wrong byte) over every prompt: each lookup is answered, hit or miss."""
    served = [serve(cache, p, blocks) for p in range(prompts)]
    return sum(s.blocks for s in served), sum(s.wrong for s in served)


def _host_only(cache: CacheManager) -> None:
    """Forget host memory, so what is served next comes from disk or is recomputed."""
    cache.clear(cache.host.kind)


# -- disk full ---------------------------------------------------------------------------------------------------------
HOLD_READ_TXN = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=2)
txn = env.begin()
print("held", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _index_reader(index: Path) -> Iterator[None]:
    """Another process holding a read transaction on the index, as a backup (``mdb_copy``) does.

    LMDB cannot reuse pages a live reader may still see, so every commit
    meanwhile needs fresh pages from the filesystem: on a full disk the
    index commit itself fails, after the block's bytes were written.
    """
    reader = subprocess.Popen(
        [sys.executable, "-c", HOLD_READ_TXN, str(index)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "held"
        yield
    finally:
        if reader.stdin is not None:
            reader.stdin.close()
        reader.wait(timeout=60)


def _fill(fs: Path) -> None:
    """Take every free byte of ``fs`` with one file, the way a neighbour filling the disk would."""
    fd = os.open(fs / "neighbour", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (64 * 1024, 4096, 1):  # down to the last byte
            try:
                while True:
                    os.write(fd, bytes(chunk))
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)


def _index_commit_fails(workdir: Path) -> tuple[dict[str, int], int]:
    """Slabs preallocated and written, then the index cannot commit: the blocks must not be indexed."""
    with tmpfs(workdir / "commit-fs", 1024**2) as fs, kvtier_log() as log:
        cfg = toy_config(
            workdir / "commit", host_blocks=PROMPTS * BLOCKS, disk_blocks=16, file_blocks=16, disk_path=fs / "disk"
        )
        with toy_cache(cfg) as cache:
            assert cache.disk is not None
            _store_all(cache, prompts=4)  # 8 blocks on disk, and the one slab file preallocated whole: 16 slots
            with _index_reader(cfg.disk_path / "index.lmdb"):
                _fill(fs)
                stored = sum(cache.store(cache.keyed(tokens(p, BLOCKS)), kv(p, BLOCKS)) for p in range(4, 8))
                failed, indexed = cache.disk.stats.write_errors, len(cache.disk)
            _host_only(cache)
            served, wrong = _serve_all(cache, prompts=8)
        with toy_cache(cfg) as again:
            assert again.disk is not None
            after_restart = len(again.disk)
            _, wrong_restart = _serve_all(again, prompts=8)
        said = log.count("mdb_txn_commit")  # the index commit failed, not a slab write
    figures = {
        "commit_log_lines": said,
        "commit_stored": stored,
        "commit_write_errors": failed,
        "commit_indexed": indexed,
        "commit_served_from_disk": served,
        "commit_indexed_after_restart": after_restart,
    }
    return figures, wrong + wrong_restart


@fault(Fault.DISK_FULL)
def disk_full(workdir: Path) -> FaultOutcome:
    """Write-through stores into a disk tier larger than its (real, tmpfs) filesystem; then a full index."""
    with tmpfs(workdir / "small-fs", FULL_FS_BYTES) as fs, kvtier_log() as log:
        cfg = toy_config(workdir, host_blocks=PROMPTS * BLOCKS, disk_blocks=64, disk_path=fs / "disk")
        with toy_cache(cfg) as cache:
            assert cache.disk is not None
            stored = _store_all(cache)
            from_host, wrong_host = _serve_all(cache)  # every store landed in host memory
            indexed = len(cache.disk)
            stats = cache.disk.stats
            _host_only(cache)
            from_disk, wrong_disk = _serve_all(cache)
        with toy_cache(cfg) as again:  # a restart on the still-full filesystem
            assert again.disk is not None
            after_restart = len(again.disk)
            _, wrong_restart = _serve_all(again)
        said = log.count("disk tier write failed")
    commit, wrong_commit = _index_commit_fails(workdir)
    blocks = PROMPTS * BLOCKS
    figures = {
        "blocks_stored": stored,
        "disk_indexed": indexed,
        "write_errors": stats.write_errors,
        "served_from_host": from_host,
        "served_after_host_cleared": from_disk,
        "indexed_after_restart": after_restart,
        "log_lines": said,
        **commit,
    }
    wrong = wrong_host + wrong_disk + wrong_restart + wrong_commit
    held = (
        stored == from_host == blocks
        and commit["commit_stored"] == 8
        and commit["commit_write_errors"] > 0
        and commit["commit_log_lines"] == 1
        and commit["commit_indexed"] == commit["commit_indexed_after_restart"] < 16
        and commit["commit_served_from_disk"] <= commit["commit_indexed"]
        and 0 < indexed < blocks
        and stats.write_errors > 0
        and from_disk <= indexed
        and after_restart == indexed
        and said == 1
        and wrong == 0
    )
    return FaultOutcome(
        Fault.DISK_FULL,
        injected=(
            f"a {FULL_FS_BYTES // 1024} KiB tmpfs under a 64-slot disk tier, {blocks} blocks stored write-through; "
            "then a disk filled by a neighbour while a backup's read transaction pins the index's pages"
        ),
        outcome=(
            f"{indexed} blocks indexed, {stats.write_errors} failed writes never indexed; every lookup answered "
            f"({from_host} blocks from host, then {from_disk} from disk, the rest recomputed); said once in the log; "
            f"{commit['commit_write_errors']} blocks written whose index commit failed were never indexed"
        ),
        held=held,
        wrong_bytes_served=wrong,
        figures=figures,
    )


# -- EIO ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class FailingIO:
    """A disk I/O backend whose read, write or fsync fails with EIO while armed: the kernel's error, injected.

    Only the three calls the disk tier makes to move and sync bytes are
    wrapped; everything else is the real backend, so the tier runs its real
    code on real files and sees exactly what a failing device returns.
    """

    real: IOBackend = native.BACKEND
    read: bool = False
    write: bool = False
    sync: bool = False
    failed: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def backend(self) -> IOBackend:
        return dataclasses.replace(
            self.real,
            preadv_crc32c_batch=self._wrap(lambda: self.read, self.real.preadv_crc32c_batch),
            pwritev_crc32c_batch=self._wrap(lambda: self.write, self.real.pwritev_crc32c_batch),
            fsync=self._wrap(lambda: self.sync, self.real.fsync),
        )

    def _wrap(self, armed: Callable[[], bool], call: Callable[..., object]) -> Callable[..., object]:
        def maybe_fail(*args: object, **kw: object) -> object:
            if armed():
                with self._lock:
                    self.failed += 1
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return call(*args, **kw)

        return maybe_fail


def _block(i: int) -> tuple[bytes, torch.Tensor, BlockRecord]:
    """Key, payload and record of toy block ``i`` (keys and digests named by ``i``: a tier compares bytes)."""
    key = i.to_bytes(16, "little")
    record = BlockRecord(i.to_bytes(32, "little"), None)  # type: ignore[arg-type]
    return key, kv(10_000 + i, 1)[0], record


def _read(tier: DiskTier, i: int) -> torch.Tensor | None:
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    key, _, _ = _block(i)
    return out if tier.get(key, out) else None  # type: ignore[arg-type]


@fault(Fault.EIO)
def eio(workdir: Path) -> FaultOutcome:
    """EIO on a write, on an fsync, then on reads, of a disk tier holding four good blocks."""
    path = workdir / "disk"
    io = FailingIO()
    with kvtier_log() as log:
        tier = DiskTier(path, LAYOUT, 16 * SLOT, model_fingerprint="chaos-toy", backend=io.backend())
        try:
            good = [tier.put(*_block(i)) for i in range(4)]  # type: ignore[arg-type]
            io.write = True
            write_failed = not tier.put(*_block(4))  # type: ignore[arg-type]
            io.write, io.sync = False, True
            sync_failed = not tier.put(*_block(5))  # type: ignore[arg-type]
            io.sync, io.read = False, True
            reads_failed = sum(_read(tier, i) is None for i in range(4))
            still_indexed = sum(tier.contains(_block(i)[0]) for i in range(4))  # type: ignore[arg-type]
            io.read = False
            stats = tier.stats
            free_after = tier.free_blocks()
        finally:
            tier.close()
        again = DiskTier(path, LAYOUT, 16 * SLOT, model_fingerprint="chaos-toy")  # a restart, healthy I/O
        try:
            back = [_read(again, i) for i in range(6)]
        finally:
            again.close()
        said = (log.count("disk tier write failed"), log.count("disk tier read failed"))
    wrong = sum(b is not None and not torch.equal(b, as_bytes(_block(i)[1])) for i, b in enumerate(back))
    durable = sum(b is not None for b in back)
    figures = {
        "writes_failed": int(write_failed),
        "fsyncs_failed": int(sync_failed),
        "write_errors": stats.write_errors,
        "reads_failed": reads_failed,
        "read_errors": stats.read_errors,
        "indexed_after_read_errors": still_indexed,
        "free_slots_after": free_after,
        "durable_after_restart": durable,
        "log_lines": sum(said),
    }
    held = (
        all(good)
        and write_failed
        and sync_failed
        and stats.write_errors == 2
        and reads_failed == stats.read_errors == 4
        and free_after == 16 - 4
        and durable == 4
        and back[4] is None
        and back[5] is None
        and said == (1, 1)
        and wrong == 0
    )
    return FaultOutcome(
        Fault.EIO,
        injected="EIO on one write, one fsync, then four reads, of a disk tier holding four blocks",
        outcome=(
            "the failed write and the failed fsync left no record and freed their slots (not durable after a "
            "restart); the four EIO reads were counted misses and their records kept (served again once the "
            "device answered); one log line for writes, one for reads"
        ),
        held=held,
        wrong_bytes_served=wrong,
        figures=figures,
    )


# -- a damaged index ---------------------------------------------------------------------------------------------------
def _damage_index(disk: Path, seed: int = 17) -> int:
    """Overwrite every page of ``data.mdb`` after its two meta pages with random bytes; how many bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    data = disk / "index.lmdb" / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.seek(2 * page)
        f.write(random.Random(seed).randbytes(size - 2 * page))
    return size - 2 * page


@fault(Fault.INDEX_DAMAGED)
def index_damaged(workdir: Path) -> FaultOutcome:
    """The LMDB index's data pages overwritten under a stopped cache; started with on_corrupt error, then quarantine."""
    cfg = toy_config(workdir, host_blocks=PROMPTS * BLOCKS, disk_blocks=64)
    with toy_cache(cfg) as cache:
        _store_all(cache)
    overwritten = _damage_index(cfg.disk_path)
    refusing = cfg.model_copy(update={"disk": cfg.disk.model_copy(update={"on_corrupt": OnCorrupt.ERROR})})
    try:
        toy_cache(refusing).close()
        refusal = ""
    except DiskCorruptError as err:
        refusal = str(err)
    with kvtier_log() as log, toy_cache(cfg) as cache:
        assert cache.disk is not None
        quarantined, blocks_after = cache.disk.stats.quarantined, len(cache.disk)
        served, wrong = _serve_all(cache)
        stored = _store_all(cache)  # the empty tier takes blocks again
        said = log.count("is damaged")
    with toy_cache(cfg) as again:  # and the next start finds a sound index: no crash loop, no second quarantine
        assert again.disk is not None
        second = (again.disk.stats.quarantined, len(again.disk))
    moved = sorted(p.name for p in (cfg.disk_path / "quarantine").iterdir())
    figures = {
        "bytes_overwritten": overwritten,
        "quarantined": quarantined,
        "blocks_after_start": blocks_after,
        "served_after_start": served,
        "stored_after_start": stored,
        "quarantined_at_next_start": second[0],
        "log_lines": said,
    }
    held = (
        "\n" not in refusal
        and "data.mdb" in refusal
        and (quarantined, blocks_after, served) == (1, 0, 0)
        and stored == PROMPTS * BLOCKS
        and second == (0, PROMPTS * BLOCKS)
        and len(moved) == 1
        and said == 1
        and wrong == 0
    )
    return FaultOutcome(
        Fault.INDEX_DAMAGED,
        injected=f"{overwritten} random bytes over the index's data pages (data.mdb), under a stopped cache",
        outcome=(
            "on_corrupt error: refused to start in one line naming data.mdb; quarantine: index and slabs moved to "
            "quarantine/<time>/, started empty (every lookup a miss), took new blocks, and the next start was clean"
        ),
        held=held,
        wrong_bytes_served=wrong,
        figures=figures,
    )


# -- a truncated slab --------------------------------------------------------------------------------------------------
@fault(Fault.SLAB_TRUNCATED)
def slab_truncated(workdir: Path) -> FaultOutcome:
    """One slab file cut in half under a stopped cache, another under a running one."""
    cfg = toy_config(workdir, host_blocks=PROMPTS * BLOCKS, disk_blocks=PROMPTS * BLOCKS)  # 4 slots per slab file
    with toy_cache(cfg) as cache:
        _store_all(cache)
    os.truncate(cfg.disk_path / "slab-0001.bin", 2 * SLOT)  # slots 6 and 7 gone
    with toy_cache(cfg) as cache:
        assert cache.disk is not None
        lost_at_start = cache.disk.stats.lost_blocks
        os.truncate(cfg.disk_path / "slab-0003.bin", SLOT + 100)  # slots 13-15 cut while running
        served, wrong = _serve_all(cache)
        lost_running = cache.disk.stats.lost_blocks - lost_at_start
        indexed = len(cache.disk)
        _store_all(cache)  # the lost blocks are stored again (written where the file was cut, which grows it back)
        _host_only(cache)
        healed, wrong_healed = _serve_all(cache)
    blocks = PROMPTS * BLOCKS
    figures = {
        "lost_at_start": lost_at_start,
        "lost_while_running": lost_running,
        "served": served,
        "indexed_after": indexed,
        "served_after_restore": healed,
    }
    held = (
        lost_at_start == 2
        and lost_running == 3
        and indexed == blocks - 5
        and served <= indexed
        and healed == blocks
        and wrong == wrong_healed == 0
    )
    return FaultOutcome(
        Fault.SLAB_TRUNCATED,
        injected="slab-0001 cut to 2 of its 4 slots while stopped; slab-0003 cut inside its second slot while running",
        outcome=(
            "2 records dropped at start and 3 at their first short read (lost_blocks), each a miss, never "
            "short or wrong bytes; the cache kept answering and the blocks were stored again"
        ),
        held=held,
        wrong_bytes_served=wrong + wrong_healed,
        figures=figures,
    )


# -- a read-only directory ---------------------------------------------------------------------------------------------
@fault(Fault.READ_ONLY)
def read_only(workdir: Path) -> FaultOutcome:
    """The disk tier's filesystem remounted read-only (root ignores permission bits; a read-only mount it cannot)."""
    with tmpfs(workdir / "ro-fs", 1024**2) as fs:
        cfg = toy_config(workdir, host_blocks=PROMPTS * BLOCKS, disk_blocks=64, disk_path=fs / "disk")
        with toy_cache(cfg) as cache:
            _store_all(cache)
        remount_read_only(fs)
        with kvtier_log() as log, toy_cache(cfg) as cache:
            disk_tier = cache.disk is not None
            stored = _store_all(cache)
            served, wrong = _serve_all(cache)
            said = log.count("running without the disk tier")
        intact = sorted(p.name for p in (fs / "disk").iterdir())
    blocks = PROMPTS * BLOCKS
    figures = {"disk_tier_opened": int(disk_tier), "stored": stored, "served": served, "log_lines": said}
    held = not disk_tier and stored == served == blocks and said == 1 and wrong == 0 and "index.lmdb" in intact
    return FaultOutcome(
        Fault.READ_ONLY,
        injected="the tmpfs holding the disk tier remounted read-only between two starts",
        outcome=(
            "started without the disk tier, said once in the log naming the directory; served every prompt from "
            "host memory; the files on the read-only mount untouched"
        ),
        held=held,
        wrong_bytes_served=wrong,
        figures=figures,
    )


__all__ = ["FailingIO", "disk_full", "eio", "index_damaged", "read_only", "slab_truncated"]
