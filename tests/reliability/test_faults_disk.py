"""The disk faults of the chaos run, as tests: each runs its chaos entry and checks its exact figures.

A fault that needs a mount this host refuses (not root) is skipped with the
reason; everything else runs on real files, a real LMDB and a real tmpfs.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvtier.bench.faults import FAULTS, Fault, FaultOutcome, FaultSkipped
from kvtier.bench.faults_disk import FailingIO


def run(kind: Fault, workdir: Path) -> FaultOutcome:
    try:
        outcome = FAULTS[kind](workdir)
    except FaultSkipped as why:
        pytest.skip(str(why))
    assert outcome.fault is kind
    return outcome


def test_a_full_filesystem_indexes_only_what_it_wrote_and_says_so_once(tmp_path: Path) -> None:
    out = run(Fault.DISK_FULL, tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    assert out.figures == {
        "blocks_stored": 64,
        "disk_indexed": 18,  # four whole 16 KiB slabs and two slots of a fifth fit beside the index
        "write_errors": 46,
        "served_from_host": 64,  # every lookup answered while the disk was full
        "served_after_host_cleared": 18,  # what disk acknowledged, bit-exact; the rest recomputed
        "indexed_after_restart": 18,
        "log_lines": 1,
        # then slabs preallocated whole, the disk filled and the index pinned by a reader: the commit fails
        "commit_log_lines": 1,  # "mdb_txn_commit: No space left on device", once
        "commit_stored": 8,
        "commit_write_errors": 6,  # the first commit reused pages freed before the reader's snapshot
        "commit_indexed": 10,
        "commit_served_from_disk": 10,
        "commit_indexed_after_restart": 10,
    }
    assert not any(p.is_mount() for p in tmp_path.iterdir())  # unmounted


def test_eio_on_write_and_fsync_is_never_indexed_and_on_read_is_a_counted_miss(tmp_path: Path) -> None:
    out = run(Fault.EIO, tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    assert out.figures == {
        "writes_failed": 1,
        "fsyncs_failed": 1,
        "write_errors": 2,
        "reads_failed": 4,
        "read_errors": 4,
        "indexed_after_read_errors": 4,
        "free_slots_after": 12,
        "durable_after_restart": 4,
        "log_lines": 2,
    }


def test_the_failing_backend_raises_the_kernels_error_only_while_armed(tmp_path: Path) -> None:
    io = FailingIO()
    backend = io.backend()
    with (tmp_path / "f").open("wb") as f:
        backend.fsync(f.fileno())
        io.sync = True
        with pytest.raises(OSError) as failed:
            backend.fsync(f.fileno())
    assert failed.value.errno == errno.EIO and io.failed == 1


def test_a_damaged_index_is_refused_or_quarantined_and_the_next_start_is_clean(tmp_path: Path) -> None:
    out = run(Fault.INDEX_DAMAGED, tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    assert {k: v for k, v in out.figures.items() if k != "bytes_overwritten"} == {
        "quarantined": 1,
        "blocks_after_start": 0,
        "served_after_start": 0,
        "stored_after_start": 64,
        "quarantined_at_next_start": 0,
        "log_lines": 1,
    }


def test_truncated_slabs_lose_their_blocks_as_counted_misses(tmp_path: Path) -> None:
    out = run(Fault.SLAB_TRUNCATED, tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    assert out.figures == {
        "lost_at_start": 2,
        "lost_while_running": 3,
        "served": 59,
        "indexed_after": 59,
        "served_after_restore": 64,
    }


def test_a_read_only_mount_runs_without_the_disk_tier_and_says_so_once(tmp_path: Path) -> None:
    out = run(Fault.READ_ONLY, tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    assert out.figures == {"disk_tier_opened": 0, "stored": 64, "served": 64, "log_lines": 1}
