"""The machine a comparison ran on, and how much of it other work was using meanwhile.

The development VM is shared: a test suite started by someone else can take
both cores for minutes, and engines whose threads spin at barriers (OpenMP
in llama.cpp and torch) slow down far more than their share under it. So
each engine's run records the CPU time the rest of the machine used while it
ran (all CPU time in ``/proc/stat`` minus this process's and its waited-for
children's), and the orchestrator can wait for a quiet moment first.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def describe() -> dict[str, Any]:
    """CPU model (with family/model: a VM may name only the brand), cores, RAM, the ISA these kernels use."""
    info = _cpuinfo()
    model = info.get("model name")
    if model is None and shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), None)
    cpu = model or platform.processor() or "unknown"
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    flags = info.get("flags", "").split()
    mem_kib = next((int(ln.split()[1]) for ln in _read("/proc/meminfo").splitlines() if ln.startswith("MemTotal")), 0)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kib / 1024**2, 1),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "platform": platform.platform(),
    }


def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo."""
    out: dict[str, str] = {}
    for line in _read("/proc/cpuinfo").splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip()
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _system_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (None where /proc/stat is missing)."""
    first = _read("/proc/stat").split("\n", 1)[0].split()
    if not first or first[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in first[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@dataclass
class Contention:
    """Started before an engine runs; :meth:`stop` says what share of all cores other work took meanwhile."""

    wall: float = 0.0
    system: float | None = None
    own: float = 0.0

    @classmethod
    def start(cls) -> Contention:
        return cls(time.monotonic(), _system_busy_s(), _own_cpu_s())

    def stop(self) -> dict[str, float | None]:
        wall = time.monotonic() - self.wall
        system = _system_busy_s()
        if system is None or self.system is None or wall <= 0:
            return {"wall_s": round(wall, 1), "others_cpu_share": None}
        others = (system - self.system) - (_own_cpu_s() - self.own)
        return {
            "wall_s": round(wall, 1),
            "others_cpu_share": round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 3),
        }


def wait_for_quiet(max_wait_s: float, *, busy_below: float = 0.25, sample_s: float = 3.0) -> float | None:
    """Wait (at most ``max_wait_s``) until other work uses less than ``busy_below`` of the cores; the last share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        meter = Contention.start()
        time.sleep(sample_s)
        share = meter.stop()["others_cpu_share"]
        if share is None or share < busy_below or time.monotonic() >= deadline:
            return share
        print(f"bench peer: other work is using {share:.0%} of the CPUs; waiting for a quiet moment", flush=True)
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
