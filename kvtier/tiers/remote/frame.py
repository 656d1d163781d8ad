"""The remote tier's value format: a framed, versioned, authenticated block that a stranger cannot forge.

A shared Redis is shared with other services and other deployments, so
every value read back is hostile until proven otherwise. One value is::

    header (140 bytes, little-endian):
        b"KVTR" || uint8 FORMAT_VERSION || uint8 flags (bit 0: has a parent) || 2 zero bytes
        || uint32 payload length
        || block key (16) || parent key (16; zeros when none)
        || token digest (32: :meth:`kvtier.keys.KeyHasher.digest`, or a named block's digest)
        || layout id (32: :func:`layout_id`, binds the model fingerprint and the KV layout)
        || salt (16, random for each value written) || payload tag (16)
    || MAC (32): HMAC-SHA256, keyed with :attr:`kvtier.keys.Secret.remote_mac_key`, of the header
    || payload (the block's KV bytes)

The payload tag is AES-256-GMAC of the payload under a key of its own:
keyed BLAKE2b of the salt under the MAC key. So the whole value is
authenticated by the deployment's secret in two keyed steps: the header by
HMAC, the payload by a MAC whose tag the header carries. Why not one HMAC
over everything: the payload is hundreds of KB and must be checked at the
speed it arrives; HMAC-SHA256 and BLAKE3 both cost the reading core more
than the read itself, while GMAC runs on the carry-less multiply and AES
instructions several times faster (``bench/README.md``). GMAC is a MAC only
while a key never tags two messages, which the random salt guarantees: two
writes of one block, even with different bytes, have different keys.

The header is authenticated on its own, so a probe that reads only the
header (``GETRANGE``) already knows whether the value is ours, for this key,
this model and these tokens, before any payload moves.

Any mismatch (short, long, another magic or version, a bad MAC, another
key's value copied here, another layout, other tokens, a payload that does
not match its header's tag) is a :class:`Rejection`: the caller counts a miss
and never serves a byte of it. The next store of that block overwrites it.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from kvtier.keys import KEY_BYTES, BlockDigest, BlockKey
from kvtier.tiers.base import BlockRecord

MAGIC = b"KVTR"
FORMAT_VERSION = 2  # 2: a salted AES-GMAC payload tag; 1: BLAKE3 of the payload
_HEADER = struct.Struct("<4sBB2xI16s16s32s32s16s16s")
SALT_BYTES = 16
MAC_BYTES = 32
HEADER_BYTES = _HEADER.size + MAC_BYTES  # what a probe reads
_HAS_PARENT = 1
_NO_PARENT = bytes(KEY_BYTES)
_LAYOUT_LABEL = b"kvtier-remote-layout"
_PAYLOAD_KEY_PERSON = b"kvtier-payload"  # BLAKE2b personalisation: this derivation, nothing else
_GMAC_NONCE = bytes(12)  # every payload key tags one message, so a fixed nonce never repeats under a key


class Rejection(enum.StrEnum):
    """Why a value read from the remote was not served; each is a counter in :class:`kvtier.stats.RemoteStats`."""

    BAD_LENGTH = "bad_length"  # shorter than a header, or a payload of another length (truncated, oversized)
    BAD_HEADER = "bad_header"  # not our magic or format version
    BAD_MAC = "bad_mac"  # the header is not authenticated by this deployment's key
    WRONG_KEY = "wrong_key"  # an authentic value of another block, copied under this key
    WRONG_LAYOUT = "wrong_layout"  # written for another model or KV layout
    FOREIGN_TOKENS = "foreign_tokens"  # this key, but other token ids (the lookup's digest disagrees)
    BAD_PAYLOAD = "bad_payload"  # the payload does not match the tag its authentic header carries


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
    salt: bytes
    payload_tag: bytes


class PayloadMac:
    """AES-256-GMAC of one payload, fed piece by piece, under the key its value's salt derives.

    The remote tier feeds each piece as it lands off the socket, while it
    is still in the core's cache, and compares :meth:`tag` with the header's.
    """

    def __init__(self, mac_key: bytes, salt: bytes) -> None:
        key = hashlib.blake2b(salt, key=mac_key, digest_size=32, person=_PAYLOAD_KEY_PERSON).digest()
        self._gmac = Cipher(algorithms.AES(key), modes.GCM(_GMAC_NONCE)).encryptor()

    def update(self, piece: memoryview | bytes | np.ndarray) -> None:
        self._gmac.authenticate_additional_data(piece)

    def tag(self) -> bytes:
        self._gmac.finalize()
        return self._gmac.tag


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
        salt = os.urandom(SALT_BYTES)
        return _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            _HAS_PARENT if parent is not None else 0,
            len(payload),
            key,
            parent if parent is not None else _NO_PARENT,
            record.digest,
            self._layout,
            salt,
            self._tag(salt, payload),
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
        magic, version, flags, length, k, parent, digest, layout, salt, tag = _HEADER.unpack(head)
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
        return Header(key, record, length, salt, tag)

    def open(self, key: BlockKey, value: bytes, digest: BlockDigest) -> tuple[Header, memoryview]:
        """``value``'s authentic header, checked against ``key`` and the request's token ``digest``, and its
        payload, not yet checked: :meth:`verify` it (wherever it was copied to) before serving a byte of it."""
        header = self.header(key, value)
        if not header.record.matches(digest):
            raise FrameError(Rejection.FOREIGN_TOKENS)
        if len(value) != HEADER_BYTES + header.payload_len:
            raise FrameError(Rejection.BAD_LENGTH)
        return header, memoryview(value)[HEADER_BYTES:]

    def verify(self, header: Header, payload: memoryview | bytes | np.ndarray) -> None:
        """:class:`FrameError` unless ``payload`` matches the tag its authentic header carries."""
        self.verify_tag(header, self._tag(header.salt, payload))

    def payload_mac(self, header: Header) -> PayloadMac:
        """The MAC of :meth:`verify`, to be fed piece by piece; check its tag with :meth:`verify_tag`."""
        return PayloadMac(self._mac_key, header.salt)

    @staticmethod
    def verify_tag(header: Header, tag: bytes) -> None:
        """:class:`FrameError` unless ``tag`` (of the bytes that would be served) is the header's."""
        if not hmac.compare_digest(tag, header.payload_tag):
            raise FrameError(Rejection.BAD_PAYLOAD)

    def payload(self, key: BlockKey, value: bytes, digest: BlockDigest) -> memoryview:
        """``value``'s payload, checked end to end against ``key`` and the request's token ``digest``."""
        header, body = self.open(key, value, digest)
        self.verify(header, body)
        return body

    def _tag(self, salt: bytes, payload: memoryview | bytes | np.ndarray) -> bytes:
        mac = PayloadMac(self._mac_key, salt)
        mac.update(payload)
        return mac.tag()

    def _mac(self, head: bytes) -> bytes:
        return hmac.digest(self._mac_key, head, "sha256")
