"""Layer-wise onboarding and arrival-time prefetch: the pool gets exactly the cached bytes, in layer order."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.config import Config
from kvtier.engine.llama import SeqInput
from kvtier.engine.onboard import LayerwiseLoad, LoadPart, SlidingWindow, contiguous_runs, staged_layers
from kvtier.engine.pool import BlockTable, KVPool
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from kvtier.fetch import LoadHandle
from kvtier.tiers import native
from kvtier.tiers.base import TierKind
from tests.engine.test_engine import GREEDY, baseline, check_reuse, config, converse  # noqa: F401 (fixture)
from tests.helpers import as_bytes, payload, toy_layout


def handle_of(blocks: list[torch.Tensor], released: list[bool]) -> LoadHandle:
    return LoadHandle(
        "ns",
        4,
        [b"k%d" % i for i in range(len(blocks))],
        blocks,
        [TierKind.HOST] * len(blocks),
        lambda h: released.append(True),
    )


def test_sliding_layers_leave_out_the_blocks_before_the_window() -> None:
    """Layers 0 and 2 slide: each part's first ``sliding_from`` blocks skip them and leave those pool rows alone."""
    layout = toy_layout()
    assert layout.num_layers >= 3
    pool = KVPool(layout, num_blocks=8)
    blocks = [as_bytes(payload(layout, seed)).clone() for seed in range(5)]
    targets, released = [6, 1, 3, 0, 7], []
    parts = [
        LoadPart(handle_of(blocks[:3], released), targets[:3], 2),
        LoadPart(handle_of(blocks[3:], released), targets[3:], 1),
    ]
    load = LayerwiseLoad(pool, parts, sliding=frozenset({0, 2}))
    load.finish()
    left_out = {6, 1, 0}  # the first two of part one, the first of part two
    for layer in range(layout.num_layers):
        for block, target in zip(blocks, targets, strict=True):
            want = layout.as_blocks(block)[layer]
            if layer in (0, 2) and target in left_out:
                want = torch.zeros_like(want)  # untouched: the pool starts zeroed
            assert torch.equal(pool.layers[layer][target], want), (layer, target)
    assert load.full_nbytes == 5 * layout.block_bytes
    assert load.nbytes == load.full_nbytes - 3 * 2 * layout.layer_bytes
    assert SlidingWindow(16, frozenset({0})).first_block(40, 8) == 3  # tokens from 40 on see positions 25 on
    assert SlidingWindow(16, frozenset({0})).first_block(10, 8) == 0


def test_staged_copy_crosses_once_per_run_of_adjacent_slots_and_lands_like_the_block_copy() -> None:
    """The GPU's path (one transfer per run of adjacent host slots, one indexed copy per layer), run on the CPU."""
    layout = toy_layout()
    slab = torch.cat([as_bytes(payload(layout, seed)) for seed in range(6)])
    slots = list(slab.view(6, layout.block_bytes))
    apart = as_bytes(payload(layout, 9)).clone()  # another allocation: never merged into a run
    blocks = [slots[0], slots[1], slots[2], slots[4], apart, slots[5]]
    runs = list(contiguous_runs(blocks))
    assert [(first, run.numel() // layout.block_bytes) for first, run in runs] == [(0, 3), (3, 1), (4, 1), (5, 1)]
    assert runs[0][1].data_ptr() == slab.data_ptr()  # a view of the slab, not a copy
    targets = [6, 1, 3, 0, 7, 2]
    pool = KVPool(layout, num_blocks=8)
    assert list(staged_layers(pool, blocks, targets)) == list(range(layout.num_layers))
    expected = KVPool(layout, num_blocks=8)
    for block, target in zip(blocks, targets, strict=True):
        expected.write_block_from_payload(target, block)
    assert torch.equal(pool.kv, expected.kv)


def test_layerwise_copy_puts_each_layer_in_place_before_wait_returns() -> None:
    layout = toy_layout()
    pool = KVPool(layout, num_blocks=8)
    blocks = [as_bytes(payload(layout, seed)).clone() for seed in range(5)]
    released: list[bool] = []
    targets = [6, 1, 3, 0, 7]
    assert native.BACKEND is native.NATIVE_BACKEND  # the copy under test is the C one
    with ThreadPoolExecutor(1) as executor:
        load = LayerwiseLoad(
            pool,
            [
                LoadPart(handle_of(blocks[:2], released), targets[:2]),
                LoadPart(handle_of(blocks[2:], released), targets[2:]),
            ],
            executor,
        )
        for layer in range(layout.num_layers):
            load.wait(layer)
            for block, target in zip(blocks, targets, strict=True):
                assert torch.equal(pool.layers[layer][target], layout.as_blocks(block)[layer])
        load.finish()
    assert released == [True, True]
    expected = KVPool(layout, num_blocks=8)
    for block, target in zip(blocks, targets, strict=True):
        expected.write_block_from_payload(target, block)
    assert torch.equal(pool.kv, expected.kv)  # nothing else in the pool was touched
    assert load.nbytes == 5 * layout.block_bytes


def test_the_python_copy_matches_the_native_one() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    out = [torch.zeros(64, dtype=torch.uint8) for _ in range(2)]
    for backend, dst in zip((native.NATIVE_BACKEND, native.PYTHON), out, strict=True):
        d = np.array([dst.data_ptr() + 8, dst.data_ptr() + 40], dtype=np.int64)
        s = np.array([src.data_ptr(), src.data_ptr() + 20], dtype=np.int64)
        assert backend.copy_regions(d, s, 16) == 2
    assert (
        torch.equal(out[0], out[1]) and torch.equal(out[0][8:24], src[:16]) and torch.equal(out[0][40:56], src[20:36])
    )


def test_the_forward_asks_for_every_layer_in_order_before_reading_it(loaded_model: LoadedModel) -> None:
    model = loaded_model.model
    pool = model.make_pool(16, 8)
    table = BlockTable()
    pool.grow(table, 40)
    asked: list[int] = []
    model.forward([SeqInput(list(range(100, 140)), 0, table)], pool, layer_ready=asked.append)
    assert asked == list(range(model.config.num_layers))


def with_transfer(cfg: Config, **transfer: object) -> Config:
    return Config.model_validate(cfg.model_dump() | {"transfer": cfg.transfer.model_dump() | transfer})


def test_reuse_without_prefetch_or_layerwise_copies_is_exact_too(
    loaded_model: LoadedModel,
    tmp_path: Path,
    baseline,  # noqa: F811
) -> None:
    cfg = with_transfer(config(tmp_path, keep_resident=False), prefetch=False, layerwise=False)
    with open_cache(loaded_model, cfg) as cache:
        engine = make_engine(loaded_model, cfg, cache=cache)
        check_reuse(converse(engine, loaded_model), baseline)
        assert engine.prefetch_counters.started == 0
        assert engine.pool.num_free == engine.pool.num_blocks  # every store gave its pool references back


def test_prefetch_serves_disk_blocks_and_a_missed_deadline_recomputes_exactly(
    loaded_model: LoadedModel,
    tmp_path: Path,
    baseline,  # noqa: F811
) -> None:
    cfg = config(tmp_path, keep_resident=False)
    cfg = Config.model_validate(cfg.model_dump() | {"cache": cfg.cache.model_dump() | {"write_mode": "write_through"}})
    ids, out, _ = baseline[-1]
    with open_cache(loaded_model, cfg) as cache:
        engine = make_engine(loaded_model, cfg, cache=cache)
        engine.generate([ids], GREEDY)
        engine.drain_stores()
        cache.clear(TierKind.HOST)
        (done,) = engine.generate([ids], GREEDY)
        assert done.token_ids == out
        assert done.served_from == {TierKind.DISK: done.cached_tokens} and done.cached_tokens > 0
        counters = engine.prefetch_counters
        assert counters.started == 1 and counters.blocks_used == counters.blocks_planned > 0
        assert cache.stats().break_even["tiers"]["disk"]["samples"] >= 1
    # The same, with a deadline that has always passed and no extension: every block is recomputed.
    strict = with_transfer(cfg, deadline_slack=1e-12)
    with open_cache(loaded_model, strict) as cache:
        engine = make_engine(loaded_model, strict, cache=cache)
        go, started = threading.Event(), threading.Barrier(strict.transfer.workers + 1)
        for _ in range(strict.transfer.workers):  # hold the transfer threads: nothing lands before the take
            cache.worker.submit(lambda: (started.wait(), go.wait()))
        started.wait()
        engine.add_request(engine.keyed(ids), GREEDY)
        engine.step()
        go.set()
        while engine.has_unfinished():
            engine.step()
        (req,) = engine.collect_finished()
        assert req.output_ids == out and req.cached_tokens == 0
        assert engine.prefetch_counters.deadline_missed == 1
        engine.drain_stores()
        assert cache.stats().pinned_blocks == 0


def test_close_gives_back_the_pins_of_requests_still_waiting(loaded_model: LoadedModel, tmp_path: Path) -> None:
    cfg = config(tmp_path, keep_resident=False)
    ids = loaded_model.chat_ids([{"role": "user", "content": "Name the planets of the solar system, in order."}])
    with open_cache(loaded_model, cfg) as cache:
        engine = make_engine(loaded_model, cfg, cache=cache)
        engine.generate([ids], GREEDY)
        engine.drain_stores()
        engine.add_request(engine.keyed(ids), GREEDY)  # its fetch pins the host blocks at once
        assert cache.stats().pinned_blocks == engine.prefetch_counters.blocks_planned > 0
        engine.close()
        assert cache.stats().pinned_blocks == 0


@pytest.mark.cuda
def test_loads_into_one_gpu_pool_share_its_stream_and_land_exactly() -> None:
    """Two loads copy on the pool's one stream (the allocator reuses the staging memory) and land byte for byte."""
    layout = toy_layout()
    pool = KVPool(layout, 8, device="cuda")
    for seed in (1, 2):
        blocks = [as_bytes(payload(layout, seed * 10 + i)).pin_memory() for i in range(3)]
        released: list[bool] = []
        load = LayerwiseLoad(pool, [LoadPart(handle_of(blocks, released), [4, 0, 6])])
        for layer in range(layout.num_layers):
            load.wait(layer)
        load.finish()
        assert released == [True]
        for block, row in zip(blocks, [4, 0, 6], strict=True):
            assert torch.equal(pool.kv[:, row].cpu().contiguous().view(torch.uint8).reshape(-1), block)
    assert pool.copy_stream is pool.copy_stream


def test_a_cpu_pool_has_no_copy_stream() -> None:
    with pytest.raises(ValueError, match="without streams"):
        _ = KVPool(toy_layout(), 2).copy_stream
