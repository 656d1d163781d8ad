"""A killed cache service's shared-memory slab is reclaimed by the next service to start; a live one's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvtier.bench.faultkit import FINGERPRINT, LAYOUT, toy_config
from kvtier.service import CacheService

_SERVICE = """
import sys
from pathlib import Path
from kvtier.bench.faultkit import FINGERPRINT, LAYOUT, toy_config
from kvtier.service import CacheService
tmp = Path(sys.argv[1])
svc = CacheService(toy_config(tmp, host_blocks=4), LAYOUT, model_fingerprint=FINGERPRINT,
                   socket_path=tmp / "killed.sock", slab_dir=tmp)
print(svc.slab_path, flush=True)
sys.stdin.read()
"""


def _service(tmp: Path, name: str) -> CacheService:
    cfg = toy_config(tmp, host_blocks=4)
    return CacheService(cfg, LAYOUT, model_fingerprint=FINGERPRINT, socket_path=tmp / f"{name}.sock", slab_dir=tmp)


def test_the_slab_of_a_killed_service_is_reclaimed_when_the_next_one_starts(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _SERVICE, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    killed_slab = Path(child.stdout.readline().strip())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert killed_slab.exists()  # nobody was left to delete it
    svc = _service(tmp_path, "next")
    try:
        assert not killed_slab.exists() and not killed_slab.with_suffix(".lock").exists()
        assert svc.slab_path.exists()
    finally:
        svc.close()
    assert sorted(p.name for p in tmp_path.glob("kvtier-*")) == []


def test_a_live_services_slab_is_kept(tmp_path: Path) -> None:
    first = _service(tmp_path, "first")
    try:
        second = _service(tmp_path, "second")
        second.close()
        assert first.slab_path.exists()
    finally:
        first.close()
