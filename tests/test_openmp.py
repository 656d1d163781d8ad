"""kvtier loads torch with libgomp's idle workers asleep, and leaves the environment as it found it.

Each case is a fresh interpreter: libgomp reads its settings once, when torch
loads it. ``OMP_DISPLAY_ENV=VERBOSE`` makes libgomp print what it read,
including the spin count its idle workers use (0 when passive).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPORT = "import json, os, kvtier.openmp as o; print(json.dumps([o.wait_policy, os.environ.get('OMP_WAIT_POLICY')]))"


def _run(code: str, **env: str) -> tuple[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "", done.stderr


def _spin_count(stderr: str) -> int:
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", stderr)
    if found is None:
        pytest.skip("torch's OpenMP runtime here is not libgomp: it does not report its spin count")
    return int(found.group(1))


def test_kvtier_first_loads_torch_passive_and_restores_the_environment() -> None:
    out, err = _run(f"import kvtier; {REPORT}")
    assert _spin_count(err) == 0
    assert out == '["PASSIVE", null]'  # what libgomp got; and nothing left behind for child processes


def test_torch_first_keeps_its_defaults() -> None:
    out, err = _run(f"import torch, kvtier; {REPORT}")
    assert _spin_count(err) > 0
    assert out == "[null, null]"


@pytest.mark.parametrize(("name", "value"), [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "1000")])
def test_a_process_that_chose_keeps_its_choice(name: str, value: str) -> None:
    out, err = _run(f"import kvtier; {REPORT}", **{name: value})
    assert _spin_count(err) > 0
    expected = f'["{value}", "{value}"]' if name == "OMP_WAIT_POLICY" else "[null, null]"
    assert out == expected
