"""`kvtier bench tiers`: each tier's bandwidth next to the raw hardware, in one run.

Every figure is a ratio's two halves measured back to back on the same bytes:

* host put/get vs one plain ``torch`` copy of the same number of bytes;
* disk put/get vs a sequential read of a same-size file in the same directory,
  both through ``os.preadv`` with the page cache dropped first
  (``posix_fadvise(DONTNEED)`` after an fsync, allowed to any process; the
  JSON says ``"cold": false`` if that failed), and vs the same read with
  O_DIRECT into an aligned buffer (``raw_direct_read_gbps``, null where the
  filesystem refuses O_DIRECT). Both raw reads are one thread, 8 MiB
  requests; the JSON names the tier's I/O path (``io_mode``: direct or
  buffered; ``io_backend``: the C extension or the pure-Python fallback);
* block keys for 128k tokens vs one xxh3-128 pass over the same token bytes.

Medians over ``reps`` repetitions after one warm-up, because the machine is
shared and noisy. The payload shape is SmolLM2-135M's KV in bf16 (30 layers,
3 KV heads, head dim 64): 23,040 bytes per token.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from tqdm import tqdm

from kvtier.bench import results
from kvtier.config import Config, FsyncMode
from kvtier.keys import DIGEST_BYTES, BlockDigest, BlockKey, KeyHasher, Secret
from kvtier.layout import KVLayout
from kvtier.tiers import native
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.disk import DiskTier, IOMode, io_mode_for
from kvtier.tiers.host import HostTier, align_up

KEY_TOKENS = 131072
RAW_CHUNK = 8 * 1024**2


@dataclass(frozen=True)
class BenchSpec:
    mib: int = 256
    reps: int = 5
    block_sizes: tuple[int, ...] = ()  # extra block sizes to sweep (host/disk get, keys)


def smollm2_layout(block_size: int, dtype: torch.dtype = torch.bfloat16) -> KVLayout:
    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=block_size, dtype=dtype)


def median_s(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> float:
    """Median seconds of ``reps`` runs of ``fn`` after one dropped; ``before`` runs untimed ahead of each."""
    times = []
    for _ in range(reps + 1):  # the first run warms caches and page tables; it is dropped
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _interleaved(
    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]], reps: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Seconds of each ``(fn, before)`` case, every repetition running each case once in turn.

    A ratio's two halves timed one after the other in full carry whatever
    changed on a shared machine in between (a neighbour's I/O, the state of
    the page cache, a busy core) into the ratio. Interleaved, each
    repetition is a pair measured under the same conditions. The first
    ``warmup`` repetitions are dropped: they read bytes the bench has just
    written, and on a virtual disk the first reads of such bytes can be slow
    whatever the guest's page cache holds (bench/README.md has the figures).
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(warmup + reps):
        for name, (fn, before) in cases.items():
            before()
            start = time.perf_counter()
            fn()
            if rep >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


@dataclass(frozen=True)
class _Workload:
    """``n`` random blocks to store (``src`` rows) and room to read them back (``dst`` rows)."""

    src: torch.Tensor
    dst: torch.Tensor
    keys: list[BlockKey]
    records: list[BlockRecord]
    blocks: list[torch.Tensor]
    outs: list[torch.Tensor]
    nbytes: int

    @classmethod
    def make(cls, layout: KVLayout, n: int) -> _Workload:
        src = torch.randint(0, 256, (n, layout.block_bytes), dtype=torch.uint8)
        dst = torch.empty_like(src)
        keys = [BlockKey(i.to_bytes(16, "little")) for i in range(n)]
        records = [BlockRecord(BlockDigest(i.to_bytes(DIGEST_BYTES, "little")), None) for i in range(n)]
        return cls(src, dst, keys, records, list(src), list(dst), n * layout.block_bytes)


def bench_host(layout: KVLayout, n: int, reps: int) -> dict[str, float]:
    tier = HostTier(layout, n * tier_slot(layout))
    w = _Workload.make(layout, n)
    src, dst, keys, outs, nbytes = w.src, w.dst, w.keys, w.outs, w.nbytes
    put = median_s(lambda: tier.put_many(keys, w.blocks, w.records), reps, before=lambda: tier.remove_many(keys))
    get = median_s(lambda: tier.get_many(keys, outs), reps)
    assert torch.equal(dst, src), "host tier returned other bytes"
    memcpy = median_s(lambda: dst.copy_(src), reps)
    return {"put_gbps": _gbps(nbytes, put), "get_gbps": _gbps(nbytes, get), "memcpy_gbps": _gbps(nbytes, memcpy)}


def tier_slot(layout: KVLayout) -> int:
    return align_up(layout.block_bytes)


def _drop(fd: int) -> bool:
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def _raw_read(path: Path, buf: Any, flags: int = 0) -> None:
    """A plain sequential read of ``path`` into ``buf`` in RAW_CHUNK requests (``flags``: e.g. O_DIRECT)."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        view = memoryview(buf)
        for off in range(0, view.nbytes, RAW_CHUNK):
            os.preadv(fd, [view[off : off + RAW_CHUNK]], off)
    finally:
        os.close(fd)


def _raw_direct_read(path: Path, buf: Any) -> None:
    """:func:`_raw_read` with O_DIRECT (``buf`` aligned, its size rounded up)."""
    _raw_read(path, buf, os.O_DIRECT)


def bench_disk(layout: KVLayout, n: int, reps: int, where: Path, io_mode: IOMode | None = None) -> dict[str, Any]:
    tier = DiskTier(
        where / "tier",
        layout,
        n * tier_slot(layout),
        model_fingerprint="bench",
        fsync=FsyncMode.BATCH,
        file_bytes=n * tier_slot(layout),
        io_mode=io_mode,
    )
    w = _Workload.make(layout, n)
    src, dst, keys, outs, nbytes = w.src, w.dst, w.keys, w.outs, w.nbytes
    put = median_s(lambda: tier.put_many(keys, w.blocks, w.records), reps, before=lambda: tier.remove_many(keys))

    raw_path = where / "raw.bin"
    raw = np.empty(nbytes, dtype=np.uint8)
    cold: list[bool] = []
    with open(raw_path, "wb") as f:
        f.write(src.numpy().tobytes())
        f.flush()
        cold.append(_drop(f.fileno()))

    def drop_raw() -> None:
        fd = os.open(raw_path, os.O_RDONLY)
        cold.append(_drop(fd))
        os.close(fd)

    os.sync()  # the puts' and the raw file's writes reach the device before any read is timed beside them
    direct = native.probe_direct(where) is None
    aligned = native.alloc_aligned(align_up(nbytes)) if direct else None
    cases: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
        "get": (lambda: tier.get_many(keys, outs), lambda: cold.append(tier.drop_page_cache())),
        "raw": (lambda: _raw_read(raw_path, raw), drop_raw),
    }
    if aligned is not None:
        cases["direct"] = (lambda: _raw_direct_read(raw_path, aligned), drop_raw)
    times = _interleaved(cases, reps)
    assert torch.equal(dst, src), "disk tier returned other bytes"
    tier.close()
    get, raw_s = statistics.median(times["get"]), statistics.median(times["raw"])
    direct_gbps = _gbps(nbytes, statistics.median(times["direct"])) if "direct" in times else None
    by_rep = [round(r / g, 3) for g, r in zip(times["get"], times["raw"], strict=True)]
    return {
        "put_gbps": _gbps(nbytes, put),
        "get_gbps": _gbps(nbytes, get),
        "raw_read_gbps": _gbps(nbytes, raw_s),
        "raw_direct_read_gbps": direct_gbps,
        "cold": all(cold),
        "get_vs_raw_by_rep": by_rep,
        "cache_drop": "posix_fadvise(POSIX_FADV_DONTNEED) after fsync",
        "fsync": FsyncMode.BATCH.value,
        "io_mode": tier.io_mode.value,
        "io_backend": tier.io_backend,
        "crc32c": native.BACKEND.crc32c_impl,
    }


def bench_keys(data_dir: Path, reps: int, block_size: int) -> dict[str, float | int]:
    secret = Secret.load_or_create(data_dir)
    hasher = KeyHasher(secret, model_fingerprint="bench", layout_descriptor="bench", block_size=block_size)
    tokens = np.random.default_rng(0).integers(0, 49152, KEY_TOKENS, dtype=np.int32)
    raw = tokens.astype("<i4").tobytes()
    keys_s = median_s(lambda: hasher.keys(tokens, "bench"), reps)
    raw_s = median_s(lambda: xxhash.xxh3_128_digest(raw, secret.seed), reps)
    return {
        "tokens": KEY_TOKENS,
        "block_size": block_size,
        "keys_ms": round(keys_s * 1e3, 3),
        "raw_xxh3_ms": round(raw_s * 1e3, 4),
    }


def run(config: Config, spec: BenchSpec) -> dict[str, Any]:
    bs = config.cache.block_size
    layout = smollm2_layout(bs)
    n = max(8, spec.mib * 1024**2 // layout.block_bytes)
    parent = config.data_dir
    parent.mkdir(parents=True, exist_ok=True)
    where = Path(tempfile.mkdtemp(prefix="bench-", dir=parent))
    steps = ["host", "disk", "keys", *(f"block_size={b}" for b in spec.block_sizes)]
    result: dict[str, Any] = {}
    try:
        with tqdm(total=len(steps), desc="bench tiers", unit="step", leave=False) as bar:
            result["host"] = bench_host(layout, n, spec.reps)
            bar.update()
            io_mode = io_mode_for(config.disk.io)
            result["disk"] = bench_disk(layout, n, spec.reps, where, io_mode)
            bar.update()
            result["keys"] = bench_keys(where, spec.reps, bs)
            bar.update()
            sweep = []
            for b in spec.block_sizes:
                lay = smollm2_layout(b)
                nb = max(8, spec.mib * 1024**2 // lay.block_bytes)
                sub = where / f"bs{b}"
                sub.mkdir()
                sweep.append(
                    {
                        "block_size": b,
                        "block_bytes": lay.block_bytes,
                        "host_get_gbps": bench_host(lay, nb, spec.reps)["get_gbps"],
                        "disk_get_gbps": bench_disk(lay, nb, spec.reps, sub, io_mode)["get_gbps"],
                        "keys_ms": bench_keys(sub, spec.reps, b)["keys_ms"],
                    }
                )
                bar.update()
            if sweep:
                result["block_size_sweep"] = sweep
    finally:
        shutil.rmtree(where, ignore_errors=True)
    result["setup"] = {
        "block_size": bs,
        "block_bytes": layout.block_bytes,
        "blocks": n,
        "bytes": n * layout.block_bytes,
        "reps": spec.reps,
        "statistic": "median",
        "dir": str(parent),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return result


def ratios(result: dict[str, Any]) -> dict[str, float]:
    h, d, k = result["host"], result["disk"], result["keys"]
    out = {
        "host_get_vs_memcpy": round(h["get_gbps"] / h["memcpy_gbps"], 3),
        "host_put_vs_memcpy": round(h["put_gbps"] / h["memcpy_gbps"], 3),
        # the median of each repetition's pair (see _interleaved), not a ratio of two medians
        "disk_get_vs_raw_read": statistics.median(d["get_vs_raw_by_rep"])
        if d.get("get_vs_raw_by_rep")
        else round(d["get_gbps"] / d["raw_read_gbps"], 3),
        "keys_vs_raw_xxh3": round(k["keys_ms"] / max(k["raw_xxh3_ms"], 1e-6), 1),
    }
    if d.get("raw_direct_read_gbps"):
        out["disk_get_vs_raw_direct_read"] = round(d["get_gbps"] / d["raw_direct_read_gbps"], 3)
    return out


def table(result: dict[str, Any]) -> str:
    h, d, k, r = result["host"], result["disk"], result["keys"], ratios(result)
    s = result["setup"]
    lines = [
        f"kvtier tier benchmark: {s['blocks']} blocks x {s['block_bytes']:,} B ({s['bytes'] / 2**20:.0f} MiB), "
        f"block_size {s['block_size']}, median of {s['reps']}",
        f"  host  put {h['put_gbps']:7.2f} GB/s   get {h['get_gbps']:7.2f} GB/s"
        f"   torch copy {h['memcpy_gbps']:7.2f} GB/s   get/copy = {r['host_get_vs_memcpy']:.2f}",
        f"  disk  put {d['put_gbps']:7.2f} GB/s   get {d['get_gbps']:7.2f} GB/s"
        f"   raw read   {d['raw_read_gbps']:7.2f} GB/s   get/raw  = {r['disk_get_vs_raw_read']:.2f}"
        f"   (cold page cache: {d['cold']})",
        f"        I/O {d['io_mode']} ({d['io_backend']}, crc32c {d['crc32c']})"
        + (
            f"   raw O_DIRECT read {d['raw_direct_read_gbps']:7.2f} GB/s"
            f"   get/raw O_DIRECT = {r['disk_get_vs_raw_direct_read']:.2f}"
            if d.get("raw_direct_read_gbps")
            else "   raw O_DIRECT read: refused by this filesystem"
        ),
        f"  keys  {k['tokens']:,} tokens in {k['keys_ms']:.3f} ms"
        f"   raw xxh3-128 over the same bytes {k['raw_xxh3_ms']:.4f} ms",
    ]
    for row in result.get("block_size_sweep", []):
        lines.append(
            f"  block_size {row['block_size']:4d}: host get {row['host_get_gbps']:6.2f} GB/s, "
            f"disk get {row['disk_get_gbps']:6.2f} GB/s, keys {row['keys_ms']:.3f} ms"
        )
    return "\n".join(lines)


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    """Write the JSON (dated and ``-latest``) and a PNG plot beside it when matplotlib is present."""
    path = results.write({**result, "ratios": ratios(result)}, out_dir, "tiers")
    return path, plot(result, path.with_suffix(".png"))


def plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = results.pyplot()
    if plt is None:
        return None
    h, d, k = result["host"], result["disk"], result["keys"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 3, 2]})
    ax1.bar(
        ["put", "get", "torch copy"],
        [h["put_gbps"], h["get_gbps"], h["memcpy_gbps"]],
        color=["#4c72b0", "#4c72b0", "#999999"],
    )
    ax1.set_title("host tier vs memcpy")
    ax1.set_ylabel("GB/s")
    labels, values = ["put", "get", "raw read"], [d["put_gbps"], d["get_gbps"], d["raw_read_gbps"]]
    if d.get("raw_direct_read_gbps"):
        labels.append("raw O_DIRECT")
        values.append(d["raw_direct_read_gbps"])
    ax2.bar(labels, values, color=["#dd8452", "#dd8452"] + ["#999999"] * (len(values) - 2))
    ax2.set_title(f"disk tier ({d.get('io_mode', '?')} I/O) vs raw read (cold={d['cold']})")
    ax3.bar(["block keys", "raw xxh3"], [k["keys_ms"], k["raw_xxh3_ms"]], color=["#55a868", "#999999"])
    ax3.set_title(f"keys for {k['tokens']:,} tokens")
    ax3.set_ylabel("ms")
    s = result["setup"]
    fig.suptitle(
        f"kvtier bench tiers: {s['bytes'] / 2**20:.0f} MiB, block {s['block_size']}, {s['machine']}, {s['date']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
