"""The processes a benchmark or a test starts: a free loopback port for one, and a stop that ends it by its PID.

Every bench and live test starts servers (kvtier serve, the cache service,
redis-server) on 127.0.0.1 and must end exactly what it started, even when the
process ignores SIGTERM, so the stop escalates to SIGKILL after a bound.
"""

from __future__ import annotations

import socket
import subprocess
from typing import Any


def free_port() -> int:
    """A loopback port nobody listens on now (the kernel's pick; a race with another binder is the caller's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(process: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL past ``timeout`` seconds: this process and nothing else, by its PID."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
