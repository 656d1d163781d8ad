"""The cache service's wire protocol: versioned, length-prefixed msgpack messages over a Unix socket.

Why this shape: every engine process on a node (vLLM's scheduler and
workers, llama.cpp, ``kvtier serve``) talks to one cache service, so the
messages are small typed structs (msgspec, never pickle: a socket is a trust
boundary) and **payload bytes never cross the socket**: they live in the
host slab, a shared-memory file every client maps. A load answers with the
byte offsets of pinned slots; a store reserves slots, the client writes its
bytes into them, then commits. Tokens travel as little-endian int32 bytes
(the service computes the keys: the deployment secret stays with it).

Named blocks (:class:`NamedExists`, :class:`NamedLoad`, :class:`NamedReserve`)
are payloads an engine addresses by names of its own (llama.cpp's saved
states, SGLang's pages); they answer with :class:`Present`, :class:`Loaded`
and :class:`Reserved` and commit with :class:`Commit`, like token blocks. The
names travel raw and the service keys them (:meth:`kvtier.keys.KeyHasher.named`),
as it does tokens. They came without a version bump: no message changed, so
every older client still speaks this protocol; a newer client that asks an
older service for a named block gets its connection closed, which it counts
as a miss like any service failure.

Agent sessions came the same way (:class:`SessionTurn`,
:class:`SessionPrefetch`, :class:`Explain`): the host tier whose eviction a
live session's protection steers, and the eviction log that explain reads,
are the service's, so the server forwards its sessions' turns there and
asks there why a prefix missed.

Bounds: counts are non-negative and times finite, non-negative and at most
:data:`MAX_SECONDS`, checked as a frame decodes. A whole frame whose values
break them is refused with a :class:`Failure` and the connection goes on
(:class:`InvalidRequest`); only bytes that are not a frame end it. The bounds
came without a version bump too: no value an honest client sends changed
meaning.

Enumerated values are the protocol's own (:class:`Tier`, :class:`Miss`,
:class:`Why`, :class:`Policy`), not the core's: a new tier kind or eviction
policy inside kvtier must not change what crosses the socket unnoticed. The
rule for adding a value: a peer that does not know it refuses the whole
message (the client then counts a miss), so a value an older peer could
receive bumps :data:`PROTOCOL_VERSION`; one only a newer peer can be sent
(behind a message it alone sends) extends the enum without a bump, as the
named blocks did. Each side converts at the edge, by value
(:func:`to_wire`); ``tests/service/test_protocol_enums.py`` fails when a
core enum and its wire twin disagree.

The stats reply carries :class:`kvtier.stats.CacheStats` itself, the one
typed tree both caches return: every field has a default and a reader
ignores fields it does not know, so a counter added there needs no bump.

Frame: ``uint32 little-endian length`` then that many bytes of msgpack, one
tagged struct. The first exchange is :class:`Hello` / :class:`Welcome` (or
:class:`Refused`, naming both sides of whatever did not match).
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Iterable
from typing import Annotated, TypeVar

import msgspec

from kvtier.stats import CacheStats

PROTOCOL_VERSION = 1
MAX_FRAME = 16 * 1024**2  # a prompt's tokens at most; anything larger is a broken or hostile peer
_LEN = struct.Struct("<I")
MAX_SECONDS = 31 * 86400.0  # a pin's or a deadline's longest; NaN and infinity are refused

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]


class _Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True, frozen=True):
    pass


# -- the values on the wire (see "Enumerated values" above) --------------------------------------
class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


class Miss(enum.StrEnum):
    """Why a lookup stopped where it did."""

    NONE = "none"
    ABSENT = "absent"
    CONFIRM_MISMATCH = "confirm_mismatch"


class Why(enum.StrEnum):
    """Explain's answer: why a prefix would not be served."""

    ALL_CACHED = "all_cached"
    PARTIAL_TAIL = "partial_tail"
    NEVER_STORED = "never_stored"
    EVICTED = "evicted"
    OTHER_NAMESPACE = "other_namespace"
    OTHER_MODEL = "other_model"
    HASH_COLLISION = "hash_collision"
    SESSION_DIVERGED = "session_diverged"


class Policy(enum.StrEnum):
    LRU = "lru"
    LFU = "lfu"
    S3FIFO = "s3fifo"
    PREFIX_LRU = "prefix_lru"


E = TypeVar("E", bound=enum.StrEnum)


def to_wire(kind: type[E], value: enum.StrEnum) -> E:
    """``value`` (a core enum, or a wire one on the way back) as ``kind``, by value."""
    return kind(value.value)


def all_to(kind: type[E], values: Iterable[enum.StrEnum]) -> list[E]:
    return [kind(v.value) for v in values]


# -- client -> service ---------------------------------------------------------------------------
class Hello(_Msg):
    version: int
    model_fingerprint: str
    layout: str  # KVLayout.descriptor: order, shape, dtype
    block_size: int


class Lookup(_Msg):
    tokens: bytes  # int32 little-endian
    namespace: str
    first_block: NonNegative = 0


class Load(_Msg):
    """Pin the cached blocks ``start ..`` (promoting disk ones) and say where they are in the slab."""

    tokens: bytes
    namespace: str
    start: NonNegative
    max_blocks: NonNegative | None = None
    deadline_s: Seconds | None = None


class Release(_Msg):
    lease: int


class Reserve(_Msg):
    """Reserve slots for the full blocks ``first_block ..`` of ``tokens`` that are not cached yet."""

    tokens: bytes
    namespace: str
    first_block: NonNegative = 0
    num_blocks: NonNegative | None = None


class Commit(_Msg):
    """Publish a reservation's blocks (``success``) or give its slots back.

    ``crc32c`` is the CRC-32C of each block as the client wrote it: the
    service checks the slots against it before anyone can load them, so a
    torn or misdirected write is never published.
    """

    lease: int
    success: bool = True
    crc32c: list[int] = []


class Probe(_Msg):
    """What :class:`Lookup` would answer, without touching eviction order or stats (operators' ``/lookup``)."""

    tokens: bytes
    namespace: str


class Pin(_Msg, omit_defaults=True):
    """Keep the full blocks of ``tokens`` out of ``tier``'s eviction for ``ttl_s`` seconds (0 unpins).

    ``tier`` came without a version bump: it has a default, so an older
    client's pin (no such field) is a host pin, and a host pin is encoded
    without it (``omit_defaults``), so an older service still takes it. Only
    a disk pin sent to an older service is refused there, a miss like any.
    """

    tokens: bytes
    namespace: str
    ttl_s: Seconds
    tier: Tier = Tier.HOST


class Clear(_Msg, omit_defaults=True):
    """Drop every unpinned block of one tier (None: all), or only ``namespace``'s.

    ``namespace`` came without a version bump: a clear of everything is
    framed as before it, and an older service refuses only a namespace's.
    """

    tier: Tier | None = None
    namespace: str | None = None


class Stats(_Msg):
    pass


class NamedExists(_Msg):
    """Which of ``names`` a tier holds (no pin, no eviction-order change)."""

    names: list[bytes]
    namespace: str


class NamedLoad(_Msg):
    """Pin the leading held ``names`` (promoting disk ones); :class:`Loaded` stops at the first absent."""

    names: list[bytes]
    namespace: str


class NamedReserve(_Msg):
    """Reserve slots for the ``names`` no tier holds; :class:`Reserved` indexes into ``names``.

    At most half the host tier is reserved at once: reserve again from
    ``next_block`` after committing, for an object larger than that.
    """

    names: list[bytes]
    namespace: str


class SessionTurn(_Msg):
    """A session's turn with transcript ``tokens``: live again, its blocks protected in the service's host tier."""

    namespace: str
    session_id: str
    tokens: bytes


class SessionPrefetch(_Msg):
    """The session is about to speak: live again, and its transcript ``tokens`` promoted to host memory."""

    namespace: str
    session_id: str
    tokens: bytes


class Explain(_Msg):
    """Why the cached run of ``tokens`` stops (:func:`kvtier.explain.diagnose`), from the service's evidence.

    ``own_namespaces``: the caller's other namespaces, the only ones probed
    besides ``namespace``. ``diverged_at``: where the session's previous turn
    left these tokens (the server keeps transcripts; the service does not).
    """

    tokens: bytes
    namespace: str
    own_namespaces: list[str] = []
    diverged_at: int | None = None


# -- service -> client ---------------------------------------------------------------------------
class Welcome(_Msg):
    version: int
    slab_path: str
    slab_bytes: int
    slot_bytes: int
    block_bytes: int


class Refused(_Msg):
    reason: str


class Busy(_Msg):
    """The service serves as many clients as ``service.max_clients`` allows: try again later (a miss meanwhile)."""

    reason: str


class LookupReply(_Msg):
    cached_blocks: int
    tiers: list[Tier]  # from first_block on
    miss_reason: Miss


class Loaded(_Msg):
    lease: int
    first_block: int
    offsets: list[int]  # byte offset of each pinned block's payload in the slab
    served_from: list[Tier]


class Reserved(_Msg):
    lease: int
    block_indices: list[int]
    offsets: list[int]
    already_cached: int
    next_block: int


class Committed(_Msg):
    blocks: int


class Done(_Msg):
    pass


class Count(_Msg):
    n: int


class Present(_Msg):
    flags: list[bool]  # one per name asked, in order


class Prefetched(_Msg):
    promoted: dict[Tier, int]  # tokens moved up to host, by the tier they left
    host_blocks: int  # leading blocks of the transcript in host memory afterwards


class Explained(_Msg):
    cached_blocks: int
    tiers: list[Tier]
    miss_reason: Miss
    reason: Why
    first_miss_token: int | None
    eviction_tier: Tier | None = None
    eviction_policy: Policy | None = None
    eviction_age_s: float | None = None
    other_namespace: str | None = None  # one of ``own_namespaces``, never another tenant's


class StatsReply(_Msg):
    stats: CacheStats


class Failure(_Msg):
    message: str


Request = (
    (Hello | Lookup | Load | Release | Reserve | Commit | Probe | Pin | Clear | Stats)
    | (NamedExists | NamedLoad | NamedReserve)
    | (SessionTurn | SessionPrefetch | Explain)
)
Reply = (
    (Welcome | Refused | Busy)
    | (LookupReply | Loaded | Reserved | Committed | Done | Count | Present | StatsReply | Failure)
    | (Prefetched | Explained)
)

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)


class ProtocolError(ConnectionError):
    """The peer sent something that is not a frame of this protocol (or closed mid-frame)."""


class InvalidRequest(ValueError):
    """A whole frame whose message this protocol cannot take (a bound broken, a field of the wrong type).

    Refused in one line; the stream is still in step, so the connection goes on.
    """


def send(sock: socket.socket, message: _Msg) -> None:
    body = _encoder.encode(message)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ProtocolError("the peer closed the connection" + (" mid-frame" if got else ""))
        got += k
    return bytes(buf)


def _frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ProtocolError(f"a frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    return _recv_exactly(sock, n)


def recv_request(sock: socket.socket) -> Request:
    frame = _frame(sock)
    try:
        return _requests.decode(frame)
    except msgspec.ValidationError as err:
        raise InvalidRequest(str(err)) from None
    except msgspec.DecodeError as err:
        raise ProtocolError(f"not a request of protocol {PROTOCOL_VERSION}: {err}") from None


def recv_reply(sock: socket.socket) -> Reply:
    try:
        return _replies.decode(_frame(sock))
    except msgspec.DecodeError as err:
        raise ProtocolError(f"not a reply of protocol {PROTOCOL_VERSION}: {err}") from None
