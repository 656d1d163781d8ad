"""Fetches: host blocks pinned at once, disk blocks promoted in the background, deadlines honoured, no pin leaks."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvtier.config import WriteMode
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, as_bytes, prompt
from tests.test_manager import kv, manager

H, D = TierKind.HOST, TierKind.DISK


def half_on_disk(m, n_blocks: int = 6):
    """``n_blocks`` stored write-through, then host emptied of the second half: tiers (H.., D..)."""
    tokens = prompt(n_blocks * BLOCK + 1)
    blocks = kv(n_blocks, seed=11)
    assert m.store(m.keyed(tokens), blocks) == n_blocks
    result = m.lookup(m.keyed(tokens))
    m.host.remove_many(list(result.keys[n_blocks // 2 :]))
    for key in result.keys[n_blocks // 2 :]:
        m.eviction.policies[H].on_remove(key)
    return tokens, blocks


def test_host_blocks_are_pinned_before_fetch_returns_and_disk_blocks_land_later(tmp_path: Path) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens, blocks = half_on_disk(m)
        result = m.lookup(m.keyed(tokens))
        assert result.tiers == (H, H, H, D, D, D)
        fetch = m.fetch(result)
        assert fetch.landed >= 3 and all(m.pinned(k) == 1 for k in result.keys[:3])
        with fetch.take() as handle:  # no deadline: waits for the disk batch
            assert handle.served_from == [H, H, H, D, D, D]
            assert all(torch.equal(g, as_bytes(b)) for g, b in zip(handle.blocks, blocks, strict=True))
        assert m.stats().pinned_blocks == 0
        assert m.lookup(m.keyed(tokens)).tiers == (H,) * 6  # promoted for good
        assert m.stats().break_even["tiers"]["disk"]["samples"] == 1


def busy_workers(m) -> threading.Event:
    """Occupy every transfer thread until the returned event is set (so a fetch's promotion waits)."""
    go, started = threading.Event(), threading.Barrier(m.config.transfer.workers + 1)

    def hold() -> None:
        started.wait()
        go.wait()

    for _ in range(m.config.transfer.workers):
        m.worker.submit(hold)
    started.wait()
    return go


def test_a_passed_deadline_hands_over_only_what_landed(tmp_path: Path) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens, _ = half_on_disk(m)
        go = busy_workers(m)
        fetch = m.fetch(m.lookup(m.keyed(tokens)), deadline_s=0.0)
        handle = fetch.take()
        assert handle.served_from == [H, H, H] and fetch.missed_deadline
        go.set()
        m.worker.drain()  # the promotion ran after the take: it must not leave pins behind
        assert m.stats().pinned_blocks == 3
        handle.release()
        assert m.stats().pinned_blocks == 0


def test_extend_grants_time_at_the_deadline(tmp_path: Path) -> None:
    """The disk half is held back (every transfer worker busy) until extend is asked, so it is asked."""
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens, _ = half_on_disk(m)
        asked: list[int] = []
        go = threading.Event()
        busy = [m.worker.submit(go.wait) for _ in range(m.config.transfer.workers)]

        def extend(landed: int, elapsed: float) -> float:
            asked.append(landed)
            go.set()  # the promotion may run now
            return 60.0  # plenty: the fetch finishes well within it

        with m.fetch(m.lookup(m.keyed(tokens)), deadline_s=0.0).take(extend) as handle:
            assert handle.served_from == [H, H, H, D, D, D]
        assert asked[0] == 3  # the host half, pinned at once; the disk half had not started
        for job in busy:
            m.worker.wait(job)


def test_cancel_unpins_and_a_fetch_is_taken_once(tmp_path: Path) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens, _ = half_on_disk(m)
        fetch = m.fetch(m.lookup(m.keyed(tokens)))
        fetch.cancel()
        m.worker.drain()
        assert m.stats().pinned_blocks == 0
        with pytest.raises(RuntimeError):
            fetch.take()


def test_fetch_stops_at_the_first_block_disk_lost(tmp_path: Path) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens, _ = half_on_disk(m)
        result = m.lookup(m.keyed(tokens))
        m.disk.remove(result.keys[4])  # gone between lookup and fetch
        with m.fetch(result).take() as handle:
            assert handle.served_from == [H, H, H, D]
        assert m.stats().pinned_blocks == 0


def test_a_batch_that_lands_after_the_take_is_unpinned_by_its_producer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens, _ = half_on_disk(m)
        reading, go = threading.Event(), threading.Event()
        real_get_many = m.disk.get_many

        def held_read(keys, outs):  # the real read, held until the take has happened
            reading.set()
            go.wait()
            return real_get_many(keys, outs)

        monkeypatch.setattr(m.disk, "get_many", held_read)
        fetch = m.fetch(m.lookup(m.keyed(tokens)), deadline_s=0.0)
        assert reading.wait(10)
        handle = fetch.take()
        go.set()
        m.worker.drain()
        assert handle.served_from == [H, H, H]
        assert m.stats().pinned_blocks == 3  # the late batch was committed to host, then unpinned
        handle.release()
        assert m.stats().pinned_blocks == 0
        assert m.lookup(m.keyed(tokens)).tiers == (H,) * 6


def test_a_thousand_fetches_leave_no_job_behind_and_a_failed_promotion_is_counted(tmp_path: Path, caplog) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens, _ = half_on_disk(m)
        for _ in range(1000):
            result = m.lookup(m.keyed(tokens))
            with m.fetch(result).take():
                pass
            m.host.remove_many(list(result.keys[3:]))  # back on disk only: the next fetch promotes again
            for key in result.keys[3:]:
                m.eviction.policies[H].on_remove(key)
        m.worker.drain()
        assert m.worker.held() == 0 and m.worker.spawn_failures == 0
        assert m.stats().pinned_blocks == 0

        def broken(keys):
            raise RuntimeError("injected promotion failure")

        m.promoter._promote_many = broken  # type: ignore[method-assign]
        with m.fetch(m.lookup(m.keyed(tokens))).take() as handle:
            assert handle.served_from == [H, H, H]  # the disk half became a miss
        m.worker.drain()
        assert m.worker.held() == 0 and m.worker.spawn_failures == 1
        assert any("promoting lower-tier blocks to host" in r.getMessage() for r in caplog.records)
