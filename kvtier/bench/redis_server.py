"""A throwaway ``redis-server`` (or a three-master cluster of them) on loopback, for benchmarks and tests.

Each server runs on a free 127.0.0.1 port in a temporary directory that is
removed with it, persists nothing (``--save "" --appendonly no``), and is
stopped by its own PID. "Ready" means it answered PING (a cluster: every
node reports ``cluster_state:ok``): callers wait on that event, with a
bounded number of tries, instead of sleeping a guessed time.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

READY_TRIES = 400  # connection attempts before a server counts as failed to start
TRY_WAIT_S = 0.025  # between attempts, spent waiting on the process's exit (a crash shows at once)
CLUSTER_BUS_OFFSET = 10_000  # Redis cluster's bus port is the client port + 10000


class RedisStartError(RuntimeError):
    pass


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RedisStartError("redis-server is not installed (make setup installs it: apt-get install redis-server)")
    return path


def free_port(*, bus: bool = False) -> int:
    """A loopback port nobody listens on (and, ``bus``, whose cluster bus port is free too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + CLUSTER_BUS_OFFSET < 65536 and _port_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RedisStartError("no free loopback port pair for a cluster node")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ping(port: int) -> bytes | None:
    """One PING over a fresh connection: the reply's first line, or None when nothing answers yet."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).split(b"\r\n", 1)[0]
    except OSError:
        return None


def _command(port: int, *args: str) -> str:
    """One command through redis-cli (cluster set-up and checks only), its stdout."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RedisStartError("redis-cli is not installed (it comes with redis-server)")
    done = subprocess.run([cli, "-p", str(port), *args], capture_output=True, text=True, timeout=30, check=False)
    return done.stdout


@dataclass
class RedisServer:
    """One redis-server process; :meth:`kill` and :meth:`restart` let tests take it down and bring it back."""

    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    own_dir: bool = True

    @classmethod
    def start(cls, *extra: str, cluster: bool = False, workdir: Path | None = None) -> RedisServer:
        port = free_port(bus=cluster)
        own = workdir is None
        base = Path(tempfile.mkdtemp(prefix="kvtier-redis-")) if workdir is None else workdir
        base.mkdir(parents=True, exist_ok=True)
        flags = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf") if cluster else ()
        server = cls(port, base, (*flags, *extra), own_dir=own)
        try:
            server.restart()
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def restart(self) -> None:
        """Start the process (again, on the same port) and wait until it answers PING.

        A process still running is ended first: a second redis-server on the
        port would fail to bind while the old one answered the PING, leaving
        the old one untracked (a later ``kill`` would miss it) and not empty.
        """
        self._end()
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log"), *self.extra]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(READY_TRIES):
            reply = _ping(self.port)
            if reply is not None and reply[:1] in (b"+", b"-"):  # PONG, or NOAUTH from a server with a password
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(TRY_WAIT_S)
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RedisStartError(f"redis-server exited with {self.proc.returncode}: {err.strip()}")
        raise RedisStartError(f"redis-server on port {self.port} did not answer PING")

    def kill(self) -> None:
        """SIGKILL, the way a crashed or partitioned node looks to its clients; the port is free once it returns."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _end(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()

    def stop(self) -> None:
        self._end()
        if self.own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class RedisCluster:
    """Masters (three by default) and, when asked, replicas: without replicas every hash slot has exactly one
    home, so one kill loses exactly its slots; with them a replica can be promoted in its master's place."""

    nodes: list[RedisServer]

    @classmethod
    def start(cls, masters: int = 3, replicas: int = 0, extra: tuple[str, ...] = ()) -> RedisCluster:
        """``replicas`` per master; ``extra``: more redis-server flags for every node."""
        cluster = cls([])
        try:
            for _ in range(masters * (1 + replicas)):
                cluster.nodes.append(RedisServer.start(*extra, cluster=True))
            addrs = [f"127.0.0.1:{n.port}" for n in cluster.nodes]
            create = ("--cluster", "create", *addrs, "--cluster-replicas", str(replicas), "--cluster-yes")
            _command(cluster.nodes[0].port, *create)
            cluster.wait_ok()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def wait_ok(self) -> None:
        """Until every node says ``cluster_state:ok`` (slots assigned and gossip converged), bounded."""
        for node in self.nodes:
            for _ in range(READY_TRIES):
                if "cluster_state:ok" in _command(node.port, "cluster", "info"):
                    break
                assert node.proc is not None
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(TRY_WAIT_S)
            else:
                raise RedisStartError(f"cluster node {node.port} never reached cluster_state:ok")

    def node_of(self, key: bytes) -> RedisServer:
        """The master that owns ``key``'s hash slot."""
        return self.owner(int(_command(self.nodes[0].port, "cluster", "keyslot", key.decode("latin-1")).strip()))

    def owner(self, slot: int) -> RedisServer:
        """The master that says it owns ``slot`` (in its own ``CLUSTER NODES`` line)."""
        for node in self.live():
            if slot in self.slots_of(node):
                return node
        raise LookupError(f"no node owns slot {slot}")

    def slots_of(self, node: RedisServer) -> set[int]:
        """The slots ``node`` says it owns (none for a replica)."""
        own: set[int] = set()
        for line in _command(node.port, "cluster", "nodes").splitlines():
            parts = line.split()
            if len(parts) > 2 and "myself" in parts[2]:
                for span in parts[8:]:
                    lo, _, hi = span.partition("-")
                    if lo.isdigit():
                        own.update(range(int(lo), int(hi or lo) + 1))
        return own

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def node_id(self, node: RedisServer) -> str:
        return _command(node.port, "cluster", "myid").strip()

    def replica_of(self, master: RedisServer) -> RedisServer:
        """A live replica of ``master`` (its own ``CLUSTER NODES`` line says ``slave`` of the master's id)."""
        master_id = self.node_id(master)
        for node in self.live():
            mine = [ln.split() for ln in _command(node.port, "cluster", "nodes").splitlines() if "myself" in ln]
            if node is not master and mine and "slave" in mine[0][2] and mine[0][3] == master_id:
                return node
        raise LookupError(f"no live replica of {master.port}")

    def wait_until(self, check: Callable[[], bool], what: str) -> None:
        """Until ``check()`` holds, bounded: between tries, waits on a live node's exit (a crash shows at once)."""
        for _ in range(READY_TRIES):
            if check():
                return
            live = self.live()
            if not live:
                break
            assert live[0].proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                live[0].proc.wait(TRY_WAIT_S)
        raise RedisStartError(f"the cluster never reached: {what}")

    def command(self, node: RedisServer, *args: str) -> str:
        """One command to ``node`` through redis-cli (cluster changes in tests: resharding, failover)."""
        return _command(node.port, *args)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def redis_or_url(url: str | None) -> Iterator[str]:
    """``url`` as given, or a fresh throwaway server's for the duration."""
    if url is not None:
        yield url
        return
    with RedisServer.start() as server:
        yield server.url


__all__ = ["RedisCluster", "RedisServer", "RedisStartError", "free_port", "redis_or_url"]
