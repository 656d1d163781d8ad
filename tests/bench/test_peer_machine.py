"""What the peer benchmark records about the machine and about other work competing for it."""

from __future__ import annotations

import itertools

import pytest

from kvtier.bench.peer import machine


def test_others_share_is_system_cpu_minus_our_own_over_wall_and_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    system = iter([100.0, 110.0])  # 10 CPU-seconds busy machine-wide
    own = iter([5.0, 9.0])  # 4 of them ours (self + waited-for children)
    clock = iter([0.0, 5.0])  # over 5 s of wall time
    monkeypatch.setattr(machine, "_system_busy_s", lambda: next(system))
    monkeypatch.setattr(machine, "_own_cpu_s", lambda: next(own))
    monkeypatch.setattr(machine.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(machine.os, "cpu_count", lambda: 2)
    assert machine.Contention.start().stop() == {"wall_s": 5.0, "others_cpu_share": 0.6}  # 6 / (5 * 2)


def test_without_proc_stat_the_share_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(machine, "_system_busy_s", lambda: None)
    assert machine.Contention.start().stop()["others_cpu_share"] is None


def test_wait_for_quiet_stops_at_the_first_quiet_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    shares = iter([0.9, 0.5, 0.1, 0.9])
    monkeypatch.setattr(machine.time, "sleep", lambda s: None)
    monkeypatch.setattr(machine.Contention, "stop", lambda self: {"wall_s": 3.0, "others_cpu_share": next(shares)})
    clock = itertools.count()
    monkeypatch.setattr(machine.time, "monotonic", lambda: float(next(clock)))
    assert machine.wait_for_quiet(1000, busy_below=0.25) == 0.1


def test_describe_names_the_cpu_cores_and_ram() -> None:
    facts = machine.describe()
    assert facts["cores"] >= 1 and facts["ram_gib"] > 0 and facts["cpu"]
    assert set(facts["isa"]) <= set(machine.ISA_FLAGS)
