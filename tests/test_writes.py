"""The write policy: which tiers below host take a copy of a block when it is stored, evicted, or left at close."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier.config import RemoteWriteOn, WriteMode
from kvtier.writes import Moment, WritePolicy

S, E, C = Moment.STORED, Moment.EVICTED, Moment.CLOSED


@pytest.mark.parametrize(
    ("mode", "disk_at"),
    [(WriteMode.WRITE_THROUGH, {S}), (WriteMode.WRITE_BACK, {E, C})],
    ids=lambda v: getattr(v, "value", ""),
)
def test_disk_gets_a_copy_at_store_or_at_eviction_and_close(mode: WriteMode, disk_at: set[Moment]) -> None:
    policy = WritePolicy(mode, has_disk=True, remote_on=None)
    assert {m for m in Moment if policy.to_disk(m)} == disk_at
    assert not any(WritePolicy(mode, has_disk=False, remote_on=None).to_disk(m) for m in Moment)
    assert not any(policy.to_remote(m) for m in Moment)


@pytest.mark.parametrize(("on", "at"), [(RemoteWriteOn.STORE, S), (RemoteWriteOn.HOST_EVICTION, E)])
def test_the_remote_gets_a_copy_at_the_one_moment_it_asks_for(on: RemoteWriteOn, at: Moment) -> None:
    for mode in WriteMode:
        assert {m for m in Moment if WritePolicy(mode, has_disk=True, remote_on=on).to_remote(m)} == {at}


def test_the_mechanism_never_reads_the_modes_itself() -> None:
    """store.py and evict.py copy bytes; only writes.py names the config's write modes."""
    package = Path(__file__).resolve().parents[1] / "kvtier"
    for name in ("store.py", "evict.py", "promote.py", "manager.py"):
        names = {n.id for n in ast.walk(ast.parse((package / name).read_text())) if isinstance(n, ast.Name)}
        assert not names & {"WriteMode", "RemoteWriteOn"}, name
