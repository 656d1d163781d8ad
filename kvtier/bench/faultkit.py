"""What the chaos faults share: a toy-shaped cache on real files, a small real filesystem, and a log counter.

The faults run the real manager and tiers (real slab files, a real LMDB
index, real threads) at a toy shape, so each one costs a fraction of a
second and its figures are exact: a block is 3 layers x 2 KV heads x 8
dims x 4 tokens in float32 (1,536 B, one 4 KiB disk slot), and every
block's payload is a pure function of (prompt, block), so a wrong byte
served can always be told from a right one.

Filesystems are mounted (tmpfs: we run as root in the chaos run and the
tests), never simulated: ENOSPC and EROFS come from the kernel. Where the
mount is refused (no CAP_SYS_ADMIN), :class:`~kvtier.bench.faults.FaultSkipped`
says why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier import errors
from kvtier.bench.faults import FaultSkipped
from kvtier.config import Config, FsyncMode, WriteMode, load_config
from kvtier.layout import KVLayout
from kvtier.manager import CacheManager
from kvtier.tiers.host import align_up

BLOCK = 4  # tokens per block
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BLOCK, dtype=torch.float32)
SLOT = 4096  # one toy block's disk slot
FINGERPRINT = "chaos-toy"


def toy_config(
    workdir: Path,
    *,
    host_blocks: int,
    disk_blocks: int = 0,
    disk_path: Path | None = None,
    file_blocks: int = 4,
    write_mode: WriteMode = WriteMode.WRITE_THROUGH,
    fsync: FsyncMode = FsyncMode.BATCH,
) -> Config:
    """A cache config for :data:`LAYOUT`: ``disk_blocks`` 0 turns the disk tier off."""
    cfg = load_config(environ={"KVTIER_DATA_DIR": str(workdir / "data"), "KVTIER_CACHE__BLOCK_SIZE": str(BLOCK)})
    tree = cfg.model_dump()
    tree["host"]["capacity_bytes"] = host_blocks * align_up(LAYOUT.block_bytes)  # host slots are aligned too
    tree["cache"]["write_mode"] = write_mode
    tree["disk"].update(
        enabled=disk_blocks > 0,
        capacity_bytes=max(1, disk_blocks) * SLOT,
        file_bytes=file_blocks * SLOT,
        path=disk_path,
        fsync=fsync,
    )
    return Config.model_validate(tree)


def toy_cache(config: Config, **kw: object) -> CacheManager:
    return CacheManager(config, LAYOUT, model_fingerprint=FINGERPRINT, **kw)  # type: ignore[arg-type]


def tokens(prompt: int, blocks: int) -> np.ndarray:
    """Prompt ``prompt``'s tokens: ``blocks`` full blocks, distinct from every other prompt's."""
    return np.random.default_rng(prompt).integers(0, 49152, size=blocks * BLOCK, dtype=np.int32)


def kv(prompt: int, blocks: int) -> list[torch.Tensor]:
    """Block payloads that identify (prompt, block): crossed wires show as wrong bytes."""
    out = []
    for b in range(blocks):
        g = torch.Generator().manual_seed(prompt * 1009 + b)
        out.append(torch.randn(LAYOUT.block_shape, generator=g).to(LAYOUT.dtype))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass
class Served:
    """What a lookup and load gave for one prompt: blocks served by tier, and how many had wrong bytes."""

    blocks: int = 0
    wrong: int = 0
    tiers: list[str] = field(default_factory=list)


def serve(cache: CacheManager, prompt: int, blocks: int) -> Served:
    """Look ``prompt`` up, load what is cached, compare every loaded byte with what was stored, release."""
    result = cache.lookup(cache.keyed(tokens(prompt, blocks)))
    want = kv(prompt, blocks)
    with cache.load(result) as handle:
        wrong = sum(not torch.equal(view, as_bytes(want[i])) for i, view in enumerate(handle.blocks))
        return Served(len(handle.blocks), wrong, [k.value for k in handle.served_from])


# -- a small, real filesystem ----------------------------------------------------------------------------------------
def _mount(*args: str) -> str | None:
    """Run ``mount``; None when it worked, else why not."""
    try:
        done = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    except OSError as err:
        return f"mount cannot run: {err.strerror or err}"
    return None if done.returncode == 0 else done.stderr.strip() or f"mount exited {done.returncode}"


@contextlib.contextmanager
def tmpfs(where: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted at ``where`` for the block; unmounted however the block ends."""
    where.mkdir(parents=True, exist_ok=True)
    refused = _mount("-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(where))
    if refused is not None:
        raise FaultSkipped(f"cannot mount a tmpfs at {where} ({refused}); run as root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def remount_read_only(where: Path) -> None:
    """Make the tmpfs at ``where`` read-only for everyone, root included (permission bits do not stop root)."""
    refused = _mount("-o", "remount,ro", str(where))
    if refused is not None:
        raise FaultSkipped(f"cannot remount {where} read-only ({refused})")


# -- the log -----------------------------------------------------------------------------------------------------------
class LogLines(logging.Handler):
    """Every ``kvtier`` warning logged while installed, and how many carry a phrase."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def count(self, phrase: str) -> int:
        return sum(phrase in m for m in self.messages)


@contextlib.contextmanager
def kvtier_log() -> Iterator[LogLines]:
    """Capture kvtier's warnings, with its say-it-once memory fresh, so "logged once" is countable here.

    :func:`kvtier.errors.warn_once` remembers a kind for the life of the
    process; a chaos run injects many faults in one process, so each starts
    from an empty memory (and the old one is put back after).
    """
    logger = logging.getLogger("kvtier")
    lines = LogLines()
    saved, errors._seen = errors._seen, set()
    old_level = logger.level
    logger.addHandler(lines)
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(old_level)
        errors._seen = saved


GUARD_S = 120.0  # a hang guard, never a speed assertion: a run that needs it has failed


class Threads:
    """Run functions on threads that start together; exceptions are kept and re-raised by :meth:`join`."""

    def __init__(self, work: list[Callable[[], object]]) -> None:
        self._start = threading.Barrier(len(work))
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in work]

    def _run(self, work: Callable[[], object]) -> None:
        try:
            self._start.wait(GUARD_S)
            work()
        except BaseException as err:  # a thread cannot fail the run itself: kept, re-raised by join
            self.errors.append(err)

    def start(self) -> Threads:
        for t in self._threads:
            t.start()
        return self

    def join(self) -> None:
        for t in self._threads:
            t.join(GUARD_S)
            if t.is_alive():
                raise TimeoutError(f"a fault's thread still runs after {GUARD_S} s: a hang")
        if self.errors:
            raise self.errors[0]


def rss_bytes() -> int:
    """This process's resident set, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
