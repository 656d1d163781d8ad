"""The memory faults of the chaos run, as tests: each runs its chaos entry and checks its figures.

Which of two racing writers commits a key is up to the scheduler, so the
same-key test checks what must hold whoever wins (one copy, its bytes its
writer's, nothing served across) rather than who won.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.bench import faults_memory
from kvtier.bench.faultkit import BLOCK, LAYOUT
from kvtier.bench.faults import FAULTS, Fault
from kvtier.keys import Secret


def test_a_pinned_reader_keeps_its_bytes_while_writers_churn_ten_times_the_capacity(tmp_path: Path) -> None:
    out = FAULTS[Fault.EVICT_WHILE_READING](tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    f = out.figures
    assert (f["blocks_written"], f["capacity_blocks"]) == (640, 64)
    assert (f["pinned_blocks_intact"], f["pins_held_during"]) == (4, 4)
    assert (f["pins_after"], f["reservations_after"]) == (0, 0)
    assert f["evictions"] >= 640 - 64 and f["blocks_read_back"] > 0


def test_the_forced_collision_gives_two_prompts_every_key_and_two_digests(tmp_path: Path) -> None:
    hasher = faults_memory.colliding_hasher(tmp_path)
    honest, foreign = (faults_memory.same_key_tokens(s) for s in (faults_memory.HONEST, faults_memory.FOREIGN))
    assert not np.array_equal(honest, foreign)
    keys = hasher.keys(honest, "default")
    assert len(keys) == faults_memory.SAME_KEY_BLOCKS and keys == hasher.keys(foreign, "default")
    assert len(set(keys)) == len(keys)  # still a chain: blocks differ from each other
    assert all(a != b for a, b in zip(hasher.digests(keys, honest), hasher.digests(keys, foreign), strict=True))
    assert Secret.load_or_create(tmp_path).seed == hasher.secret.seed and LAYOUT.block_size == BLOCK


def test_64_writers_of_one_key_leave_one_copy_and_serve_nothing_across(tmp_path: Path) -> None:
    out = FAULTS[Fault.SAME_HASH_WRITERS](tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    f = out.figures
    for how in ("threads", "processes"):
        assert f[f"{how}_honest"] + f[f"{how}_foreign"] == f[f"{how}_host_blocks"] == 4  # one copy per key
        assert f[f"{how}_crossed"] == 0 and f[f"{how}_pins_after"] == 0
        assert f[f"{how}_served_honest"] + f[f"{how}_served_foreign"] >= 1
    assert f["processes_stored_by_clients"] == 4  # one client's reservation won all four slots
    assert f["threads_confirm_mismatch"] >= 1  # the losing side's lookup was a counted mismatch


def test_a_flood_against_pinned_full_host_memory_is_answered_at_once_with_flat_memory(tmp_path: Path) -> None:
    out = FAULTS[Fault.MEMORY_FLOOD](tmp_path)
    assert out.held and out.wrong_bytes_served == 0
    f = out.figures
    assert {k: v for k, v in f.items() if k != "rss_growth_bytes"} == {
        "host_blocks_pinned": 16,
        "calls": 3200,
        "stored": 0,
        "loaded": 0,
        "pins_after": 0,
        "reservations_after": 0,
        "loaded_after_release": 4,
    }
    assert f["rss_growth_bytes"] < faults_memory.RSS_BOUND
    measured_stores = 3 * 8 * 50  # the rounds after the first, where growth is measured
    assert measured_stores * 4 * LAYOUT.block_bytes > faults_memory.RSS_BOUND  # keeping refused payloads would show
