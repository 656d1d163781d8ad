"""CUDA-only paths: pinned host slab, transfers on a dedicated stream. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from kvtier.keys import BlockKey
from kvtier.tiers.host import HostTier
from kvtier.transfer import JobStatus, TransferWorker
from tests.helpers import as_bytes, payload, record, toy_layout

pytestmark = pytest.mark.cuda


def test_host_slab_is_pinned_when_cuda_exists() -> None:
    tier = HostTier(toy_layout(), 4 * 4096)
    assert tier.pinned and tier._slab.is_pinned()


def test_transfer_runs_on_its_own_stream_and_reports_done_after_the_copy() -> None:
    layout = toy_layout()
    tier = HostTier(layout, 4 * 4096)
    block = payload(layout, 1)
    key = BlockKey(bytes(16))
    tier.put(key, block, record(0))
    device = torch.empty(layout.block_bytes, dtype=torch.uint8, device="cuda")
    worker = TransferWorker(1)
    seen: list[torch.cuda.Stream] = []

    def h2d() -> None:
        seen.append(torch.cuda.current_stream())
        device.copy_(tier.view(key), non_blocking=True)

    job = worker.submit(h2d)
    worker.drain()
    assert worker.poll(job) is JobStatus.DONE
    assert seen[0] != torch.cuda.default_stream()
    assert torch.equal(device.cpu(), as_bytes(block))
    worker.shutdown()


def test_gpu_bench_moves_the_bytes_and_reports_both_directions() -> None:
    from kvtier.bench import gpu

    out = gpu.run(mib=16, reps=1)
    assert out["cuda"] and out["h2d_gbps"] > 0 and out["raw_pinned_h2d_gbps"] > 0
    assert out["d2h_gbps"] > 0 and out["h2d_vs_raw"] > 0


def test_layerwise_load_to_a_gpu_pool_is_ordered_by_events() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from kvtier.engine.onboard import LayerwiseLoad, LoadPart
    from kvtier.engine.pool import KVPool
    from kvtier.fetch import LoadHandle
    from kvtier.tiers.base import TierKind

    layout = toy_layout()
    tier = HostTier(layout, 8 * 4096)
    keys = [BlockKey(bytes([i]) * 16) for i in range(3)]
    blocks = [payload(layout, 10 + i) for i in range(3)]
    for key, block in zip(keys, blocks, strict=True):
        tier.put(key, block, record(0))
    pool = KVPool(layout, 4, device="cuda")
    released: list[bool] = []
    handle = LoadHandle(
        "ns",
        layout.block_size,
        keys,
        [tier.view(k) for k in keys],
        [TierKind.HOST] * 3,
        lambda h: released.append(True),
    )
    with ThreadPoolExecutor(1) as executor:
        load = LayerwiseLoad(pool, [LoadPart(handle, [3, 0, 2])], executor)
        for layer in range(layout.num_layers):
            load.wait(layer)  # the compute stream now waits on this layer's event
            got = pool.layers[layer][[3, 0, 2]].cpu()
            want = torch.stack([b[layer] for b in blocks])
            assert torch.equal(got, want)
        load.finish()
    assert released == [True]
