"""Power loss: writes not yet synced are dropped, names never synced vanish, and the disk tier stays whole.

The fault (:mod:`kvtier.bench.faults_power`) runs the real disk tier on real
files; only the cut is simulated, by rewriting the tree to what its fsyncs
made durable. Before kvtier synced the directories it creates files in, the
model dropped every slab file and the key secret, and this test lost every
acknowledged block.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvtier.bench.faults import Fault
from kvtier.bench.faults_power import SyncLedger, power_loss


def _sync(ledger: SyncLedger, path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        ledger.fsync(fd)
    finally:
        os.close(fd)


def test_a_power_cut_keeps_every_acknowledged_block_and_no_unverified_entry(tmp_path: Path) -> None:
    outcome = power_loss(tmp_path, trials=4)
    f = outcome.figures
    assert outcome.fault is Fault.POWER_LOSS
    assert (f["lost"], f["wrong"], f["unverified_entries"], f["orphan_slots"]) == (0, 0, 0, 0)
    assert f["acknowledged"] > 0 and f["dropped_files"] + f["dropped_rewound"] > 0  # stored, and then dropped
    assert (f["bytes_unaccounted"], f["secret_changed"]) == (0, 0)
    assert outcome.held and outcome.wrong_bytes_served == 0


def test_the_ledger_keeps_only_synced_bytes_under_synced_names(tmp_path: Path) -> None:
    ledger = SyncLedger(tmp_path)
    kept, never, nameless = tmp_path / "kept", tmp_path / "never", tmp_path / "nameless"
    kept.write_bytes(b"synced")
    _sync(ledger, kept)
    never.touch()
    _sync(ledger, tmp_path)  # the names "kept" and "never" are durable from here
    never.write_bytes(b"bytes never synced")
    kept.write_bytes(b"synced, then overwritten")
    nameless.write_bytes(b"synced, but its name never was")
    _sync(ledger, nameless)
    ledger.power_loss()
    assert kept.read_bytes() == b"synced"
    assert never.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "never"]
