"""`kvtier bench gpu`: host tier ↔ GPU bandwidth next to a raw pinned copy of the same bytes.

What an engine on a GPU pays to load a cached prefix: kvtier's path copies
block by block from pinned host slots into device memory on the transfer
worker's own CUDA stream, done when the stream's event completes. The
baseline is one ``cudaMemcpyAsync`` of the same bytes from one pinned buffer
(a torch ``copy_`` with ``non_blocking=True``). Both directions; medians
after a warm-up. Without CUDA it says so and measures nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.bench.tiers import _Workload, smollm2_layout, tier_slot
from kvtier.tiers.host import HostTier
from kvtier.transfer import TransferWorker


def _median_s(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run(mib: int = 256, reps: int = 5, block_size: int = 16) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda": False}
    layout = smollm2_layout(block_size)
    n = max(8, mib * 1024**2 // layout.block_bytes)
    host = HostTier(layout, n * tier_slot(layout))
    w = _Workload.make(layout, n)
    host.put_many(w.keys, w.blocks, w.records)
    device = torch.empty((n, layout.block_bytes), dtype=torch.uint8, device="cuda")
    worker = TransferWorker(1)
    views = [host.view(k) for k in w.keys]

    def h2d() -> None:
        def copy() -> None:
            for row, view in zip(device, views, strict=True):
                row.copy_(view, non_blocking=True)

        worker.wait(worker.submit(copy))

    def d2h() -> None:
        def copy() -> None:
            for row, view in zip(device, views, strict=True):
                view.copy_(row, non_blocking=True)

        worker.wait(worker.submit(copy))

    pinned = torch.empty(n * layout.block_bytes, dtype=torch.uint8, pin_memory=True)
    flat = device.view(-1)
    nbytes = n * layout.block_bytes
    out = {
        "cuda": True,
        "device": torch.cuda.get_device_name(),
        "blocks": n,
        "block_bytes": layout.block_bytes,
        "h2d_gbps": round(nbytes / _median_s(h2d, reps) / 1e9, 2),
        "raw_pinned_h2d_gbps": round(nbytes / _median_s(lambda: flat.copy_(pinned, non_blocking=True), reps) / 1e9, 2),
        "d2h_gbps": round(nbytes / _median_s(d2h, reps) / 1e9, 2),
        "raw_pinned_d2h_gbps": round(nbytes / _median_s(lambda: pinned.copy_(flat, non_blocking=True), reps) / 1e9, 2),
    }
    worker.shutdown()
    assert torch.equal(device[0].cpu(), views[0]), "device block differs from its host slot"
    out["h2d_vs_raw"] = round(out["h2d_gbps"] / out["raw_pinned_h2d_gbps"], 3)
    out["d2h_vs_raw"] = round(out["d2h_gbps"] / out["raw_pinned_d2h_gbps"], 3)
    return out
