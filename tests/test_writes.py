"""The write policy: which tiers below host take a copy of a block when it is stored, evicted, or left at close."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvtier.config import RemoteWriteOn, WriteMode
from kvtier.manager import CacheManager
from kvtier.tiers.base import TierKind
from kvtier.writes import Moment, WritePolicy
from tests.helpers import BLOCK, make_config, payload, prompt, toy_layout

S, E, C, R = Moment.STORED, Moment.EVICTED, Moment.CLOSED, Moment.RETAINED


@pytest.mark.parametrize(
    ("mode", "disk_at"),
    [(WriteMode.WRITE_THROUGH, {S, R}), (WriteMode.WRITE_BACK, {E, C, R})],
    ids=lambda v: getattr(v, "value", ""),
)
def test_disk_gets_a_copy_at_store_or_at_eviction_and_close_and_always_at_retain(
    mode: WriteMode, disk_at: set[Moment]
) -> None:
    policy = WritePolicy(mode, remote_on=None)
    assert {m for m in Moment if policy.copies(TierKind.DISK, m)} == disk_at
    assert not any(policy.copies(TierKind.REMOTE, m) for m in Moment)
    assert not any(policy.copies(kind, m) for kind in (TierKind.DEVICE, TierKind.HOST) for m in Moment)


@pytest.mark.parametrize(("on", "at"), [(RemoteWriteOn.STORE, S), (RemoteWriteOn.HOST_EVICTION, E)])
def test_the_remote_gets_a_copy_at_the_one_moment_it_asks_for(on: RemoteWriteOn, at: Moment) -> None:
    for mode in WriteMode:
        assert {m for m in Moment if WritePolicy(mode, remote_on=on).copies(TierKind.REMOTE, m)} == {at}


@pytest.mark.parametrize("promise_first", [True, False], ids=["pinned-then-stored", "stored-then-pinned"])
def test_a_retained_block_is_on_disk_at_once_under_write_back(tmp_path: Path, promise_first: bool) -> None:
    """Write-back would put a block on disk only when host evicts it; a promise puts it there now.

    Either order: a request is pinned at admission and stored after its
    prefill (the store copies it), or a prefix already cached is marked
    (the pin copies it). Unpromised blocks stay write-back, and the remote
    never takes a retained copy (the policy test above).
    """
    cfg = make_config(
        tmp_path,
        host={"capacity_bytes": 16 * 4096},
        disk={"capacity_bytes": 16 * 4096},
        cache={"write_mode": WriteMode.WRITE_BACK},
    )
    with CacheManager(cfg, toy_layout(), model_fingerprint="toy-model") as m:
        assert m.disk is not None
        kept, other = m.keyed(prompt(3 * BLOCK, seed=1)), m.keyed(prompt(3 * BLOCK, seed=2))
        data = [payload(toy_layout(), i) for i in range(3)]
        if promise_first:
            m.pin_for(kept, 60.0)
        m.store(kept, data)
        m.store(other, data)
        if not promise_first:
            assert not any(m.disk.contains(k) for k in kept.keys)  # write-back: nothing below host yet
            m.pin_for(kept, 60.0)
        assert [m.disk.contains(k) for k in kept.keys] == [True] * 3
        assert not any(m.disk.contains(k) for k in other.keys)
        written = m.disk.stats.bytes_written
        m.pin_for(kept, 60.0)  # promised again: disk holds them, nothing is written twice
        m.pin_for(kept.prefix(2 * BLOCK), 0)  # a release copies nothing either
        assert m.disk.stats.bytes_written == written
        assert m.stats().pinned_blocks == 0  # the read pins the copies took are all let go


def test_the_mechanism_never_reads_the_modes_itself() -> None:
    """store.py and evict.py copy bytes; only writes.py names the config's write modes."""
    package = Path(__file__).resolve().parents[1] / "kvtier"
    for name in ("store.py", "evict.py", "promote.py", "manager.py"):
        names = {n.id for n in ast.walk(ast.parse((package / name).read_text())) if isinstance(n, ast.Name)}
        assert not names & {"WriteMode", "RemoteWriteOn"}, name


def test_the_data_path_walks_the_tiers_under_host_never_names_them() -> None:
    """Below the manager, tiers under host are a list in order: no module names the disk or the remote tier.

    Host keeps its name: it is the staging tier every block is written into
    and read out of, a role no other tier has. The tier set holds the rest
    as lists (owned, shared), and only the write policy says which kind
    takes a copy when.
    """
    package = Path(__file__).resolve().parents[1] / "kvtier"
    named = {"disk", "remote", "DISK", "REMOTE", "DiskTier", "RemoteTier"}
    tierset = ast.parse((package / "tierset.py").read_text())
    trees = {
        name: ast.parse((package / name).read_text()) for name in ("store.py", "evict.py", "promote.py", "lookup.py")
    }
    # tierset.py opens the tiers from the config by name; its TierSet class walks them as lists
    trees["TierSet"] = next(n for n in ast.walk(tierset) if isinstance(n, ast.ClassDef) and n.name == "TierSet")
    for name, tree in trees.items():
        words = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        words |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert not words & named, name
    fields = [
        f.target.id
        for f in trees["TierSet"].body  # type: ignore[attr-defined]
        if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
    ]
    assert fields == ["host", "owned", "shared", "lock"]
