"""The node-local cache service: one :class:`CacheManager` that every engine process on the machine shares.

Engines restart often and run as several processes (vLLM's scheduler and
workers, several instances per node); a cache inside one of them dies with
it and cannot be shared. The service owns the host, disk (and later remote)
tiers; clients speak :mod:`kvtier.service.protocol` over a Unix socket.

Trust: the socket is created mode 0600 and every connection's peer uid
(``SO_PEERCRED``) must be the service's own (or one listed in
``allowed_uids``), so another local user can neither read cached prompts'
KV nor poison them. The slab file is 0600 too. With ``service.socket_group``
the socket and slab are 0660 in that group, and its members (primary or
supplementary, checked at connect) are admitted as well.

Leases: a client's pins (loads) and reservations (stores) belong to its
connection. When the connection ends, for whatever reason (a clean close, a
crash, SIGKILL), every pin is released and every reservation given back, so
a dead client can leak nothing. A reservation a live client leaves
uncommitted for ``reservation_ttl_s`` is withdrawn: its keys may be stored
by others, its late commit is refused, but its slots stay withheld until the
connection ends. The client maps the slab and may still be writing into
them (a stalled fill finishing late); handed to another store, those bytes
would change a block someone committed. The client's side of the bargain
(:class:`~kvtier.service.client.CacheClient`): it never ends a connection
while one of its fills or loads still uses that connection's slots. Each
connection is served by its own thread; the manager is thread-safe.
"""

from __future__ import annotations

import contextlib
import grp
import itertools
import logging
import os
import pwd
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import numpy as np

from kvtier.config import Config
from kvtier.errors import KVTierError, warn_once
from kvtier.events import HeldKeys
from kvtier.fetch import LoadHandle
from kvtier.index import LookupResult
from kvtier.keys import KeyedTokens, KeyHasher
from kvtier.layout import KVLayout
from kvtier.manager import CacheManager, StorePlan
from kvtier.publisher import EventPublisher
from kvtier.service import protocol as p
from kvtier.service import slabs
from kvtier.service.protocol import to_wire
from kvtier.sessions import SessionRegistry
from kvtier.tiers import native
from kvtier.tiers.base import TierKind

log = logging.getLogger(__name__)

_PEERCRED = struct.Struct("3i")  # pid, uid, gid
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing this long holds no thread longer


def default_slab_dir() -> Path:
    """Shared memory where the system has it (pages never touch a disk), else the temp directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def peer_cred(conn: socket.socket) -> tuple[int, int]:
    """The connecting process's (uid, gid), as the kernel saw them at ``connect``."""
    _, uid, gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid, gid


def group_id(group: str | int) -> int:
    """A group's id from its name or number (``service.socket_group``); an unknown name is a one-line error."""
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise KVTierError(f"service.socket_group: no group named {group!r} on this machine") from None


def in_group(uid: int, gid: int, group: int) -> bool:
    """Whether a peer with this uid and primary gid belongs to ``group`` (primary or supplementary)."""
    if gid == group:
        return True
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    return group in os.getgrouplist(user.pw_name, user.pw_gid)


class _Connection:
    """One client connection and the leases it holds."""

    def __init__(self, service: CacheService, conn: socket.socket) -> None:
        self.service = service
        self.conn = conn
        self.loads: dict[int, LoadHandle] = {}
        self.stores: dict[int, tuple[StorePlan, float]] = {}  # lease -> (plan, expiry on the service's clock)
        self.withheld: list[int] = []  # slots of expired reservations, this client's to write until it leaves
        self.lock = threading.Lock()  # stores are also reaped by the service's expiry thread

    def run(self) -> None:
        try:
            if self._handshake():
                while True:
                    p.send(self.conn, self._reply())
        except (p.ProtocolError, OSError) as err:
            log.debug("cache client left: %s", err)
        finally:
            self._reclaim()
            self.conn.close()
            self.service._forget(self)

    def _reply(self) -> p.Reply:
        """The answer to the next request; one the protocol cannot take is refused in one line, never the end."""
        try:
            msg = p.recv_request(self.conn)
        except p.InvalidRequest as err:
            return p.Failure(f"refused: {err}")
        try:
            return self._answer(msg)
        except p.InvalidRequest as err:
            return p.Failure(f"{type(msg).__name__} refused: {err}")

    def _handshake(self) -> bool:
        """Who, and for which model; a connection silent past ``HELLO_TIMEOUT_S`` ends (OSError: timed out)."""
        self.conn.settimeout(HELLO_TIMEOUT_S)
        uid, gid = peer_cred(self.conn)
        if not self.service.admits(uid, gid):
            group = "" if self.service.socket_group is None else f", members of group {self.service.socket_group}"
            p.send(
                self.conn,
                p.Refused(f"uid {uid} may not use this cache service (allowed: {self.service.allowed_uids}{group})"),
            )
            return False
        try:
            hello = p.recv_request(self.conn)
        except p.InvalidRequest as err:
            p.send(self.conn, p.Refused(f"the first message must be Hello: {err}"))
            return False
        if not isinstance(hello, p.Hello):
            p.send(self.conn, p.Refused(f"the first message must be Hello, not {type(hello).__name__}"))
            return False
        problem = self.service.mismatch(hello)
        if problem:
            p.send(self.conn, p.Refused(problem))
            return False
        p.send(self.conn, self.service.welcome())
        self.conn.settimeout(None)  # an admitted engine may stay idle between its requests
        return True

    def _answer(self, msg: p.Request) -> p.Reply:
        m = self.service.manager
        match msg:
            case p.Lookup():
                prompt = m.keyed(_tokens(msg.tokens), msg.namespace)
                r = m.lookup(prompt, first_block=_within(msg.first_block, prompt))
                return _lookup_reply(r)
            case p.Load():
                return self._load(msg)
            case p.Release():
                handle = self.loads.pop(msg.lease, None)
                if handle is not None:
                    handle.release()
                return p.Done()
            case p.Reserve():
                return self._reserve(msg)
            case p.Commit():
                with self.lock:
                    plan, _ = self.stores.pop(msg.lease, (None, 0.0))
                if plan is None:
                    return p.Failure(f"no reservation {msg.lease} (expired, or never made)")
                if msg.success and [native.BACKEND.crc32c(b.numpy()) for b in plan.buffers] != msg.crc32c:
                    m.complete_store(plan, success=False)
                    return p.Failure("the stored bytes do not match their checksums; nothing was published")
                return p.Committed(m.complete_store(plan, msg.success))
            case p.Probe():
                r = m.probe(m.keyed(_tokens(msg.tokens), msg.namespace))
                return _lookup_reply(r)
            case p.Pin():
                prompt = m.keyed(_tokens(msg.tokens), msg.namespace)
                return p.Count(m.pin_for(prompt, msg.ttl_s, tier=to_wire(TierKind, msg.tier)))
            case p.Clear():
                return p.Count(m.clear(None if msg.tier is None else to_wire(TierKind, msg.tier), msg.namespace))
            case p.Stats():
                return p.StatsReply(msgspec.structs.replace(m.stats(), ttl_pinned_blocks=m.ttl_pinned()))
            case p.NamedExists():
                return p.Present(m.named_exists(msg.names, msg.namespace))
            case p.NamedLoad():
                return self._hold(m.named_load(msg.names, msg.namespace), 0)
            case p.NamedReserve():
                return self._hold_plan(m.prepare_named_store(msg.names, msg.namespace))
            case p.SessionTurn():
                self.service.session_turn(msg.namespace, msg.session_id, _tokens(msg.tokens))
                return p.Done()
            case p.SessionPrefetch():
                return self.service.session_prefetch(msg.namespace, msg.session_id, _tokens(msg.tokens))
            case p.Explain():
                return self._explain(msg)
        return p.Failure(f"{type(msg).__name__} is not asked again after the handshake")

    def _explain(self, msg: p.Explain) -> p.Explained:
        m = self.service.manager
        prompt = m.keyed(_tokens(msg.tokens), msg.namespace)
        why = m.explain(prompt, own_namespaces=msg.own_namespaces, diverged_at=msg.diverged_at)
        r, evicted = why.result, why.eviction
        return p.Explained(
            r.cached_blocks,
            p.all_to(p.Tier, r.tiers),
            to_wire(p.Miss, r.miss_reason),
            to_wire(p.Why, why.reason),
            why.first_miss_token,
            None if evicted is None else to_wire(p.Tier, evicted.tier),
            None if evicted is None else to_wire(p.Policy, evicted.policy),
            why.eviction_age_s,
            why.other_namespace,
        )

    def _load(self, msg: p.Load) -> p.Reply:
        """Pin what the client's :class:`~kvtier.service.protocol.Lookup` found: counted there, not again here."""
        m = self.service.manager
        prompt = m.keyed(_tokens(msg.tokens), msg.namespace)
        result = m.probe(prompt, first_block=_within(msg.start, prompt))
        fetch = m.fetch(result, start=msg.start, max_blocks=msg.max_blocks, deadline_s=msg.deadline_s)
        return self._hold(fetch.take(), msg.start)

    def _hold(self, handle: LoadHandle, first_block: int) -> p.Loaded:
        """Keep a load's pins under a new lease of this connection; say where its blocks are."""
        lease = self.service.lease()
        self.loads[lease] = handle
        offsets = [self.service.manager.host.offset(b) for b in handle.blocks]
        return p.Loaded(lease, first_block, offsets, p.all_to(p.Tier, handle.served_from))

    def _reserve(self, msg: p.Reserve) -> p.Reply:
        m = self.service.manager
        prompt = m.keyed(_tokens(msg.tokens), msg.namespace)
        plan = m.prepare_store(prompt, first_block=_within(msg.first_block, prompt), num_blocks=msg.num_blocks)
        return self._hold_plan(plan)

    def _hold_plan(self, plan: StorePlan) -> p.Reserved:
        """Keep a reservation under a new lease of this connection, until its commit or its expiry."""
        m = self.service.manager
        lease = self.service.lease()
        with self.lock:
            self.stores[lease] = (plan, self.service.clock() + self.service.reservation_ttl_s)
        offsets = [m.host.offset(b) for b in plan.buffers]
        return p.Reserved(lease, plan.block_indices, offsets, plan.already_cached, plan.next_block)

    def _reclaim(self) -> None:
        """The connection is over: nothing it pinned or reserved may outlive it."""
        for handle in self.loads.values():
            handle.release()
        with self.lock:
            plans, self.stores = [plan for plan, _ in self.stores.values()], {}
            withheld, self.withheld = self.withheld, []
        for plan in plans:
            self.service.manager.complete_store(plan, success=False)
        self.service.manager.release_withheld(withheld)  # no write of this client can land any more
        if self.loads or plans:
            log.info("reclaimed %d loads and %d reservations of a departed client", len(self.loads), len(plans))
        self.loads.clear()

    def expire(self, now: float) -> int:
        """Withdraw the reservations past their expiry (their slots withheld from others); how many."""
        with self.lock:
            late = [lease for lease, (_, until) in self.stores.items() if until <= now]
            plans = [self.stores.pop(lease)[0] for lease in late]
            for plan in plans:
                self.withheld += self.service.manager.withdraw_store(plan)
        return len(plans)


class ServiceRunningError(KVTierError):
    """Another cache service answers on the socket path: taking it over would cut its clients off."""


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _lookup_reply(r: LookupResult) -> p.LookupReply:
    return p.LookupReply(r.cached_blocks, p.all_to(p.Tier, r.tiers), to_wire(p.Miss, r.miss_reason))


def _tokens(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise p.InvalidRequest(f"tokens are {len(raw)} bytes, not whole little-endian int32s")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def _within(first_block: int, prompt: KeyedTokens) -> int:
    """A block index the prompt has (its end included: everything held already)."""
    if first_block > prompt.num_blocks:
        raise p.InvalidRequest(f"block {first_block} is past the prompt's {prompt.num_blocks} full blocks")
    return first_block


class CacheService:
    """Listens on ``socket_path``; :meth:`serve_forever` until :meth:`close`."""

    def __init__(
        self,
        config: Config,
        layout: KVLayout,
        *,
        model_fingerprint: str,
        socket_path: Path,
        allowed_uids: Iterable[int] = (),
        slab_dir: Path | None = None,
        reservation_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        socket_group: int | None = None,
        hasher: KeyHasher | None = None,
    ) -> None:
        """``socket_group``: a gid whose members may connect too; the socket and slab are then 0660 in that group.

        ``hasher``: the manager's key hasher (tests pass a colliding one; None: the deployment's).
        """
        self.layout = layout
        self.socket_group = socket_group
        self.model_fingerprint = model_fingerprint
        self.allowed_uids = sorted({os.getuid(), *allowed_uids})
        self.reservation_ttl_s = reservation_ttl_s
        self.max_clients = config.service.max_clients
        self.clock = clock
        self.socket_path = Path(socket_path)
        if not self.socket_path.parent.is_dir():
            raise KVTierError(f"the cache service's socket directory {self.socket_path.parent} does not exist")
        if _answers(self.socket_path):
            raise ServiceRunningError(f"a cache service already answers at {self.socket_path}: stop it, or use another")
        shm = slab_dir or default_slab_dir()
        if reclaimed := slabs.reclaim(shm):
            log.warning("reclaimed %d shared-memory slabs of cache services that were killed, in %s", reclaimed, shm)
        self._slab_lock = slabs.SlabLock(shm)
        self.slab_path = self._slab_lock.slab_path
        try:
            self.manager = CacheManager(
                config, layout, model_fingerprint=model_fingerprint, host_file=self.slab_path, hasher=hasher
            )
            self._share_with_group(self.slab_path)
        except BaseException:
            self._drop_slab()  # shared memory outlives the process: never leave a slab behind
            raise
        try:
            self._listener = self._listen()
        except BaseException:
            self.manager.close(flush_s=0)
            self._drop_slab()
            raise
        # Agent sessions whose transcripts this host tier protects: the servers on the node forward their turns
        self.agent_sessions: SessionRegistry | None = None
        if config.session.enabled:
            self.agent_sessions = SessionRegistry(config.session, layout.block_size)
            self.manager.protect(self.agent_sessions.protection)
        self.publisher = self._publisher(config)
        self._ids = itertools.count(1)
        self._connections: set[_Connection] = set()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a connection ended (its leases are reclaimed by then)
        self._closed = threading.Event()

    def _publisher(self, config: Config) -> EventPublisher | None:
        """The node's shared tiers' block events in vLLM's format over ZMQ, where ``kv_events.endpoint`` asks."""
        events = config.kv_events
        if events.endpoint is None:
            return None
        held = HeldKeys()
        publisher = EventPublisher(
            events.endpoint,
            replay_endpoint=events.replay_endpoint,
            block_size=self.layout.block_size,
            root=self.manager.hasher.root(config.cache.namespace),
            snapshot=held.snapshot,
            topic=events.topic,
            buffer_batches=events.buffer_batches,
        )
        held.listen(publisher)
        self.manager.follow(held)
        log.info("kv events (vLLM's format) on %s, replay on %s", publisher.endpoint, publisher.replay_endpoint)
        return publisher

    def _drop_slab(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.slab_path.unlink()
        self._slab_lock.release()

    def admits(self, uid: int, gid: int) -> bool:
        if uid in self.allowed_uids:
            return True
        return self.socket_group is not None and in_group(uid, gid, self.socket_group)

    def _share_with_group(self, path: Path) -> None:
        """Hand ``path`` to the configured group, read-write (clients map the slab and write their stores)."""
        if self.socket_group is not None:
            os.chown(path, -1, self.socket_group)
            os.chmod(path, 0o660)

    def _listen(self) -> socket.socket:
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # the socket of a service that died: nobody answers on it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: no window in which another user could connect
        try:
            sock.bind(str(self.socket_path))
        finally:
            os.umask(old)
        self._share_with_group(self.socket_path)  # after bind: the group is given, never taken from a umask
        sock.listen(64)
        return sock

    def mismatch(self, hello: p.Hello) -> str | None:
        """Why a client cannot share this cache, naming both sides; None when it can."""
        ours = (p.PROTOCOL_VERSION, self.model_fingerprint, self.layout.descriptor, self.layout.block_size)
        theirs = (hello.version, hello.model_fingerprint, hello.layout, hello.block_size)
        names = ("protocol version", "model fingerprint", "KV layout", "block size")
        diffs = [f"{n}: client {b!r}, service {a!r}" for n, a, b in zip(names, ours, theirs, strict=True) if a != b]
        return "; ".join(diffs) or None

    def welcome(self) -> p.Welcome:
        host = self.manager.host
        return p.Welcome(
            p.PROTOCOL_VERSION, str(self.slab_path), host.capacity_bytes, host.slot_bytes, self.layout.block_bytes
        )

    def lease(self) -> int:
        return next(self._ids)

    def session_turn(self, namespace: str, session_id: str, tokens: np.ndarray) -> None:
        if self.agent_sessions is not None:
            self._turn(self.manager.keyed(tokens, namespace), session_id)

    def _turn(self, transcript: KeyedTokens, session_id: str) -> None:
        assert self.agent_sessions is not None
        self.agent_sessions.turn(transcript.namespace, session_id, transcript.tokens, transcript.keys)

    def session_prefetch(self, namespace: str, session_id: str, tokens: np.ndarray) -> p.Prefetched:
        """Live again (protected before its blocks move, so they land protected), then promoted to host."""
        transcript = self.manager.keyed(tokens, namespace)
        if self.agent_sessions is not None and self.agent_sessions.touch(namespace, session_id) is None:
            self._turn(transcript, session_id)  # expired here, or this service restarted since
        done = self.manager.prefetch(transcript)
        return p.Prefetched({to_wire(p.Tier, k): n for k, n in done.promoted.items()}, done.host_blocks)

    def expire_reservations(self) -> int:
        """Give back every reservation left uncommitted past ``reservation_ttl_s``; how many."""
        with self._lock:
            connections = list(self._connections)
        expired = sum(c.expire(self.clock()) for c in connections)
        if expired:
            log.warning(
                "withdrew %d reservations left uncommitted for %ss (their slots wait for their clients to leave)",
                expired,
                self.reservation_ttl_s,
            )
        return expired

    def _expiry_loop(self) -> None:
        while not self._closed.wait(max(0.1, self.reservation_ttl_s / 4)):
            self.expire_reservations()

    def serve_forever(self) -> None:
        threading.Thread(target=self._expiry_loop, name="kvtier-cache-expiry", daemon=True).start()
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                break  # closed
            connection = _Connection(self, conn)
            with self._lock:
                full = len(self._connections) >= self.max_clients
                if not full:
                    self._connections.add(connection)
            if full:
                self._turn_away(conn)
            else:
                threading.Thread(target=connection.run, name="kvtier-cache-connection", daemon=True).start()

    def _turn_away(self, conn: socket.socket) -> None:
        """One client too many: told so in one message, on the accepting thread (no thread is made for it)."""
        warn_once("cache-service-full", "cache service: %d clients connected; turning more away", self.max_clients)
        with conn:
            conn.settimeout(1.0)
            with contextlib.suppress(OSError):
                p.send(conn, p.Busy(f"the service serves at most {self.max_clients} clients at once"))

    def _forget(self, connection: _Connection) -> None:
        with self._changed:
            self._connections.discard(connection)
            self._changed.notify_all()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def wait_connections(self, at_most: int, timeout: float | None = None) -> bool:
        """Wait until at most ``at_most`` clients are connected, every departed one's leases reclaimed."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._connections) <= at_most, timeout)

    def stop(self) -> None:
        """Stop accepting (safe from a signal handler): :meth:`serve_forever` returns."""
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop accepting, end every connection (their leases are reclaimed), flush and close the tiers."""
        self.stop()
        self._listener.close()
        with self._lock:
            connections = list(self._connections)
        for s in connections:
            with contextlib.suppress(OSError):
                s.conn.shutdown(socket.SHUT_RDWR)
        self.manager.close(self.manager.config.cache.flush_on_exit_s)
        if self.publisher is not None:
            self.publisher.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        self._drop_slab()
