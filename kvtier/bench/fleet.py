"""Several ``kvtier serve`` backends and a ``kvtier route`` in front, as subprocesses on free loopback ports.

Each backend gets its own data directory; every process gets the same key
secret (written into each data directory before it starts), as a deployment
shares one. Processes stop by PID: SIGTERM, then SIGKILL.

:class:`Proc` is the one handle on a live ``kvtier`` process that every
bench and live test holds (the soak, the process faults, the server and
router tests): its URL, its process, its log.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import requests
import yaml

from kvtier.bench import procs
from kvtier.keys import SECRET_BYTES, SECRET_FILE

READY_TIMEOUT_S = 300


@dataclass
class Proc:
    url: str
    process: subprocess.Popen[Any]
    log: Path
    lines: list[str] = field(default_factory=list)  # its output so far, when started with ``watch``

    @property
    def port(self) -> int:
        return urlsplit(self.url).port or 0

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, timeout=120, **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        return requests.post(self.url + path, timeout=120, **kw)

    def stats(self) -> dict[str, Any]:
        reply = self.get("/stats")
        reply.raise_for_status()
        return reply.json()

    def wait_for_line(self, text: str) -> None:
        """Read the output of a process started with ``watch`` until a line holds ``text``; then keep draining it.

        A server's own ready line, read as it is written: no polling. Every
        line also goes to :attr:`log`, and to :attr:`lines`.
        """
        if not self._read(text):
            raise RuntimeError(f"{self.url} exited before saying {text!r}:\n" + "\n".join(self.lines[-20:]))
        threading.Thread(target=self._read, args=(None,), daemon=True).start()  # a full pipe would block it

    def _read(self, until: str | None) -> bool:
        assert self.process.stdout is not None, "started without watch"
        with self.log.open("a") as out:
            for line in self.process.stdout:
                self.lines.append(line.rstrip("\n"))
                out.write(line)
                out.flush()
                if until is not None and until in line:
                    return True
        return False

    def stop(self, timeout: float = 30.0) -> None:
        procs.stop(self.process, timeout)


def data_dir(where: Path, secret: bytes) -> Path:
    data = where / "data"
    data.mkdir(parents=True, mode=0o700, exist_ok=True)
    fd = os.open(data / SECRET_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    return data


def start(
    where: Path,
    tree: dict[str, Any],
    args: list[str],
    env: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
    watch: bool = False,
    port: int | None = None,
) -> Proc:
    """``kvtier --config <tree> <args> --port <free>`` in ``where``, its output in ``where/process.log``.

    ``cwd``: the directory it runs in (``python -m`` puts it first on
    ``sys.path``: another checkout's kvtier). ``watch``: its output comes
    through a pipe, for :meth:`Proc.wait_for_line`. ``port``: this one, not a
    free one (a restart at the same address).
    """
    where.mkdir(parents=True, exist_ok=True)
    config = where / "kvtier.yaml"
    config.write_text(yaml.safe_dump(tree))
    port = port or procs.free_port()
    log = where / "process.log"
    cmd = [sys.executable, "-m", "kvtier.cli", "--config", str(config), *args, "--port", str(port)]
    with log.open("ab") as out:
        process = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE if watch else out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=cwd,
            text=watch,
        )
    return Proc(f"http://127.0.0.1:{port}", process, log)


def wait_until(proc: Proc, ready: Callable[[Proc], bool], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll ``ready`` until true; a process that exits meanwhile is an error carrying its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.process.poll() is not None:
            raise RuntimeError(f"{proc.url} exited with {proc.process.returncode}:\n{proc.log.read_text()[-4000:]}")
        try:
            if ready(proc):
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)  # a process loading its model: there is nothing to wait on but its port
    raise RuntimeError(f"{proc.url} not ready after {timeout_s}s:\n{proc.log.read_text()[-4000:]}")


def healthy(proc: Proc) -> bool:
    return proc.get("/health").status_code == 200


def all_live(n: int) -> Callable[[Proc], bool]:
    """A router is ready once ``n`` backends are up and their block events keep its index."""

    def ready(router: Proc) -> bool:
        backends = router.get("/stats").json()["backends"]
        return sum(b["up"] and b["events_live"] for b in backends) == n

    return ready


@dataclass
class Backends:
    procs: list[Proc]
    secret: bytes
    admin: str
    trees: list[dict[str, Any]] = field(default_factory=list)  # each one's config, for a restart
    env: dict[str, str] | None = None

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    def kv_events(self) -> dict[str, dict[str, str]]:
        """Backend URL -> its vLLM-format KV event sockets, for ``route.kv_events`` (those started with them)."""
        return {p.url: tree["kv_events"] for p, tree in zip(self.procs, self.trees, strict=True) if "kv_events" in tree}

    def restart(self, i: int) -> Proc:
        """Stop backend ``i`` (SIGTERM) and start it again: same data directory, config, port and event sockets."""
        old = self.procs[i]
        old.stop()
        self.procs[i] = start(old.log.parent, self.trees[i], ["serve"], self.env, port=old.port)
        wait_until(self.procs[i], healthy)
        return self.procs[i]

    def clear(self) -> None:
        """Every tier of every backend emptied: each policy starts from cold caches."""
        for proc in self.procs:
            if proc.process.poll() is None:
                proc.post("/admin/clear", headers={"Authorization": f"Bearer {self.admin}"}).raise_for_status()


def _event_sockets() -> dict[str, str]:
    return {f"{name}endpoint": f"tcp://127.0.0.1:{procs.free_port()}" for name in ("", "replay_")}


@contextmanager
def backends(
    tmp: Path, n: int, tiers: dict[str, Any], admin: str, env: dict[str, str] | None = None, *, events: bool = False
) -> Iterator[Backends]:
    """``n`` backends with the config sections ``tiers``, started together (their model loads overlap).

    ``events``: each publishes its KV events in vLLM's format on loopback ports of its own (``kv_events``),
    which :func:`router` then follows instead of the HTTP streams.
    """
    secret = secrets.token_bytes(SECRET_BYTES)
    with ExitStack() as stack:
        fleet = Backends([], secret, admin, env=env)
        for i in range(n):
            where = tmp / f"backend{i}"
            tree = {"data_dir": str(data_dir(where, secret)), **tiers, "server": {"admin_token": admin}}
            if events:
                tree["kv_events"] = _event_sockets()
            fleet.trees.append(tree)
            fleet.procs.append(start(where, tree, ["serve"], env))
            stack.callback(lambda i=i: fleet.procs[i].stop())  # the one running then: a restart replaces it
        for proc in fleet.procs:
            wait_until(proc, healthy)
        yield fleet


@contextmanager
def router(tmp: Path, fleet: Backends, engine: dict[str, Any], route: dict[str, Any]) -> Iterator[Proc]:
    """A ``kvtier route`` over ``fleet`` with the ``route`` section, ready once every backend's events are live."""
    tree = {
        "data_dir": str(data_dir(tmp, fleet.secret)),
        "engine": engine,
        "route": {"backend_token": fleet.admin, "kv_events": fleet.kv_events(), **route},
    }
    args = ["route", *(a for url in fleet.urls for a in ("--backend", url))]
    proc = start(tmp, tree, args)
    try:
        wait_until(proc, all_live(len(fleet.urls)))
        yield proc
    finally:
        proc.stop()
