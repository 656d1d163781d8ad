"""The kill -9 loop over a real cache (host slab, disk tier, LMDB) and the accounting it reports with.

The small run is the product's promise checked end to end: a worker process
stores, fetches, evicts and restarts on one data directory, is SIGKILLed
after a seeded number of its reports, and is restarted; every block read
back equals what was acknowledged, and every block acknowledged durable and
not evicted is still there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench import chaos
from kvtier.bench import chaos_worker as w
from kvtier.bench.faults import FAULTS, Fault, FaultOutcome

URL = "redis://127.0.0.1:1"  # a schedule only names the remote surface's Redis


def test_twenty_kills_serve_no_wrong_byte_and_lose_no_acknowledged_block() -> None:
    result = chaos.run(20, seed=7, faults=False)
    assert result["kills"] == 20 and sum(result["kills_after"].values()) == 20
    assert result["wrong_bytes_served"] == 0
    assert result["lost_acknowledged_blocks"] == 0
    assert result["acknowledged_blocks_checked"] > 0
    assert result["worker_failures"] == []
    assert result["service_slabs_left"] <= 1  # each killed service's slab reclaimed by the next service's start
    assert result["restart_s"]["opens"] >= 21  # one open per worker, clean restarts on top


def test_remote_lives_serve_blocks_from_redis_and_survive_its_kills() -> None:
    """Only the remote surface: blocks the disk evicted come back from Redis, checked; Redis dies and returns."""
    result = chaos.run(40, seed=5, faults=False, surfaces=[w.Surface.REMOTE])
    assert result["served_from_remote"] > 0 and result["redis_kills"] > 0
    assert result["wrong_bytes_served"] == 0 and result["lost_acknowledged_blocks"] == 0
    assert result["worker_failures"] == []  # a dead remote is never an error


def test_the_schedule_is_a_function_of_the_seed() -> None:
    assert chaos.schedule(3, 50, URL) == chaos.schedule(3, 50, URL)
    assert chaos.schedule(3, 50, URL) != chaos.schedule(4, 50, URL)
    assert chaos.schedule(3, 50, URL)[-1].kill_after is None  # the last worker only opens and is checked


def test_the_ledger_counts_a_lost_block_and_a_wrong_one() -> None:
    ledger = chaos.Ledger()
    ledger.hear(w.Intent([("aa", "d1"), ("bb", "d2"), ("cc", "d3")]))
    ledger.hear(w.Durable(["aa", "bb", "cc"]))
    ledger.hear(w.Evicting(["cc"]))  # evicted on purpose: not lost when it is gone
    ledger.hear(w.ServedBlocks([("aa", "d1"), ("bb", "xx")]))
    ledger.hear(w.Present([("aa", "d1")]))
    ledger.hear(w.Ready(0.01, 1))
    assert (ledger.wrong_blocks, ledger.lost, ledger.acknowledged_blocks_checked) == (1, 1, 2)
    assert ledger.durable == {"aa"}


def test_a_fault_that_raises_is_reported_as_not_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(workdir: Path) -> FaultOutcome:
        raise RuntimeError("injector broke")

    monkeypatch.setitem(FAULTS, Fault.REMOTE_DOWN, broken)
    entry = chaos.run_fault(Fault.REMOTE_DOWN, tmp_path)
    assert entry["held"] is False and "injector broke" in entry["error"]


def test_every_faults_module_is_loaded() -> None:
    chaos.load_faults()
    assert Fault.POWER_LOSS in FAULTS
