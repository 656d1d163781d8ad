"""Real ``kvtier serve`` backends and a real ``kvtier route`` in front of them, on free loopback ports.

Each backend has its own data directory and every process the same key
secret (copied in before they start), as a deployment would have. The
backends start together (their model loads overlap) and stop by PID.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from tests.server.live import ADMIN, ROOT, SIZES, free_port

SECRET_BYTES = 32


@dataclass
class Proc:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, timeout=120, **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        return requests.post(self.url + path, timeout=120, **kw)


def _data_dir(tmp: Path, secret: bytes) -> Path:
    data = tmp / "data"
    data.mkdir(parents=True, mode=0o700)
    fd = os.open(data / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secret)
    os.close(fd)
    return data


def _start(tmp: Path, tree: dict[str, Any], args: list[str], port: int) -> Proc:
    config = tmp / "kvtier.yaml"
    config.write_text(yaml.safe_dump(tree))
    log = tmp / "process.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "--config", str(config), *args, "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
    return Proc(f"http://127.0.0.1:{port}", process, log)


def wait_until(proc: Proc, ready: Any, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"{proc.url} exited with {proc.process.returncode}:\n{proc.log.read_text()}")
        try:
            if ready(proc):
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.url} not ready after {timeout_s}s:\n{proc.log.read_text()}")


def stop(proc: Proc) -> None:
    if proc.process.poll() is None:
        proc.process.terminate()
        try:
            proc.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.process.kill()
            proc.process.wait()


def _healthy(proc: Proc) -> bool:
    return proc.get("/health").status_code == 200


def _all_live(n: int) -> Any:
    def ready(router: Proc) -> bool:
        backends = router.get("/stats").json()["backends"]
        return sum(b["up"] and b["events_live"] for b in backends) == n

    return ready


@dataclass
class Fleet:
    router: Proc
    backends: list[Proc]

    def stats(self) -> dict[str, Any]:
        return self.router.get("/stats").json()


@contextmanager
def fleet(tmp: Path, n: int, policy: str = "kvtier", sizes: dict[str, Any] | None = None) -> Iterator[Fleet]:
    """``n`` backends (``sizes`` over the small test tiers) and a router with ``policy`` in front."""
    secret = secrets.token_bytes(SECRET_BYTES)
    tiers = {**SIZES, **(sizes or {})}
    with ExitStack() as stack:
        backends = []
        for i in range(n):
            where = tmp / f"backend{i}"
            tree = {"data_dir": str(_data_dir(where, secret)), **tiers, "server": {"admin_token": ADMIN}}
            backends.append(_start(where, tree, ["serve"], free_port()))
            stack.callback(stop, backends[-1])
        for b in backends:
            wait_until(b, _healthy)
        where = tmp / "router"
        route = {"policy": policy, "backend_token": ADMIN, "health_interval_s": 0.5}
        tree = {"data_dir": str(_data_dir(where, secret)), "engine": tiers["engine"], "route": route}
        args = ["route", *(a for b in backends for a in ("--backend", b.url))]
        router = _start(where, tree, args, free_port())
        stack.callback(stop, router)
        wait_until(router, _all_live(n))
        yield Fleet(router, backends)
