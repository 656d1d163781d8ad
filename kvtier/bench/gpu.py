"""`kvtier bench gpu`: host tier ↔ GPU bandwidth next to a raw pinned copy of the same bytes.

What an engine on a GPU pays to load a cached prefix: ``h2d`` is the
engine's own onboarding (:class:`~kvtier.engine.onboard.LayerwiseLoad`)
from host-tier slots into a KV pool in device memory, every layer of every
block in place and its last event complete. ``d2h`` is the store path's
copy: the blocks gathered in device memory, then copied block by block
into their host slots on a transfer thread (what the engine's store job
does). The baseline of each is one ``cudaMemcpyAsync`` of the same
bytes between one pinned buffer and device memory (a torch ``copy_`` with
``non_blocking=True``). Medians after a warm-up. Without CUDA it says so
and measures nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvtier.bench.tiers import _Workload, median_s, smollm2_layout, tier_slot
from kvtier.engine.onboard import LayerwiseLoad
from kvtier.engine.pool import KVPool
from kvtier.fetch import LoadHandle
from kvtier.tiers.base import TierKind
from kvtier.tiers.host import HostTier
from kvtier.transfer import TransferWorker


def _median_s(fn: Callable[[], None], reps: int) -> float:
    """:func:`~kvtier.bench.tiers.median_s` with the device drained before each run and inside its timing:
    an asynchronous copy is done when the GPU says so, not when the call returns."""

    def synced() -> None:
        fn()
        torch.cuda.synchronize()

    return median_s(synced, reps, before=torch.cuda.synchronize)


def run(mib: int = 256, reps: int = 5, block_size: int = 16) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cuda": False}
    layout = smollm2_layout(block_size)
    n = max(8, mib * 1024**2 // layout.block_bytes)
    host = HostTier(layout, n * tier_slot(layout))
    w = _Workload.make(layout, n)
    host.put_many(w.keys, w.blocks, w.records)
    pool = KVPool(layout, n, device="cuda")
    views = [host.view(k) for k in w.keys]
    rows = list(range(n))
    last = views[-1].clone()  # the bytes the last pool block must hold after a load (random: NaNs among them)

    def h2d() -> None:
        handle = LoadHandle("bench", block_size, list(w.keys), views, [TierKind.HOST] * n, lambda h: None)
        LayerwiseLoad(pool, [(handle, rows)]).finish()  # every layer's copies issued, the last event waited on

    worker = TransferWorker(1)

    def d2h() -> None:
        read = pool.payload_reader(rows)  # on the engine's thread, as the publisher gathers

        def copy() -> None:
            for j, view in enumerate(views):
                read(j, view)

        worker.wait(worker.submit(copy))

    h2d()
    got = pool.kv[:, n - 1].cpu().contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(got, last), "a pool block differs from its host slot"
    pinned = torch.empty(n * layout.block_bytes, dtype=torch.uint8, pin_memory=True)
    flat = torch.empty(n * layout.block_bytes, dtype=torch.uint8, device="cuda")
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
    out["h2d_vs_raw"] = round(out["h2d_gbps"] / out["raw_pinned_h2d_gbps"], 3)
    out["d2h_vs_raw"] = round(out["d2h_gbps"] / out["raw_pinned_d2h_gbps"], 3)
    return out
