"""``CacheClient``: an engine process's side of the cache service.

It maps the service's host slab once, at the handshake; after that a load
is one round trip that answers with slot offsets, and the engine copies
each block straight out of its own mapping into its KV pool (the one copy a
load costs), then releases. A store reserves slots, writes the payloads into
the mapping, and commits. One connection carries one request at a time (a
lock around each round trip); pins and reservations die with the connection.

So the connection must outlive every use of its slots: :meth:`CacheClient.close`
while a fill writes into reserved slots, or a copy reads pinned ones, only
marks the client closing (no request is sent any more); the socket closes
when the last of them ends. Closed earlier, the service would hand those
slots to another client while this one still writes or reads them.

A service that is down, or goes away mid-request, is a miss for the caller:
:class:`ServiceUnavailable` is raised by the constructor, and afterwards
every call answers "nothing cached" / "nothing stored" and counts the
failure in :attr:`CacheClient.failures`, never an error to the engine's
client.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.errors import KVTierError, warn_once
from kvtier.layout import KVLayout
from kvtier.service import protocol as p
from kvtier.stats import CacheStats
from kvtier.tiers import native
from kvtier.tiers.base import TierKind

log = logging.getLogger(__name__)


class ServiceUnavailable(KVTierError):
    """The cache service could not be reached, or refused this client (the reason says which side differs)."""


class ServiceRefused(ServiceUnavailable):
    """The service answered and refused this client (another model, KV layout, protocol or user): not a wait."""


@dataclass
class ClientLoad:
    """Pinned blocks in the shared slab: ``blocks[i]`` is block ``first_block + i``; release when copied."""

    first_block: int
    blocks: list[torch.Tensor]
    served_from: list[TierKind]
    _release: Callable[[], None] = field(repr=False)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release()

    def __enter__(self) -> ClientLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _raw(tokens: Sequence[int] | np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


class CacheClient:
    def __init__(self, socket_path: str | Path, layout: KVLayout, *, model_fingerprint: str) -> None:
        self.layout = layout
        self.failures = 0
        self._lock = threading.Lock()  # one round trip at a time
        self._state = threading.Lock()  # guards the two below
        self._holds = 0  # fills and loads using this connection's slots
        self._closing = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(str(socket_path))
            p.send(self._sock, p.Hello(p.PROTOCOL_VERSION, model_fingerprint, layout.descriptor, layout.block_size))
            welcome = p.recv_reply(self._sock)
        except (OSError, p.ProtocolError) as err:
            self._sock.close()
            raise ServiceUnavailable(f"cache service at {socket_path}: {err}") from None
        if isinstance(welcome, p.Busy):
            self._sock.close()
            raise ServiceUnavailable(f"cache service at {socket_path}: {welcome.reason}")
        if not isinstance(welcome, p.Welcome):
            self._sock.close()
            reason = welcome.reason if isinstance(welcome, p.Refused) else type(welcome).__name__
            raise ServiceRefused(f"cache service at {socket_path} refused this client: {reason}")
        if welcome.block_bytes != layout.block_bytes:
            self._sock.close()
            raise ServiceRefused(f"block of {welcome.block_bytes} B at the service, {layout.block_bytes} B here")
        self.welcome = welcome
        self._slab = torch.from_file(welcome.slab_path, shared=True, size=welcome.slab_bytes, dtype=torch.uint8)

    # -- one round trip ------------------------------------------------------------------------
    def _ask(self, msg: p.Request) -> p.Reply | None:
        """The service's answer, or None when it is gone (counted, logged once): a miss, never an error.

        A closing client asks nothing (its leases end with the socket).
        """
        with self._lock:
            if self._closing:
                return None
            try:
                p.send(self._sock, msg)
                reply = p.recv_reply(self._sock)
            except (OSError, p.ProtocolError) as err:
                self.failures += 1
                warn_once("cache-service-gone", "cache service unreachable (%s); serving misses", err)
                return None
        if isinstance(reply, p.Failure):
            self.failures += 1
            log.warning("cache service: %s", reply.message)
            return None
        return reply

    def _view(self, offset: int) -> torch.Tensor:
        return self._slab[offset : offset + self.layout.block_bytes]

    # -- the connection outlives every use of its slots ---------------------------------------------
    def _hold(self) -> None:
        with self._state:
            self._holds += 1

    def _unhold(self) -> None:
        with self._state:
            self._holds -= 1
            last = self._closing and self._holds == 0
        if last:
            self._shut()

    @contextlib.contextmanager
    def _holding(self) -> Iterator[None]:
        """Taken before a reservation is asked for, so no close can end the connection under its fill."""
        self._hold()
        try:
            yield
        finally:
            self._unhold()

    def _loaded(self, reply: p.Reply | None, first_block: int) -> ClientLoad:
        """A load's views, holding the connection until released (taken by the caller before asking)."""
        if not isinstance(reply, p.Loaded):
            self._unhold()
            return ClientLoad(first_block, [], [], lambda: None)
        lease = reply.lease

        def release() -> None:
            try:
                self._ask(p.Release(lease))
            finally:
                self._unhold()

        served = p.all_to(TierKind, reply.served_from)
        return ClientLoad(first_block, [self._view(o) for o in reply.offsets], served, release)

    def alive(self) -> bool:
        """False once the service closed this connection (it died or restarted), seen without a round trip.

        Between round trips the service never sends: a readable socket is
        one the service closed. A round trip in flight will tell by itself.
        """
        if not self._lock.acquire(blocking=False):
            return True
        try:
            if self._closing:
                return False
            readable, _, _ = select.select([self._sock], [], [], 0)
            return not readable
        except (OSError, ValueError):
            return False
        finally:
            self._lock.release()

    # -- the API ---------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray, namespace: str, *, first_block: int = 0) -> p.LookupReply:
        reply = self._ask(p.Lookup(_raw(tokens), namespace, first_block))
        if not isinstance(reply, p.LookupReply):
            return p.LookupReply(first_block, [], p.Miss.ABSENT)
        return reply

    def load(
        self,
        tokens: Sequence[int] | np.ndarray,
        namespace: str,
        *,
        start: int = 0,
        max_blocks: int | None = None,
        deadline_s: float | None = None,
    ) -> ClientLoad:
        """Pin blocks ``start ..`` (the service promotes disk ones first); the views read the shared slab."""
        self._hold()
        return self._loaded(self._ask(p.Load(_raw(tokens), namespace, start, max_blocks, deadline_s)), start)

    def store_from(
        self,
        tokens: Sequence[int] | np.ndarray,
        fill: Callable[[int, torch.Tensor], object],
        namespace: str,
        *,
        first_block: int = 0,
        num_blocks: int | None = None,
    ) -> int:
        """Store blocks ``first_block ..``: ``fill(i, out)`` writes block i's payload into its reserved slot.

        Returns how many blocks were newly stored. A block the service
        already holds is not reserved (nor written) again.
        """
        with self._holding():
            reserved = self._ask(p.Reserve(_raw(tokens), namespace, first_block, num_blocks))
            if not isinstance(reserved, p.Reserved):
                return 0
            return self._commit(reserved, fill, 0)

    def store(
        self,
        tokens: Sequence[int] | np.ndarray,
        blocks: Sequence[torch.Tensor],
        namespace: str,
        *,
        first_block: int = 0,
    ) -> int:
        """``blocks[j]`` is the payload of block ``first_block + j``."""

        def fill(i: int, out: torch.Tensor) -> None:
            out.copy_(blocks[i - first_block].reshape(-1).view(torch.uint8))

        return self.store_from(tokens, fill, namespace, first_block=first_block, num_blocks=len(blocks))

    def _commit(self, reserved: p.Reserved, fill: Callable[[int, torch.Tensor], object], base: int) -> int:
        """Fill a reservation's slots (``fill(base + i, out)``), then commit them with their CRC-32C."""
        try:
            for i, offset in zip(reserved.block_indices, reserved.offsets, strict=True):
                fill(base + i, self._view(offset))
        except BaseException:
            self._ask(p.Commit(reserved.lease, success=False))
            raise
        views = [self._view(o) for o in reserved.offsets]
        done = self._ask(p.Commit(reserved.lease, crc32c=[native.BACKEND.crc32c(v.numpy()) for v in views]))
        return done.blocks if isinstance(done, p.Committed) else 0

    # -- named blocks ------------------------------------------------------------------------------
    def named_exists(self, names: Sequence[bytes], namespace: str) -> list[bool]:
        """Which of ``names`` the service holds; all False while it is unreachable."""
        reply = self._ask(p.NamedExists([bytes(n) for n in names], namespace))
        if not isinstance(reply, p.Present) or len(reply.flags) != len(names):
            return [False] * len(names)
        return reply.flags

    def named_load(self, names: Sequence[bytes], namespace: str) -> ClientLoad:
        """Pin the leading held ``names``: ``blocks[i]`` is name ``i``'s payload, a view of the shared slab."""
        self._hold()
        return self._loaded(self._ask(p.NamedLoad([bytes(n) for n in names], namespace)), 0)

    def named_store_from(
        self, names: Sequence[bytes], fill: Callable[[int, torch.Tensor], object], namespace: str
    ) -> int:
        """Store the ``names`` the service lacks: ``fill(i, out)`` writes name ``i``'s payload into its slot.

        Returns how many were newly stored (0 while the service is
        unreachable). The service reserves at most half its host tier at a
        time, so a large object is reserved, filled and committed in rounds,
        each committed before the next is asked for; an exception from
        ``fill`` gives its round's slots back and propagates.
        """
        raw = [bytes(n) for n in names]
        stored = start = 0
        while start < len(raw):
            with self._holding():
                reserved = self._ask(p.NamedReserve(raw[start:], namespace))
                if not isinstance(reserved, p.Reserved) or reserved.next_block == 0:
                    break  # unreachable, or no host slot free at all
                stored += self._commit(reserved, fill, start)
            start += reserved.next_block
        return stored

    def probe(self, tokens: Sequence[int] | np.ndarray, namespace: str) -> p.LookupReply:
        reply = self._ask(p.Probe(_raw(tokens), namespace))
        return reply if isinstance(reply, p.LookupReply) else p.LookupReply(0, [], p.Miss.ABSENT)

    def pin(
        self, tokens: Sequence[int] | np.ndarray, namespace: str, ttl_s: float, *, tier: TierKind = TierKind.HOST
    ) -> int:
        """TTL-pin the full blocks of ``tokens`` in the service's ``tier`` (0 unpins); how many (0: no such tier)."""
        reply = self._ask(p.Pin(_raw(tokens), namespace, ttl_s, p.to_wire(p.Tier, tier)))
        return reply.n if isinstance(reply, p.Count) else 0

    def clear(self, tier: TierKind | None = None, namespace: str | None = None) -> int:
        reply = self._ask(p.Clear(None if tier is None else p.to_wire(p.Tier, tier), namespace))
        return reply.n if isinstance(reply, p.Count) else 0

    def session_turn(self, namespace: str, session_id: str, tokens: Sequence[int] | np.ndarray) -> None:
        self._ask(p.SessionTurn(namespace, session_id, _raw(tokens)))

    def session_prefetch(self, namespace: str, session_id: str, tokens: Sequence[int] | np.ndarray) -> p.Prefetched:
        reply = self._ask(p.SessionPrefetch(namespace, session_id, _raw(tokens)))
        return reply if isinstance(reply, p.Prefetched) else p.Prefetched({}, 0)

    def explain(
        self,
        tokens: Sequence[int] | np.ndarray,
        namespace: str,
        *,
        own_namespaces: Sequence[str] = (),
        diverged_at: int | None = None,
    ) -> p.Explained | None:
        """The service's answer; None while it is unreachable (there is no evidence to answer from)."""
        reply = self._ask(p.Explain(_raw(tokens), namespace, list(own_namespaces), diverged_at))
        return reply if isinstance(reply, p.Explained) else None

    def stats(self) -> CacheStats | None:
        """The service's figures; None while it is unreachable."""
        reply = self._ask(p.Stats())
        return reply.stats if isinstance(reply, p.StatsReply) else None

    def close(self) -> None:
        """End the connection once no fill or load uses its slots (now, when none does); ask nothing more."""
        with self._state:
            self._closing = True
            idle = self._holds == 0
        if idle:
            self._shut()

    def _shut(self) -> None:
        with self._lock:
            self._closing = True
            self._sock.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
