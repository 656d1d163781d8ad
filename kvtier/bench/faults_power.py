"""Power loss: every write not yet synced is dropped, and the disk tier must come back consistent.

A power cut keeps what reached stable storage and nothing else. POSIX says
what that is: a file's bytes as of its last ``fsync``, and a directory's
entries (files created, linked, renamed) as of the directory's last
``fsync`` — syncing a new file does not make its name durable. So
:class:`SyncLedger` watches every ``fsync`` under one directory (the disk
tier's I/O backend and ``os.fsync``, both routed through it): a file synced
is recorded with its bytes at that moment, keyed by inode (a hard link
shares them), a directory synced with the names it holds. At the cut it
rewrites the tree to that record: files whose names were never made
durable are deleted, other files are put back to their last synced bytes
and length (zero if never synced). LMDB syncs inside its own commit (the
disk tier opens it syncing, fsync ``batch`` or ``always``), and a cut only
ever lands between two of its transactions, so its files are kept as they
are, provided their names are durable.

What the disk tier promises after the cut (:mod:`kvtier.tiers.disk`): every
block acknowledged before it (``put_many`` returned True) reads back with
its exact bytes; no index entry is left without a payload that verifies;
the slots of stores cut half-way are free again (orphans reclaimed) and the
used bytes are the indexed blocks, all inside slab files that hold them;
and the key secret is the one the blocks were keyed by.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.bench.faultkit import LAYOUT, SLOT
from kvtier.bench.faults import Fault, FaultOutcome, fault
from kvtier.config import FsyncMode
from kvtier.keys import DIGEST_BYTES, KEY_BYTES, BlockDigest, BlockKey, Secret
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk import DiskTier

TRIALS = 12  # cut points per run, half before and half after the fsync they land on
BATCHES = 14  # stores per trial, a few blocks each, with removals between them
DISK_BLOCKS = 24
FILE_BLOCKS = 8  # slots per slab file: new files keep being created, so their names must be made durable
MAX_CUT = 48  # the cut lands on fsync call 1..MAX_CUT (a trial makes about this many)
_REAL_FSYNC = os.fsync


class PowerCut(BaseException):
    """The power went: raised from the fsync it hit, past every ``except OSError`` in the code under test."""


@dataclass
class SyncLedger:
    """What stable storage holds under ``root``, as the fsyncs so far made it; :meth:`power_loss` applies it."""

    root: Path
    cut_at: int | None = None  # the fsync call the power dies on (1-based); None: never, until power_loss
    cut_before: bool = True  # die before that fsync runs, or right after it returned
    calls: int = 0
    names: dict[Path, set[str]] = field(default_factory=dict)  # directory -> entries made durable
    contents: dict[tuple[int, int], bytes] = field(default_factory=dict)  # (dev, inode) -> bytes last synced

    def __post_init__(self) -> None:
        self.root = self.root.resolve()
        self.names[self.root] = set(os.listdir(self.root))

    def fsync(self, fd: int) -> None:
        """Record what this sync makes durable, sync for real, and cut the power where told to."""
        self.calls += 1
        if self.calls == self.cut_at and self.cut_before:
            raise PowerCut
        self._record(fd)
        _REAL_FSYNC(fd)
        if self.calls == self.cut_at:
            raise PowerCut

    def _record(self, fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if not path.is_relative_to(self.root):
            return
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            self.names[path] = set(os.listdir(path))
        else:
            self.contents[(info.st_dev, info.st_ino)] = path.read_bytes()

    @contextlib.contextmanager
    def installed(self) -> Iterator[SyncLedger]:
        """Route ``os.fsync`` through the ledger for the block (the secret and directory syncs use it)."""
        os.fsync = self.fsync
        try:
            yield self
        finally:
            os.fsync = _REAL_FSYNC

    def backend(self) -> native.IOBackend:
        """The disk tier's I/O backend, syncing through the ledger."""
        return dataclasses.replace(native.BACKEND, fsync=self.fsync)

    def power_loss(self) -> Dropped:
        """Rewrite the tree under ``root`` to what stable storage holds; what was dropped."""
        dropped = Dropped()
        for parent, dirs, files in os.walk(self.root, topdown=False):
            for name in files:
                self._file(Path(parent) / name, dropped)
            for name in dirs:
                path = Path(parent) / name
                if not self._durable(path):
                    shutil.rmtree(path)
                    dropped.directories += 1
        return dropped

    def _durable(self, path: Path) -> bool:
        """Whether ``path``'s name, and every name above it up to ``root``, was made durable."""
        if path == self.root:
            return True
        return path.name in self.names.get(path.parent, set()) and self._durable(path.parent)

    def _file(self, path: Path, dropped: Dropped) -> None:
        size = path.stat().st_size
        if not self._durable(path):
            path.unlink()
            dropped.files += 1
            dropped.bytes += size
            return
        if path.suffix == ".mdb":
            return  # synced by LMDB at every commit; a cut never lands inside one
        info = path.stat()
        synced = self.contents.get((info.st_dev, info.st_ino), b"")
        if path.read_bytes() != synced:
            path.write_bytes(synced)
            dropped.bytes += max(0, size - len(synced))
            dropped.rewound += 1


@dataclass
class Dropped:
    """What the power loss took: files whose names never became durable, files put back to older bytes."""

    files: int = 0
    directories: int = 0
    rewound: int = 0
    bytes: int = 0


# -- one trial -------------------------------------------------------------------------------------------------------
def key(n: int, trial: int) -> BlockKey:
    return BlockKey((trial * 1_000_003 + n).to_bytes(KEY_BYTES, "little"))


def payload(k: BlockKey) -> torch.Tensor:
    """The only bytes key ``k`` ever carries: a wrong byte read back always shows."""
    data = np.random.default_rng(int.from_bytes(k, "little")).integers(0, 256, LAYOUT.block_bytes, np.uint8)
    return torch.from_numpy(data)


def record(k: BlockKey) -> BlockRecord:
    return BlockRecord(BlockDigest(bytes(k) * (DIGEST_BYTES // KEY_BYTES)), None)


def open_tier(root: Path, fsync: FsyncMode, backend: native.IOBackend = native.BACKEND) -> DiskTier:
    return DiskTier(
        root / "disk",
        LAYOUT,
        DISK_BLOCKS * SLOT,
        model_fingerprint="power-loss",
        file_bytes=FILE_BLOCKS * SLOT,
        fsync=fsync,
        backend=backend,
    )


@dataclass
class Workload:
    """What a trial stored before the cut: acknowledged blocks, and the ones whose store the cut interrupted."""

    acknowledged: set[BlockKey] = field(default_factory=set)
    in_flight: set[BlockKey] = field(default_factory=set)
    secret: bytes = b""


def store_until_cut(root: Path, ledger: SyncLedger, fsync: FsyncMode, rng: np.random.Generator, trial: int) -> Workload:
    """Secret, tier, then stores and removals, all syncing through ``ledger``, until the power cut."""
    done = Workload()
    tier = None
    with ledger.installed(), contextlib.suppress(PowerCut):
        done.secret = Secret.load_or_create(root).raw
        tier = open_tier(root, fsync, ledger.backend())
        for batch in range(BATCHES):
            gone = [k for k in sorted(done.acknowledged) if rng.random() < 0.15]
            tier.remove_many(gone)
            done.acknowledged.difference_update(gone)
            keys = [key(batch * 8 + i, trial) for i in range(int(rng.integers(1, 5)))]
            done.in_flight = set(keys)
            ok = tier.put_many(keys, [payload(k) for k in keys], [record(k) for k in keys])
            done.acknowledged.update(k for k, good in zip(keys, ok, strict=True) if good)
            done.in_flight = set()
    if tier is not None:
        tier.close()  # closes descriptors only: nothing it does after the cut can reach the disk
    return done


@dataclass
class Checked:
    """What the reopened tier held, against what was acknowledged before the cut."""

    acknowledged: int = 0
    lost: int = 0
    wrong: int = 0
    unverified_entries: int = 0  # index entries whose payload failed its read
    in_flight_landed: int = (
        0  # blocks of the interrupted store committed before the cut (fsync always): fine if they verify
    )
    orphan_slots: int = 0  # slots neither free nor indexed
    bytes_unaccounted: int = 0  # used bytes not matching the indexed blocks inside their files
    secret_changed: int = 0


def check(root: Path, fsync: FsyncMode, done: Workload) -> Checked:
    out = Checked(acknowledged=len(done.acknowledged))
    out.secret_changed = int(bool(done.secret) and Secret.load_or_create(root).raw != done.secret)
    tier = open_tier(root, fsync)
    try:
        keys = [k for k, _ in tier.entries()]
        bufs = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8) for _ in keys]
        ok = tier.get_many(keys, bufs)
        good = {k for k, b, o in zip(keys, bufs, ok, strict=True) if o and torch.equal(b, payload(k))}
        out.wrong = sum(o and not torch.equal(b, payload(k)) for k, b, o in zip(keys, bufs, ok, strict=True))
        out.unverified_entries = ok.count(False)
        out.lost = len(done.acknowledged - good)
        out.in_flight_landed = len(done.in_flight & good)
        out.orphan_slots = tier.capacity_blocks - tier.free_blocks() - len(tier)
        out.bytes_unaccounted = abs(tier.used_bytes - len(tier) * tier.slot_bytes) + outside_files(tier, keys)
    finally:
        tier.close()
    return out


def outside_files(tier: DiskTier, keys: list[BlockKey]) -> int:
    """Bytes of indexed blocks that lie past their slab file's end."""
    short = 0
    for k in keys:
        slot = tier.slot_of(k)
        assert slot is not None
        path, offset = tier.slab_path(slot)
        have = path.stat().st_size if path.exists() else 0
        short += max(0, offset + LAYOUT.block_bytes - have)
    return short


def trial(workdir: Path, n: int, rng: np.random.Generator) -> tuple[Checked, Dropped]:
    root = workdir / f"trial-{n:02d}"
    root.mkdir()
    fsync = [FsyncMode.BATCH, FsyncMode.ALWAYS][n % 2]
    ledger = SyncLedger(root, cut_at=int(rng.integers(1, MAX_CUT + 1)), cut_before=n % 4 < 2)
    done = store_until_cut(root, ledger, fsync, rng, n)
    dropped = ledger.power_loss()
    return check(root, fsync, done), dropped


@fault(Fault.POWER_LOSS)
def power_loss(workdir: Path, trials: int = TRIALS, seed: int = 0) -> FaultOutcome:
    """Cut the power at ``trials`` seeded fsync calls (fsync batch and always) and reopen the disk tier each time."""
    rng = np.random.default_rng(seed)
    checked, dropped = Checked(), Dropped()
    for n in range(trials):
        c, d = trial(workdir, n, rng)
        for f in dataclasses.fields(Checked):
            setattr(checked, f.name, getattr(checked, f.name) + getattr(c, f.name))
        for f in dataclasses.fields(Dropped):
            setattr(dropped, f.name, getattr(dropped, f.name) + getattr(d, f.name))
    bad = {k: v for k, v in dataclasses.asdict(checked).items() if k not in ("acknowledged", "in_flight_landed") and v}
    return FaultOutcome(
        Fault.POWER_LOSS,
        injected=f"{trials} power cuts at seeded fsync calls (before or after the sync; fsync batch and always): "
        f"{dropped.files} files and {dropped.directories} directories whose names were never synced deleted, "
        f"{dropped.rewound} files rewound to their last synced bytes",
        outcome=(
            f"{checked.acknowledged} acknowledged blocks: {checked.lost} lost, {checked.wrong} with wrong bytes; "
            f"{checked.unverified_entries} index entries without a verifying payload, "
            f"{checked.orphan_slots} orphan slots, {checked.bytes_unaccounted} used bytes not matching the files"
        ),
        held=not bad,
        wrong_bytes_served=checked.wrong * LAYOUT.block_bytes,
        figures={**dataclasses.asdict(checked), **{f"dropped_{k}": v for k, v in dataclasses.asdict(dropped).items()}},
    )
