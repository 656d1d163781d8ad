"""The remote tier's value format: a framed, versioned, authenticated block that a stranger cannot forge.

A shared Redis is shared with other services and other deployments, so
every value read back is hostile until proven otherwise. One value is::

    header (140 bytes, little-endian):
        b"KVTR" || uint8 FORMAT_VERSION || uint8 flags (bit 0: has a parent) || 2 zero bytes
        || uint32 payload length
        || block key (16) || parent key (16; zeros when none)
        || token digest (32: :meth:`kvtier.keys.KeyHasher.digest`, or a named block's digest)
        || layout id (32: :func:`layout_id`, binds the model fingerprint and the KV layout)
        || BLAKE3-256 of the payload (32)
    || MAC (32): HMAC-SHA256, keyed with :attr:`kvtier.keys.Secret.remote_mac_key`, of the header
    || payload (the block's KV bytes)

Why the MAC covers the payload's BLAKE3 digest rather than the payload
itself: HMAC-SHA256 over a 737 KB block runs at about the speed of the
network read, which would halve the tier's throughput, while BLAKE3 hashes it
several times faster. Forging a value still needs either the HMAC key or a
second BLAKE3 preimage. The header is authenticated on its own, so a probe
that reads only the header (``GETRANGE``) already knows whether the value is
ours, for this key, this model and these tokens, before any payload moves.

Any mismatch (short, long, another magic or version, a bad MAC, another
key's value copied here, another layout, other tokens, a payload that does
not hash to its header) is a :class:`Rejection`: the caller counts a miss and
never serves a byte of it. The next store of that block overwrites it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass

import blake3
import numpy as np

from kvtier.keys import KEY_BYTES, BlockDigest, BlockKey
from kvtier.tiers.base import BlockRecord

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBB2xI16s16s32s32s32s")
MAC_BYTES = 32
HEADER_BYTES = _HEADER.size + MAC_BYTES  # what a probe reads
_HAS_PARENT = 1
_NO_PARENT = bytes(KEY_BYTES)
_LAYOUT_LABEL = b"kvtier-remote-layout"


class Rejection(enum.StrEnum):
    """Why a value read from the remote was not served; each is a counter in :class:`kvtier.stats.RemoteStats`."""

    BAD_LENGTH = "bad_length"  # shorter than a header, or a payload of another length (truncated, oversized)
    BAD_HEADER = "bad_header"  # not our magic or format version
    BAD_MAC = "bad_mac"  # the header is not authenticated by this deployment's key
    WRONG_KEY = "wrong_key"  # an authentic value of another block, copied under this key
    WRONG_LAYOUT = "wrong_layout"  # written for another model or KV layout
    FOREIGN_TOKENS = "foreign_tokens"  # this key, but other token ids (the lookup's digest disagrees)
    BAD_PAYLOAD = "bad_payload"  # the payload does not hash to what its authentic header says


class FrameError(Exception):
    def __init__(self, why: Rejection) -> None:
        super().__init__(why.value)
        self.why = why


def layout_id(model_fingerprint: str, layout_descriptor: str, block_bytes: int) -> bytes:
    """BLAKE2b-256 of the label, the fingerprint, the layout descriptor and the block size in bytes.

    Not secret: it says which KV a value holds, so a node with another model
    or layout sharing the same Redis and key prefix rejects it outright.
    """
    h = hashlib.blake2b(_LAYOUT_LABEL, digest_size=32)
    for part in (model_fingerprint.encode(), layout_descriptor.encode()):
        h.update(struct.pack("<I", len(part)) + part)
    h.update(struct.pack("<Q", block_bytes))
    return h.digest()


@dataclass(frozen=True)
class Header:
    """A value's authenticated header: what a probe learns about a block without reading its payload."""

    key: BlockKey
    record: BlockRecord
    payload_len: int
    payload_hash: bytes


class Framer:
    """Encodes and checks values for one deployment (MAC key) and one model and layout (layout id)."""

    def __init__(self, mac_key: bytes, layout: bytes, payload_bytes: int) -> None:
        self._mac_key = mac_key
        self._layout = layout
        self.payload_bytes = payload_bytes

    @property
    def value_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    def encode(self, key: BlockKey, record: BlockRecord, payload: memoryview) -> bytes:
        """One value: header, MAC, payload (one copy of the payload, into the returned bytes)."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} B, the layout's block is {self.payload_bytes} B")
        head = self._head(key, record, payload)
        return b"".join((head, self._mac(head), payload))

    def _head(self, key: BlockKey, record: BlockRecord, payload: memoryview) -> bytes:
        parent = record.parent
        return _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            _HAS_PARENT if parent is not None else 0,
            len(payload),
            key,
            parent if parent is not None else _NO_PARENT,
            record.digest,
            self._layout,
            blake3.blake3(payload).digest(),
        )

    def blank(self) -> bytearray:
        """A value's buffer: fill :meth:`payload_of` it, then :meth:`seal` it (one payload copy in all)."""
        return bytearray(self.value_bytes)

    @staticmethod
    def payload_of(value: bytearray) -> np.ndarray:
        return np.frombuffer(value, dtype=np.uint8, offset=HEADER_BYTES)

    def seal(self, key: BlockKey, record: BlockRecord, value: bytearray) -> bytearray:
        """Write the header and MAC of the payload already in ``value`` (what :meth:`encode` builds, in place)."""
        head = self._head(key, record, memoryview(value)[HEADER_BYTES:])
        value[: _HEADER.size] = head
        value[_HEADER.size : HEADER_BYTES] = self._mac(head)
        return value

    def header(self, key: BlockKey, value: bytes | memoryview) -> Header:
        """The authenticated header of ``value`` stored under ``key``; :class:`FrameError` if it is not one."""
        if len(value) < HEADER_BYTES:
            raise FrameError(Rejection.BAD_LENGTH)
        head = bytes(value[: _HEADER.size])
        magic, version, flags, length, k, parent, digest, layout, payload_hash = _HEADER.unpack(head)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise FrameError(Rejection.BAD_HEADER)
        if not hmac.compare_digest(self._mac(head), bytes(value[_HEADER.size : HEADER_BYTES])):
            raise FrameError(Rejection.BAD_MAC)
        if k != key:
            raise FrameError(Rejection.WRONG_KEY)
        if layout != self._layout:
            raise FrameError(Rejection.WRONG_LAYOUT)
        if length != self.payload_bytes:
            raise FrameError(Rejection.BAD_LENGTH)
        record = BlockRecord(BlockDigest(digest), BlockKey(parent) if flags & _HAS_PARENT else None)
        return Header(key, record, length, payload_hash)

    def open(self, key: BlockKey, value: bytes, digest: BlockDigest) -> tuple[Header, memoryview]:
        """``value``'s authentic header, checked against ``key`` and the request's token ``digest``, and its
        payload, not yet checked: :meth:`verify` it (wherever it was copied to) before serving a byte of it."""
        header = self.header(key, value)
        if not header.record.matches(digest):
            raise FrameError(Rejection.FOREIGN_TOKENS)
        if len(value) != HEADER_BYTES + header.payload_len:
            raise FrameError(Rejection.BAD_LENGTH)
        return header, memoryview(value)[HEADER_BYTES:]

    @staticmethod
    def verify(header: Header, payload: memoryview | bytes | np.ndarray) -> None:
        """:class:`FrameError` unless ``payload`` hashes to what its authentic header says."""
        Framer.verify_hash(header, blake3.blake3(payload).digest())

    @staticmethod
    def payload_hasher() -> blake3.blake3:
        """The hash of :meth:`verify`, to be fed piece by piece: the remote tier hashes a payload as it lands,
        each piece while it is still in the core's cache, then checks the result with :meth:`verify_hash`."""
        return blake3.blake3()

    @staticmethod
    def verify_hash(header: Header, payload_hash: bytes) -> None:
        """:class:`FrameError` unless ``payload_hash`` (of the bytes that would be served) is the header's."""
        if not hmac.compare_digest(payload_hash, header.payload_hash):
            raise FrameError(Rejection.BAD_PAYLOAD)

    def payload(self, key: BlockKey, value: bytes, digest: BlockDigest) -> memoryview:
        """``value``'s payload, checked end to end against ``key`` and the request's token ``digest``."""
        header, body = self.open(key, value, digest)
        self.verify(header, body)
        return body

    def _mac(self, head: bytes) -> bytes:
        return hmac.digest(self._mac_key, head, "sha256")
