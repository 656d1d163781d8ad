"""The remote tier's connections: which node holds a key, and calling it without ever waiting long on it.

Standalone, there is one node. In a Redis Cluster every key lives on the
master that owns its hash slot (CRC16 of the key, mod 16384), so a batch is
split into one pipeline per node: a dead master costs exactly the blocks
whose slots it owns, while the others still hit. The slot map comes from
``CLUSTER SLOTS`` on any reachable node and is read again after a ``MOVED``
reply (resharding) or a node's network failure (a failover promotes its
replica elsewhere), at most once per :data:`REFRESH_EVERY_S`. A ``MOVED`` or
``ASK`` reply is also followed at once, one hop, so a live reshard costs no
miss.

Every node has its own circuit breaker (:class:`~kvtier.tiers.breaker.Breaker`)
and every socket operation a bounded timeout (``remote.timeout_ms``), with
redis-py's own retries off: one failed call is one counted miss, never
several waits in a row. This module is mechanism only; it never decides what
to read or write.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import AskError, MovedError, RedisError, ResponseError
from redis.retry import Retry

from kvtier.config import RemoteConfig
from kvtier.stats import RemoteStats
from kvtier.tiers.breaker import Breaker, BreakerState

log = logging.getLogger("kvtier")

SLOTS = 16384
REFRESH_EVERY_S = 1.0
NETWORK_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
"""What a call to a down, hung or unreachable node raises: a miss, and a strike against its breaker."""

T = TypeVar("T")


@dataclass(eq=False)
class Node:
    name: str  # host:port or the socket path: for logs and /stats
    client: redis.Redis
    breaker: Breaker


class Nodes:
    """One Redis (standalone) or every master of a cluster, each behind its breaker."""

    def __init__(self, config: RemoteConfig, stats: RemoteStats, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._stats = stats
        self._clock = clock
        self._lock = threading.Lock()
        self._by_addr: dict[str, Node] = {}
        self._slots: list[Node | None] = [None] * SLOTS
        self._refreshed_at = -REFRESH_EVERY_S
        self._tls = any(u.startswith("rediss://") for u in config.urls)
        if config.cluster:
            self._seeds = [self._node_for(_address(u)) for u in config.urls]
            self.refresh()
        else:
            self._single = self._make(config.urls[0], _address(config.urls[0]))

    # -- connections ----------------------------------------------------------------
    def _kwargs(self) -> dict[str, Any]:
        c = self._config
        timeout = c.timeout_ms / 1000
        return {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
            "retry_on_timeout": False,
            "health_check_interval": 0,
            "username": c.username,
            "password": c.password.get_secret_value() if c.password is not None else None,
            "client_name": "kvtier",
        }

    def _make(self, url: str, name: str) -> Node:
        client = redis.Redis.from_url(url, **self._kwargs())
        c = self._config
        breaker = Breaker(name, failures=c.breaker_failures, retry_s=c.breaker_retry_s, clock=self._clock)
        node = Node(name, client, breaker)
        self._by_addr[name] = node
        return node

    def _node_for(self, addr: str) -> Node:
        node = self._by_addr.get(addr)
        if node is None:
            scheme = "rediss" if self._tls else "redis"
            node = self._make(f"{scheme}://{addr}", addr)
        return node

    @property
    def all(self) -> list[Node]:
        with self._lock:
            return list(self._by_addr.values())

    # -- routing --------------------------------------------------------------------
    def route(self, names: Sequence[bytes]) -> dict[Node, list[int]]:
        """The positions of ``names`` each node holds; names whose slot has no known owner are left out."""
        if not self._config.cluster:
            return {self._single: list(range(len(names)))} if names else {}
        out = self._route(names)
        if any(node.breaker.state is BreakerState.OPEN for node in out):
            self.refresh()  # the node may be gone for good, a promoted replica serving its slots elsewhere
            out = self._route(names)
        return out

    def _route(self, names: Sequence[bytes]) -> dict[Node, list[int]]:
        out: dict[Node, list[int]] = {}
        with self._lock:
            for i, name in enumerate(names):
                node = self._slots[key_slot(name)]
                if node is not None:
                    out.setdefault(node, []).append(i)
        return out

    def refresh(self) -> None:
        """Read the slot map from the first node that answers ``CLUSTER SLOTS`` (at most once a second)."""
        with self._lock:
            now = self._clock()
            if now - self._refreshed_at < REFRESH_EVERY_S:
                return
            self._refreshed_at = now
            candidates = list(dict.fromkeys([*self._seeds, *self._by_addr.values()]))
        for node in candidates:
            if not node.breaker.allow():
                continue
            try:
                spans = node.client.execute_command("CLUSTER SLOTS")
            except (*NETWORK_ERRORS, ResponseError) as err:
                node.breaker.failure(err)
                continue
            node.breaker.success()
            self._install(spans)
            return
        log.warning("remote cluster: no node answered CLUSTER SLOTS; keeping the slot map as it was")

    def _install(self, spans: list[Any]) -> None:
        slots: list[Node | None] = [None] * SLOTS
        with self._lock:
            for span in spans:
                start, end, master = int(span[0]), int(span[1]), span[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                node = self._node_for(f"{host}:{int(master[1])}")
                slots[start : end + 1] = [node] * (end - start + 1)
            self._slots = slots

    # -- calling --------------------------------------------------------------------
    def call(self, node: Node, fn: Callable[[redis.Redis], T]) -> T | None:
        """``fn(node's client)``, or None (counted) when the breaker is open or the call failed on the network."""
        if not node.breaker.allow():
            self._stats.add(skipped=1)
            return None
        try:
            result = fn(node.client)
        except NETWORK_ERRORS as err:
            timed_out = isinstance(err, redis.TimeoutError)
            node.breaker.failure(err, timed_out=timed_out)
            self._stats.add(errors=1, timeouts=int(timed_out))
            if self._config.cluster:
                self.refresh()  # a failover may have moved this node's slots to a promoted replica
            return None
        except ResponseError as err:  # NOAUTH, a wrong password, OOM, CLUSTERDOWN: the node answers, but no
            node.breaker.failure(err)
            self._stats.add(errors=1)
            return None
        node.breaker.success()
        return result

    def pipeline(self, node: Node, commands: Sequence[Command]) -> list[Any] | None:
        """One round trip of ``commands`` to ``node`` (not a transaction); per-command errors come back as values.

        A ``MOVED`` or ``ASK`` reply (a slot being or just resharded) is
        followed once to the node it names (:meth:`_follow`); None for the
        whole call when the node failed (counted).
        """
        replies = self._pipeline_once(node, commands, asking=False)
        if replies is None or not self._config.cluster:
            return replies
        return self._follow(
            replies, lambda target, at, ask: self._pipeline_once(target, [commands[i] for i in at], ask)
        )

    def _pipeline_once(self, node: Node, commands: Sequence[Command], asking: bool) -> list[Any] | None:
        def run(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for command in commands:
                if asking:
                    pipe.execute_command("ASKING")
                pipe.execute_command(*command)
            replies = pipe.execute(raise_on_error=False)
            return replies[1::2] if asking else replies

        return self.call(node, run)

    def get_into(self, node: Node, names: Sequence[bytes], sink: Sink) -> list[object] | None:
        """``GET`` of ``names`` in one round trip, each value handed to ``sink`` straight off the socket.

        Why not redis-py's reply parser: it copies every value into a new
        ``bytes`` (and large pipelined replies into a growing buffer first),
        which costs as much as the network read itself for KV blocks. Here
        ``sink(i, length, reader)`` reads value ``i``'s bytes where they are
        to land (a host slot). Connections, auth, TLS and timeouts are still
        redis-py's. Per name: the sink's result, None when absent, or the
        server's error reply; a ``MOVED`` or ``ASK`` is followed once
        (:meth:`_follow`). None for the whole call when it failed (counted).
        """
        replies = self._get_into_once(node, names, sink, asking=False)
        if replies is None or not self._config.cluster:
            return replies

        def again(target: Node, at: list[int], ask: bool) -> list[object] | None:
            return self._get_into_once(target, [names[i] for i in at], lambda j, n, r: sink(at[j], n, r), ask)

        return self._follow(replies, again)

    def _get_into_once(self, node: Node, names: Sequence[bytes], sink: Sink, asking: bool) -> list[object] | None:
        def run(client: redis.Redis) -> list[object]:
            pool = client.connection_pool
            conn = pool.get_connection()
            try:
                gets = [("GET", n) for n in names]
                conn.send_packed_command(
                    conn.pack_commands([c for g in gets for c in ((("ASKING",),) if asking else ()) + (g,)])
                )
                reader = RespReader(conn._sock)  # type: ignore[attr-defined]
                out: list[object] = []
                for i in range(len(names)):
                    if asking:
                        reader.reply(_no_body)  # +OK
                    out.append(reader.reply(lambda length, i=i: sink(i, length, reader)))
                return out
            except BaseException:
                conn.disconnect()  # whatever was left unread would desynchronise the next caller
                raise
            finally:
                pool.release(conn)

        return self.call(node, run)

    def _follow(self, replies: list[Any], again: Callable[[Node, list[int], bool], list[Any] | None]) -> list[Any]:
        """Replace each ``MOVED``/``ASK`` reply with the reply of the node it names, asked once.

        ``MOVED``: the slot has a new owner for good, so the slot map is read
        again too (at most once a second) and later calls go there directly.
        ``ASK``: the slot is being migrated and this key already left; the
        target serves it only behind ``ASKING``, and the map must not change
        until the migration ends. A second redirect is left as the reply (a
        miss): a map that moves under every call is not worth chasing.
        """
        hops: dict[tuple[str, Redirect], list[int]] = {}
        for i, reply in enumerate(replies):
            hop = redirect_of(reply)
            if hop is not None:
                hops.setdefault(hop, []).append(i)
        if not hops:
            return replies
        self._stats.add(redirects=sum(len(at) for at in hops.values()))
        if any(kind is Redirect.MOVED for _, kind in hops):
            self.refresh()
        for (addr, kind), at in hops.items():
            with self._lock:
                target = self._node_for(addr)
            got = again(target, at, kind is Redirect.ASK)
            if got is not None:
                for i, reply in zip(at, got, strict=True):
                    replies[i] = reply
        return replies

    def breakers(self) -> dict[str, str]:
        return {node.name: node.breaker.state.value for node in self.all}

    def close(self) -> None:
        for node in self.all:
            with contextlib.suppress(RedisError):
                node.client.close()


Command = tuple[str | bytes | int, ...]
"""One Redis command and its arguments, as sent (``("SET", name, value, "PX", ttl)``)."""

Sink = Callable[[int, int, "RespReader"], object]
"""``(position, value length, reader) -> result``: must consume exactly ``length`` bytes from the reader."""


class ProtocolError(redis.ConnectionError):
    """A reply that is not RESP: the connection is dropped (a network error, for the breaker)."""


LINE_READ = 256
"""Bytes asked of the socket while a reply's first line is sought. Small on purpose: whatever else arrives
with the line is staged in the buffer and copied again, so the bulk body after it is left in the socket, to
be read straight into its destination. (A larger read saves one system call per value and copies the
start of every value twice.)"""


class RespReader:
    """RESP replies read off a socket: lines through a small buffer, bulk bodies into the caller's memory."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()

    def _fill(self) -> None:
        chunk = self._sock.recv(LINE_READ)
        if not chunk:
            raise redis.ConnectionError("connection closed by the server")
        self._buf += chunk

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._buf[:end])
        del self._buf[: end + 2]
        return line

    def read_into(self, view: memoryview) -> None:
        """Exactly ``len(view)`` bytes into ``view``: what is buffered, then straight from the socket."""
        take = min(len(view), len(self._buf))
        view[:take] = self._buf[:take]
        del self._buf[:take]
        while take < len(view):
            got = self._sock.recv_into(view[take:])
            if not got:
                raise redis.ConnectionError("connection closed by the server")
            take += got

    def skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n > 0:
            step = min(n, len(scratch))
            self.read_into(scratch[:step])
            n -= step

    def reply(self, bulk: Callable[[int], object]) -> object:
        """One reply: ``bulk(length)`` for a bulk string (then its CRLF), None for nil, an error reply as a value."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            if not rest.lstrip(b"-").isdigit():
                raise ProtocolError(f"bad bulk length in reply to GET: {line[:40]!r}")
            length = int(rest)
            if length < 0:
                return None
            result = bulk(length)
            self.skip(2)
            return result
        if kind == b"-":
            return _error(rest.decode(errors="replace"))
        if kind == b"+":  # ASKING's OK
            return rest
        raise ProtocolError(f"unexpected reply to GET: {line[:40]!r}")


class Redirect(enum.Enum):
    """A cluster node's answer that a key's slot lives elsewhere."""

    MOVED = "moved"  # for good: the slot map is stale
    ASK = "ask"  # for this key only, while its slot migrates


def _error(message: str) -> ResponseError:
    """An error reply as redis-py's parser would type it, so redirects read the same from both readers."""
    code, _, rest = message.partition(" ")
    kinds = {"MOVED": MovedError, "ASK": AskError}
    if code not in kinds:
        return ResponseError(message)
    try:
        return kinds[code](rest)
    except ValueError as err:  # not "<slot> <host>:<port>"
        raise ProtocolError(f"malformed {code} reply: {message[:60]!r}") from err


def redirect_of(reply: object) -> tuple[str, Redirect] | None:
    """The ``host:port`` and kind of a ``MOVED``/``ASK`` reply; None for any other reply."""
    if not isinstance(reply, AskError):  # MovedError is an AskError too
        return None
    host, port = reply.node_addr
    return f"{host}:{port}", Redirect.MOVED if isinstance(reply, MovedError) else Redirect.ASK


def _no_body(length: int) -> object:
    raise ProtocolError(f"a bulk reply of {length} B where OK was expected")


def _address(url: str) -> str:
    parsed = urlparse(url)
    return parsed.path if parsed.scheme == "unix" else parsed.netloc.rpartition("@")[2]


def is_error(reply: object) -> bool:
    """A per-command error inside a pipeline's replies (``execute(raise_on_error=False)``)."""
    return isinstance(reply, Exception)


__all__ = ["NETWORK_ERRORS", "Node", "Nodes", "is_error"]
