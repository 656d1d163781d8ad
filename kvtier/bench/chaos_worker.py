"""The process `kvtier bench chaos` kills: a real cache that stores, fetches, evicts and restarts until it dies.

Run as ``python -m kvtier.bench.chaos_worker DATA_DIR``. The process started
that way is a *zygote*: it imports kvtier (and torch) once, then forks one
*worker* per :class:`Start` it reads on stdin, so a kill loop of a thousand
incarnations pays the import once instead of a thousand times. The driver
SIGKILLs each worker by the pid in :class:`Forked`; the zygote reaps it only
when told (:class:`Reap`), so that pid cannot be reused before the kill lands.

A worker opens a real :class:`~kvtier.manager.CacheManager` (host slab, disk
tier on real slab files and a real LMDB) on the shared data directory, reads
back every block the disk index names, and then runs seeded operations
forever. It writes every fact the driver checks as one JSON line on stdout,
with one ``write`` per line so that a line written before the kill reaches the
driver whole (lines stay under ``PIPE_BUF``):

* :class:`Intent` before a store: the content digest of every block it may store;
* :class:`Durable` when a block's disk record is committed (the disk tier's
  acknowledgement: after ``put_many`` returns, heard through the disk policy's
  ``on_insert``);
* :class:`Evicting` when the disk tier is about to remove blocks (heard from
  the policy's ``victims``, *before* the removal commits, so a kill between
  the two never makes a deliberate eviction look like a lost block);
* :class:`ServedBlocks` for every block a lookup + load handed out;
* :class:`Present` and :class:`Ready` after each open: what the index holds
  and the bytes read back, and how long the open (with its recovery) took.

A block's payload is a pure function of (universe seed, conversation, block
index), and a block's key is a function of the same tokens, so one key can
only ever carry one content: any other digest is a wrong byte served. On the
remote surface the manager also writes to and promotes from a real
``redis-server`` that outlives the workers (and that the driver kills too):
blocks the disk tier evicted come back from it, and are checked the same way.
"""

from __future__ import annotations

import enum
import hashlib
import os
import signal
import sys
import threading
import time
from collections.abc import Container, Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch

from kvtier.config import Config, FsyncMode, WriteMode, load_config
from kvtier.events import ObservedPolicy
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.manager import CacheManager
from kvtier.service.client import CacheClient
from kvtier.service.server import CacheService
from kvtier.tiers.base import TierKind

BLOCK = 4  # tokens per block
LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=BLOCK, dtype=torch.float32)
SLOT = 4096  # one toy block's disk slot
HOST_BLOCKS = 10
DISK_BLOCKS = 40  # the universe below holds 128 distinct blocks: disk eviction churns
FILE_BLOCKS = 16  # slots per slab file: three files, the last one short
CONVERSATIONS = 16
TURN_BLOCKS = 8  # a conversation's longest prompt, in blocks
UNIVERSE = 20261204  # seeds the tokens and payloads, the same in every incarnation
FINGERPRINT = "chaos-toy"
NAMESPACE = "default"
CHUNK = 24  # keys per line: 24 x (32 + 32 hex) stays far under PIPE_BUF


# -- the wire (driver -> zygote) -------------------------------------------------------------------------------
class Surface(enum.StrEnum):
    """How the worker reaches its cache."""

    EMBEDDED = "embedded"  # a CacheManager in the worker, as kvtier serve runs it by default
    SERVICE = "service"  # the node's cache service (kvtier cache serve) and a CacheClient over its socket
    REMOTE = "remote"  # the embedded manager with the remote tier on, over the driver's redis-server


class Start(msgspec.Struct, tag="start"):
    """Fork a worker that runs operations drawn from ``seed`` on this surface, write mode and fsync mode."""

    seed: int
    surface: Surface
    write_mode: WriteMode
    fsync: FsyncMode
    remote_url: str | None = None  # the remote surface's Redis


class Reap(msgspec.Struct, tag="reap"):
    """The driver killed ``pid`` (or is done with it): wait for it and say how it ended."""

    pid: int


class Quit(msgspec.Struct, tag="quit"):
    pass


Command = Start | Reap | Quit


# -- the wire (zygote and worker -> driver) --------------------------------------------------------------------
class Forked(msgspec.Struct, tag="forked"):
    pid: int


class Exited(msgspec.Struct, tag="exited"):
    pid: int
    signal: int  # the signal that ended it, 0 when it exited


class Opening(msgspec.Struct, tag="opening"):
    """Sent before the cache opens: a kill right after it lands in the open and its recovery."""


class Present(msgspec.Struct, tag="present"):
    """Blocks the disk index holds after an open, and the digest read back (None: the read failed)."""

    blocks: list[tuple[str, str | None]]


class Ready(msgspec.Struct, tag="ready"):
    restart_s: float  # CacheManager construction: slabs, LMDB verify and load, orphans reclaimed
    blocks: int


class Intent(msgspec.Struct, tag="intent"):
    """Blocks about to be stored, with the digest of the only content each key can carry."""

    blocks: list[tuple[str, str]]


class Durable(msgspec.Struct, tag="durable"):
    keys: list[str]


class Evicting(msgspec.Struct, tag="evicting"):
    keys: list[str]


class ServedBlocks(msgspec.Struct, tag="served"):
    blocks: list[tuple[str, str]]
    from_remote: int = 0  # of them, promoted from the remote tier by this fetch


class Failed(msgspec.Struct, tag="failed"):
    """The worker hit an exception; it waits to be killed, so the driver's kill never misses its pid."""

    error: str


Report = Forked | Exited | Opening | Present | Ready | Intent | Durable | Evicting | ServedBlocks | Failed
ENCODER = msgspec.json.Encoder()
COMMANDS = msgspec.json.Decoder(Command)
REPORTS = msgspec.json.Decoder(Report)


def emit(message: msgspec.Struct) -> None:
    """One line, one ``write``: a line written before a kill arrives whole."""
    os.write(sys.stdout.fileno(), ENCODER.encode(message) + b"\n")


def chunks(items: Sequence, size: int = CHUNK) -> list[Sequence]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# -- the universe ------------------------------------------------------------------------------------------------
def tokens(conversation: int, blocks: int) -> np.ndarray:
    """The first ``blocks`` blocks of a conversation: later turns extend earlier ones, as an agent's transcript."""
    rng = np.random.default_rng([UNIVERSE, conversation])
    return rng.integers(0, 49152, size=TURN_BLOCKS * BLOCK, dtype=np.int32)[: blocks * BLOCK]


def payload(conversation: int, block: int) -> torch.Tensor:
    data = np.random.default_rng([UNIVERSE, conversation, block]).integers(0, 256, LAYOUT.block_bytes, np.uint8)
    return torch.from_numpy(data)


def digest(data: torch.Tensor | np.ndarray) -> str:
    view = data.numpy() if isinstance(data, torch.Tensor) else data
    return hashlib.blake2b(view.tobytes(), digest_size=16).hexdigest()


def config(data_dir: Path, start: Start) -> Config:
    cfg = load_config(environ={"KVTIER_DATA_DIR": str(data_dir), "KVTIER_CACHE__BLOCK_SIZE": str(BLOCK)})
    tree = cfg.model_dump()
    tree["host"]["capacity_bytes"] = HOST_BLOCKS * LAYOUT.block_bytes
    tree["cache"]["write_mode"] = start.write_mode
    tree["disk"].update(capacity_bytes=DISK_BLOCKS * SLOT, file_bytes=FILE_BLOCKS * SLOT, fsync=start.fsync)
    if start.surface is Surface.REMOTE:
        # a killed Redis is found out by refused connections; retried soon, so the restarted one is used again
        tree["remote"].update(enabled=True, urls=[start.remote_url], timeout_ms=1000, breaker_retry_s=0.2)
    return Config.model_validate(tree)


# -- hearing the disk tier ----------------------------------------------------------------------------------------
class _DiskReports:
    """The sink of :class:`_AnnouncedPolicy`: disk inserts become :class:`Durable` lines."""

    def stored(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        emit(Durable([bytes(k).hex() for k in keys]))

    def removed(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        """Already announced by ``victims``; the driver needs nothing more."""

    def cleared(self, tier: TierKind) -> None:
        """The worker never clears."""


class _AnnouncedPolicy(ObservedPolicy):
    """The disk policy, saying which blocks it hands out as victims before the manager removes them."""

    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        keys = self.inner.victims(n, exclude)
        for part in chunks(keys):
            emit(Evicting([bytes(k).hex() for k in part]))
        return keys


def listen(cache: CacheManager) -> None:
    """Wrap the disk tier's policy (no public hook hears victims before their removal; this worker needs to)."""
    with cache._lock:
        inner = cache.eviction.policies[TierKind.DISK]
        cache.eviction.policies[TierKind.DISK] = _AnnouncedPolicy(inner, TierKind.DISK, _DiskReports())


# -- one incarnation ----------------------------------------------------------------------------------------------
class Embedded:
    """The cache as an engine embeds it: a :class:`CacheManager` in this process."""

    def __init__(self, cfg: Config, data_dir: Path) -> None:
        self.cfg = cfg
        self.manager = CacheManager(cfg, LAYOUT, model_fingerprint=FINGERPRINT)

    def store(self, toks: np.ndarray, payloads: list[torch.Tensor]) -> None:
        self.manager.store(self.manager.keyed(toks), payloads)

    def fetch(self, toks: np.ndarray) -> ServedBlocks:
        result = self.manager.lookup(self.manager.keyed(toks))
        with self.manager.load(result) as handle:
            served = [(bytes(k).hex(), digest(b)) for k, b in zip(handle.keys, handle.blocks, strict=True)]
        return ServedBlocks(served, sum(t is TierKind.REMOTE for t in result.tiers[: len(served)]))

    def close(self) -> None:
        self.manager.close(self.cfg.cache.flush_on_exit_s)


class Served:
    """The cache as ``kvtier cache serve`` runs it: a :class:`CacheService` on a Unix socket, used by a client.

    The service runs on threads of this process, so the kill takes it down
    mid-request; payloads go through the real shared-memory slab and
    protocol. Its slab lives beside the data directory, where the driver
    counts the ones a killed service left behind.
    """

    def __init__(self, cfg: Config, data_dir: Path) -> None:
        self.cfg = cfg
        self.service = CacheService(
            cfg, LAYOUT, model_fingerprint=FINGERPRINT, socket_path=data_dir / "cache.sock", slab_dir=slab_dir(data_dir)
        )
        self.manager = self.service.manager
        threading.Thread(target=self.service.serve_forever, name="chaos-service", daemon=True).start()
        self.client = CacheClient(data_dir / "cache.sock", LAYOUT, model_fingerprint=FINGERPRINT)

    def store(self, toks: np.ndarray, payloads: list[torch.Tensor]) -> None:
        self.client.store(toks, payloads, NAMESPACE)

    def fetch(self, toks: np.ndarray) -> ServedBlocks:
        keys = self.manager.keys(toks, NAMESPACE)
        with self.client.load(toks, NAMESPACE) as handle:
            return ServedBlocks([(bytes(k).hex(), digest(b)) for k, b in zip(keys, handle.blocks, strict=False)])

    def close(self) -> None:
        self.client.close()
        self.service.close()


Cache = Embedded | Served
SURFACES: dict[Surface, type[Embedded] | type[Served]] = {
    Surface.EMBEDDED: Embedded,
    Surface.SERVICE: Served,
    Surface.REMOTE: Embedded,
}


def slab_dir(data_dir: Path) -> Path:
    where = data_dir.parent / "slabs"
    where.mkdir(exist_ok=True)
    return where


def open_cache(cfg: Config, data_dir: Path, surface: Surface) -> Cache:
    """Open, time it, read back everything the disk index names, then start hearing the disk tier."""
    emit(Opening())
    started = time.perf_counter()
    cache = SURFACES[surface](cfg, data_dir)
    restart_s = time.perf_counter() - started
    keys = read_back(cache.manager)
    emit(Ready(restart_s, keys))
    listen(cache.manager)
    return cache


def read_back(manager: CacheManager) -> int:
    """Read every block the disk index names, as :class:`Present` lines; how many."""
    disk = manager.disk
    assert disk is not None, "the chaos worker's disk tier failed to open"
    keys = [k for k, _ in disk.entries()]
    for part in chunks(keys):
        outs = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8) for _ in part]
        read = zip(part, outs, disk.get_many(list(part), outs), strict=True)
        emit(Present([(bytes(k).hex(), digest(o) if good else None) for k, o, good in read]))
    return len(keys)


def store(cache: Cache, conversation: int, blocks: int) -> None:
    toks = tokens(conversation, blocks)
    keys = cache.manager.keys(toks, NAMESPACE)
    payloads = [payload(conversation, b) for b in range(blocks)]
    emit(Intent([(bytes(k).hex(), digest(p)) for k, p in zip(keys, payloads, strict=True)]))
    cache.store(toks, payloads)


def fetch(cache: Cache, conversation: int, blocks: int) -> None:
    served = cache.fetch(tokens(conversation, blocks))
    if served.blocks:
        emit(served)


def run(data_dir: Path, start: Start) -> None:
    """Operations drawn from ``start.seed`` until killed: stores, fetches, and now and then a clean restart."""
    rng = np.random.default_rng(start.seed)
    cfg = config(data_dir, start)
    cache = open_cache(cfg, data_dir, start.surface)
    while True:
        draw = rng.random()
        conversation, blocks = int(rng.integers(CONVERSATIONS)), int(rng.integers(1, TURN_BLOCKS + 1))
        if draw < 0.55:
            store(cache, conversation, blocks)
        elif draw < 0.93:
            fetch(cache, conversation, blocks)
        else:
            cache.close()
            cache = open_cache(cfg, data_dir, start.surface)


def worker(data_dir: Path, start: Start, go: int) -> None:
    """The forked child: wait until the zygote has told the driver our pid, run, and never exit on our own."""
    os.read(go, 1)
    os.close(go)
    try:
        run(data_dir, start)
    except Exception as err:  # reported, then killed: the driver counts it, and the pid stays ours until reaped
        emit(Failed(f"{type(err).__name__}: {err}"))
    while True:
        signal.pause()


# -- the zygote -----------------------------------------------------------------------------------------------------
def fork(data_dir: Path, start: Start) -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(write)
        try:
            worker(data_dir, start, read)
        finally:
            os._exit(1)
    os.close(read)
    emit(Forked(pid))
    os.write(write, b"g")
    os.close(write)


def reap(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    emit(Exited(pid, os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0))


def zygote(data_dir: Path) -> None:
    for line in sys.stdin.buffer:
        command = COMMANDS.decode(line)
        if isinstance(command, Start):
            fork(data_dir, command)
        elif isinstance(command, Reap):
            reap(command.pid)
        else:
            return


if __name__ == "__main__":
    zygote(Path(sys.argv[1]))
