"""`kvtier bench scale`: how each per-block cost grows with the number of indexed blocks.

For each N (default 10^4 .. 10^7) a real disk tier (slab files, an LMDB
index) is filled to N blocks under a temporary directory, with a tiny KV
layout (one layer, one head, head dim 1, 16 tokens: 128 B a block, one
4096-byte slot). Then a fresh process opens a real :class:`CacheManager`
over it (host tier + that disk tier, write-through) and measures:

* ``startup_s``: constructing the manager, i.e. opening the disk tier over N
  blocks (index verified and mirrored, free list rebuilt) and rebuilding its
  eviction policy, after a clean close sealed the index
  (:mod:`kvtier.tiers.disk.seal`): the start-up of a restart;
* ``startup_after_crash_s``: the same over the index as a crash leaves it, no
  seal: every page walked and every record read through a cursor. It is
  measured first, in a process of its own whose clean close then seals the
  index the other figures open;
* ``disk_ram_bytes_per_block``: the growth of that process's anonymous
  resident memory (``RssAnon``) across the start-up, over N: the disk
  tier's in-memory index and its policy's metadata, allocator slack included;
* ``lookup_p50_us`` / ``lookup_p99_us``: ``CacheManager.lookup`` of a
  cached 128-block prompt (each block confirmed from the disk tier's index:
  128 digests checked), and ``absent_p50_us`` / ``absent_p99_us`` of an
  absent one, the two kinds interleaved; the keys are made before the
  clock starts;
* ``store_blocks_s``: ``CacheManager.store`` of new 128-block prompts while
  both tiers have room (host slots filled, written through to disk);
* ``evict_blocks_s``: the same once both tiers are full, so that every block
  stored evicts one from host and one from the disk's N.

Two more figures, each in a process of its own: ``host_ram_bytes_per_block``
(tracemalloc's traced Python memory of a host tier and its LRU policy
holding ``min(N, host_blocks)`` blocks, plus what the tier's native slot
index allocated: its slots' payload pages are outside the count by
construction) and ``router_bytes_per_block`` (tracemalloc's
traced memory of the router's :class:`~kvtier.route.index.BlockIndex` as
``backends`` backends each report the same N keys, each key its own object as
decoded from each backend's events), over N times the backends.
``ram_bytes_per_block`` is the larger of the disk and host figures.

How the N blocks get there: their index records are written into the tier's
own LMDB index (the record encoding of :mod:`kvtier.tiers.disk.records`, real
keys and digests of real token chains, the CRC-32C of a zero payload) and
their slab files are made at full length but sparse, so 10^7 blocks take no
41 GB of disk; a read of one of them returns zeros that pass their checksum.
The blocks stored during the timed phases are written through the real path.

Figures go to ``bench/README.md``; none here.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.bench import results

PROMPT_BLOCKS = 128
BLOCK_SIZE = 16
NAMESPACE = "bench-scale"
FINGERPRINT = "bench-scale-layout"
COMMIT_BLOCKS = 16384  # index records per LMDB write transaction while filling
FIELDS = (
    "blocks",
    "lookup_p50_us",
    "lookup_p99_us",
    "store_blocks_s",
    "evict_blocks_s",
    "ram_bytes_per_block",
    "startup_s",
    "router_bytes_per_block",
)


@dataclass(frozen=True)
class ScaleSpec:
    points: tuple[int, ...] = (10**4, 10**5, 10**6, 10**7)
    lookups: int = 2000  # timed lookups per point, half cached and half absent
    stores: int = 2048  # blocks stored in each of the store and evict phases (whole prompts)
    host_blocks: int = 100_000  # most blocks the host tier's metadata is measured at (each touches a 4 KiB page)
    backends: int = 2  # router backends reporting the same N keys
    seed: int = 0


def layout() -> Any:
    from kvtier.layout import KVLayout

    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BLOCK_SIZE, dtype=torch.float32)


def prompt_tokens(p: int) -> np.ndarray:
    """Prompt ``p``'s token ids: 128 blocks no other prompt shares (so every block is its own key)."""
    n = PROMPT_BLOCKS * BLOCK_SIZE
    return np.arange(p * n, (p + 1) * n, dtype=np.int64) % (2**31 - 1)


def config(data_dir: Path, blocks: int, stores: int) -> Any:
    """Host holds one phase's stores; disk holds N plus them, so the evict phase evicts on both tiers."""
    from kvtier.config import Config

    slot = 4096
    return Config.model_validate(
        {
            "data_dir": str(data_dir),
            "cache": {"block_size": BLOCK_SIZE, "write_mode": "write_through"},
            "host": {"capacity_bytes": stores * slot},
            "disk": {"capacity_bytes": (blocks + stores) * slot, "path": str(data_dir / "disk")},
        }
    )


def rss_anon() -> int:
    """This process's anonymous resident bytes (heap, not file mappings such as LMDB's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


# -- filling a disk tier to N blocks ---------------------------------------------------------------
def fill(data_dir: Path, blocks: int, stores: int) -> None:
    """A disk tier at ``data_dir/disk`` indexing ``blocks`` blocks (prompts 0.. in order), slabs sparse, unsealed."""
    from kvtier.keys import KeyHasher, Secret
    from kvtier.tiers.disk import DiskTier

    cfg = config(data_dir, blocks, stores)
    lay = layout()
    hasher = KeyHasher(
        Secret.load_or_create(data_dir), model_fingerprint=FINGERPRINT, layout_descriptor=lay.descriptor,
        block_size=BLOCK_SIZE,
    )  # fmt: skip
    tier = DiskTier(
        cfg.disk_path,
        lay,
        int(cfg.disk.capacity_bytes),
        model_fingerprint=FINGERPRINT,
        file_bytes=int(cfg.disk.file_bytes),
    )
    try:
        _sparse_slabs(tier, lay)
        _write_records(tier, hasher, lay, blocks)
    finally:
        tier._abandon()  # no seal: this process's mirror never saw the records, and a crash leaves none either


def _sparse_slabs(tier: Any, lay: Any) -> None:
    """Every slab file at its full length, unallocated: the index's records must name slots in files that hold them."""
    slabs = tier._slabs  # the bench reaches under the tier: a real DiskTier opens what this leaves
    for i in range(-(-tier.capacity_blocks // slabs._slots_per_file)):
        slots = min(slabs._slots_per_file, tier.capacity_blocks - i * slabs._slots_per_file)
        with open(slabs._dir.slab_path(i), "wb") as f:
            f.truncate(slots * tier.slot_bytes)


def _write_records(tier: Any, hasher: Any, lay: Any, blocks: int) -> None:
    """Prompt after prompt, each block's record, committed :data:`COMMIT_BLOCKS` at a time."""
    from kvtier.tiers import native
    from kvtier.tiers.disk.records import pack_checksums

    sums = pack_checksums(native.BACKEND.crc32c_layers(np.zeros(lay.block_bytes, np.uint8), lay.layer_bytes))
    index = tier._index  # its own LMDB environment, without filling the in-memory mirror of this process
    records = _records(hasher, sums, blocks)
    while batch := list(islice(records, COMMIT_BLOCKS)):
        with index._env.begin(write=True, db=index._blocks) as txn:
            for key, value in batch:
                txn.put(key, value)


def _records(hasher: Any, sums: bytes, blocks: int) -> Iterator[tuple[bytes, bytes]]:
    """(key, encoded record) of blocks 0 .. ``blocks``: prompt 0's 128, then prompt 1's, ...; block i in slot i."""
    from kvtier.tiers.base import BlockRecord
    from kvtier.tiers.disk.records import IndexEntry, encode_record

    slot = 0
    for p in range(-(-blocks // PROMPT_BLOCKS)):
        kt = hasher.keyed(prompt_tokens(p), NAMESPACE)
        for i in range(min(PROMPT_BLOCKS, blocks - slot)):
            record = BlockRecord(kt.digests[i], kt.keys[i - 1] if i else None)
            yield kt.keys[i], encode_record(IndexEntry(slot, slot + 1, sums, record))
            slot += 1


# -- one point, measured in a fresh process -------------------------------------------------------
def measure_manager(data_dir: Path, blocks: int, spec: ScaleSpec) -> dict[str, Any]:
    """Start-up, RAM, lookups, stores and evictions of a manager over the filled tier (run in a fresh process)."""
    from kvtier.manager import CacheManager

    cfg, lay = config(data_dir, blocks, spec.stores), layout()
    gc.collect()
    before = rss_anon()
    t0 = time.perf_counter()
    manager = CacheManager(cfg, lay, model_fingerprint=FINGERPRINT)
    startup = time.perf_counter() - t0
    gc.collect()
    grown = rss_anon() - before
    try:
        if manager.disk is None or len(manager.disk) != blocks:
            raise RuntimeError(f"the disk tier opened with {manager.disk and len(manager.disk)} blocks, not {blocks}")
        out = {"startup_s": startup, "disk_ram_bytes_per_block": grown / blocks}
        out |= lookups(manager, blocks, spec)
        out |= stores(manager, blocks, spec)
    finally:
        manager.close(0)
    return out


def measure_reopen(data_dir: Path, blocks: int, spec: ScaleSpec) -> dict[str, Any]:
    """Start-up over an unsealed index (as after a crash); the clean close that follows seals it."""
    from kvtier.manager import CacheManager

    t0 = time.perf_counter()
    manager = CacheManager(config(data_dir, blocks, spec.stores), layout(), model_fingerprint=FINGERPRINT)
    startup = time.perf_counter() - t0
    try:
        if manager.disk is None or len(manager.disk) != blocks:
            raise RuntimeError(f"the disk tier opened with {manager.disk and len(manager.disk)} blocks, not {blocks}")
    finally:
        manager.close(0)
    return {"startup_after_crash_s": startup}


def lookups(manager: Any, blocks: int, spec: ScaleSpec) -> dict[str, float]:
    """``spec.lookups`` lookups, cached and absent prompts interleaved; each checked for its expected answer.

    The two kinds are reported apart: mixed, the median would fall between
    a full hit (128 records confirmed) and a miss at the first block, and
    say nothing about either. ``lookup_*`` are the hits, the walk that an
    index's size could slow; ``absent_*`` the misses.
    """
    rng = np.random.default_rng(spec.seed)
    full = blocks // PROMPT_BLOCKS
    if full == 0:
        raise ValueError(f"{blocks} blocks hold no whole {PROMPT_BLOCKS}-block prompt")
    times: dict[bool, list[float]] = {True: [], False: []}
    for j in range(spec.lookups):
        cached = j % 2 == 0
        p = int(rng.integers(full)) if cached else 10**6 + j  # prompts past any point's fill
        prompt = manager.keyed(prompt_tokens(p), NAMESPACE)
        t0 = time.perf_counter()
        result = manager.lookup(prompt)
        times[cached].append(time.perf_counter() - t0)
        if result.cached_blocks != (PROMPT_BLOCKS if cached else 0):
            raise RuntimeError(f"prompt {p}: {result.cached_blocks} blocks cached, expected {cached and PROMPT_BLOCKS}")
    hit, miss = (np.asarray(times[k]) * 1e6 for k in (True, False))
    return {
        "lookup_p50_us": float(np.percentile(hit, 50)),
        "lookup_p99_us": float(np.percentile(hit, 99)),
        "absent_p50_us": float(np.percentile(miss, 50)),
        "absent_p99_us": float(np.percentile(miss, 99)),
    }


def stores(manager: Any, blocks: int, spec: ScaleSpec) -> dict[str, float]:
    """Blocks/s storing new prompts while the tiers have room, then while every block stored evicts."""
    payload = torch.zeros(PROMPT_BLOCKS, manager.layout.block_bytes, dtype=torch.uint8)
    first = 2 * 10**6  # prompts no lookup used
    n = max(1, spec.stores // PROMPT_BLOCKS)
    free = _store_rate(manager, payload, range(first, first + n))
    evictions = manager.disk.stats.evictions if manager.disk else 0
    full = _store_rate(manager, payload, range(first + n, first + 2 * n))
    evicted = (manager.disk.stats.evictions if manager.disk else 0) - evictions
    if evicted < n * PROMPT_BLOCKS:
        raise RuntimeError(f"the evict phase evicted {evicted} disk blocks, fewer than it stored")
    return {"store_blocks_s": free, "evict_blocks_s": full}


def _store_rate(manager: Any, payload: torch.Tensor, prompts: range) -> float:
    keyed = [manager.keyed(prompt_tokens(p), NAMESPACE) for p in prompts]
    t0 = time.perf_counter()
    stored = sum(manager.store(kt, payload) for kt in keyed)
    elapsed = time.perf_counter() - t0
    if stored != len(keyed) * PROMPT_BLOCKS:
        raise RuntimeError(f"stored {stored} of {len(keyed) * PROMPT_BLOCKS} blocks")
    return stored / elapsed


def measure_host(blocks: int) -> dict[str, float]:
    """Bytes per block of a host tier and its LRU policy holding ``blocks`` blocks: traced Python and native index.

    The tier's slot index is allocated whole at start-up, outside Python's
    allocator: its bytes are counted from what it allocated (the tier is
    full, so every page of it is in use).
    """
    from kvtier.policy import make_policy
    from kvtier.policy.base import PolicyName
    from kvtier.tiers.base import BlockRecord
    from kvtier.tiers.host import HostTier

    lay = layout()
    tier = HostTier(lay, blocks * 4096, pin=False)
    policy = make_policy(PolicyName.LRU)
    policy.load((), tier.recency)  # as the manager's eviction hands it the tier's recency list
    payload = torch.zeros(lay.block_bytes, dtype=torch.uint8)
    raw = os.urandom(48 * blocks)
    gc.collect()
    tracemalloc.start()
    for i in range(blocks):
        key, digest = raw[48 * i : 48 * i + 16], raw[48 * i + 16 : 48 * i + 48]
        parent = raw[48 * (i - 1) : 48 * (i - 1) + 16] if i else None
        tier.put(key, payload, BlockRecord(digest, parent))  # type: ignore[arg-type]
        policy.on_insert(key, parent)  # type: ignore[arg-type]
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    if len(tier) != blocks:
        raise RuntimeError(f"the host tier holds {len(tier)} of {blocks} blocks")
    native_bytes = tier._index.allocated_bytes
    return {
        "host_ram_bytes_per_block": (traced + native_bytes) / blocks,
        "host_native_bytes_per_block": native_bytes / blocks,
        "host_ram_blocks": blocks,
    }


def measure_router(blocks: int, backends: int) -> dict[str, float]:
    """Traced bytes per block per backend of a BlockIndex told by each backend that it holds ``blocks`` keys.

    tracemalloc, not ``RssAnon``: the keys arrive as ``bytes`` in event-sized
    batches and are dropped once indexed, and the allocator keeps some of
    their pages; that churn would be this loop's, not the index's.
    """
    from kvtier.route.index import BlockIndex
    from kvtier.tiers.base import TierKind

    raw = os.urandom(16 * blocks)
    index = BlockIndex()
    gc.collect()
    tracemalloc.start()
    for b in range(backends):
        for start in range(0, blocks, 65536):
            chunk = range(start, min(blocks, start + 65536))
            index.stored(f"backend-{b}", TierKind.HOST, [raw[16 * i : 16 * i + 16] for i in chunk])  # type: ignore[misc]
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    if index.blocks("backend-0") != blocks:
        raise RuntimeError("the router index lost keys")
    return {"router_bytes_per_block": grown / (blocks * backends)}


# -- the run ----------------------------------------------------------------------------------------
def _child(what: str, *args: str) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter (its resident memory is its own); its JSON answer."""
    code = (
        f"import json, sys\nfrom kvtier.bench import scale\nprint(json.dumps(scale._run_child({what!r}, sys.argv[1:])))"
    )
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench scale: the {what} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_child(what: str, args: list[str]) -> dict[str, Any]:
    if what in ("manager", "reopen"):
        measure = measure_manager if what == "manager" else measure_reopen
        return measure(Path(args[0]), int(args[1]), ScaleSpec(**json.loads(args[2])))
    if what == "host":
        return measure_host(int(args[0]))
    if what == "router":
        return measure_router(int(args[0]), int(args[1]))
    raise ValueError(f"no child measurement {what!r}")


def point(blocks: int, spec: ScaleSpec, work: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    data_dir = work / f"n{blocks}"
    t0 = time.perf_counter()
    fill(data_dir, blocks, spec.stores)
    progress(f"  {blocks:>10,} blocks: index filled in {time.perf_counter() - t0:.1f} s")
    spec_json = json.dumps(asdict(spec) | {"points": list(spec.points)})
    out: dict[str, Any] = {"blocks": blocks}
    out |= _child("reopen", str(data_dir), str(blocks), spec_json)
    out |= _child("manager", str(data_dir), str(blocks), spec_json)
    out |= _child("host", str(min(blocks, spec.host_blocks)))
    out |= _child("router", str(blocks), str(spec.backends))
    out["ram_bytes_per_block"] = max(out["disk_ram_bytes_per_block"], out["host_ram_bytes_per_block"])
    progress(f"  {blocks:>10,} blocks: " + ", ".join(f"{k} {_fmt(out[k])}" for k in FIELDS[1:]))
    return out


def run(spec: ScaleSpec, *, workdir: Path | None = None, progress: Callable[[str], None] = lambda _: None) -> dict:
    from kvtier.bench.peer.machine import describe

    points = []
    with tempfile.TemporaryDirectory(prefix="kvtier-scale-", dir=workdir) as tmp:
        for blocks in spec.points:
            points.append(point(blocks, spec, Path(tmp), progress))
            _remove_tree(Path(tmp) / f"n{blocks}")
    return {
        "setup": {
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": describe(),
            "layout": layout().descriptor,
            "prompt_blocks": PROMPT_BLOCKS,
            "ram_method": {
                "ram_bytes_per_block": "max(disk_ram_bytes_per_block, host_ram_bytes_per_block)",
                "disk_ram_bytes_per_block": "RssAnon growth across CacheManager start-up, fresh process, over N",
                "host_ram_bytes_per_block": "tracemalloc + the native slot index's allocation, host tier + LRU"
                " policy, over host_ram_blocks (the tier full)",
                "router_bytes_per_block": "tracemalloc, BlockIndex, over N x backends",
                "lookup_p50_us": "hits only (128 blocks confirmed); absent_*: misses at the first block",
                "startup_s": "CacheManager construction after a clean close (sealed index)",
                "startup_after_crash_s": "CacheManager construction over an unsealed index (walked, cursor read)",
            },
            **asdict(spec),
        },
        "points": points,
    }


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What ``--json`` prints: the points, each with the issue's fields first, then the breakdown."""
    return {"date": result["setup"]["date"], "points": result["points"]}


def table(result: dict[str, Any]) -> str:
    s = result["setup"]
    lines = [
        f"kvtier bench scale, {s['date']}: layout {s['layout']}, {s['prompt_blocks']}-block prompts",
        f"  {'blocks':>10} {'lookup p50/p99 us':>18} {'store/s':>9} {'evict/s':>9} {'disk B/blk':>10}"
        f" {'host B/blk':>10} {'start s':>8} {'crash s':>8} {'router B/blk':>12}",
    ]
    for p in result["points"]:
        lines.append(
            f"  {p['blocks']:>10,} {p['lookup_p50_us']:>8.0f}/{p['lookup_p99_us']:<9.0f} {p['store_blocks_s']:>9.0f}"
            f" {p['evict_blocks_s']:>9.0f} {p['disk_ram_bytes_per_block']:>10.0f}"
            f" {p['host_ram_bytes_per_block']:>10.0f}"
            f" {p['startup_s']:>8.2f} {p['startup_after_crash_s']:>8.2f} {p['router_bytes_per_block']:>12.0f}"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = results.pyplot()
    if plt is None:
        return None
    pts = result["points"]
    n = [p["blocks"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [p["lookup_p50_us"] for p in pts], "o-", label="lookup p50")
    a.plot(n, [p["lookup_p99_us"] for p in pts], "o--", label="lookup p99")
    a.set(xscale="log", xlabel="indexed blocks", ylabel="µs per 128-block lookup", title="lookup")
    a.legend()
    for key, label in (
        ("disk_ram_bytes_per_block", "disk tier + policy"),
        ("host_ram_bytes_per_block", "host tier + policy"),
        ("router_bytes_per_block", "router, per backend"),
    ):
        b.plot(n, [p[key] for p in pts], "o-", label=label)
    b.set(xscale="log", xlabel="indexed blocks", ylabel="bytes of RAM per block", title="memory", ylim=(0, None))
    a.set(ylim=(0, None))
    b.legend()
    fig.suptitle(f"kvtier bench scale, {result['setup']['date']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    path = results.write(result, out_dir, "scale")
    return path, plot(result, out_dir / "scale-latest.png")
