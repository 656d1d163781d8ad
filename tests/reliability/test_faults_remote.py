"""The remote tier's chaos fault as a test: a real redis-server killed while a node loads from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench import faults_remote
from kvtier.bench.faults import FAULTS, Fault, FaultSkipped


def test_redis_killed_under_load_costs_misses_and_opens_the_breaker_once(tmp_path: Path) -> None:
    assert FAULTS[Fault.REMOTE_DOWN] is faults_remote.remote_down  # registered by importing its module
    try:
        out = FAULTS[Fault.REMOTE_DOWN](tmp_path)
    except FaultSkipped as why:
        pytest.skip(str(why))
    assert out.held and out.wrong_bytes_served == 0
    f = out.figures
    assert (f["served_before_kill"], f["lookups_after_kill"], f["breaker_opens"]) == (32, 32, 1)
    assert 1 <= f["remote_errors_after_kill"] <= 4  # the breaker's 2, plus a call per reader in flight at most
    assert f["served_after_kill"] == 2 * 2 * f["prompts_still_local"]  # two passes over what host memory kept
