"""The disk tier's index record: what LMDB stores under each block's key, and the in-memory mirror keeps by slot.

Encoding (little-endian, no pickle)::

    uint32 slot | uint64 sequence | uint8 has_parent | 16 B parent
    | uint32 crc32c[num_layers] | 32 B token digest (kvtier.keys.KeyHasher.digest)
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import DIGEST_BYTES, KEY_BYTES, BlockDigest, BlockKey
from kvtier.tiers.base import BlockRecord

_HEAD = struct.Struct("<IQB16s")


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One index record, decoded: where the block is, in what order it was stored, and how to check it."""

    slot: int
    seq: int
    checksums: bytes  # CRC-32C per layer, packed (:func:`pack_checksums`): as the record stores them
    record: BlockRecord


class IndexDamage(Exception):
    """A header or record this format cannot have: the index is damaged, not merely written for another setup."""


def pack_checksums(crcs: Sequence[int]) -> bytes:
    """Per-layer CRC-32Cs as the record stores them (little-endian uint32 each).

    Kept packed in memory too: a tuple of Python ints costs about 40 bytes per
    layer per block, which the disk tier's mirror pays for every block it indexes.
    """
    return struct.pack(f"<{len(crcs)}I", *crcs)


def record_bytes(num_layers: int) -> int:
    return _HEAD.size + 4 * num_layers + DIGEST_BYTES


def encode_record(e: IndexEntry) -> bytes:
    parent = e.record.parent
    head = _HEAD.pack(e.slot, e.seq, parent is not None, parent or bytes(KEY_BYTES))
    return head + e.checksums + e.record.digest


def decode_record(key: bytes, value: bytes, num_layers: int) -> IndexEntry:
    """Decode one record; raises :class:`IndexDamage` when its sizes cannot be this format's."""
    if len(key) != KEY_BYTES or len(value) != record_bytes(num_layers):
        want = record_bytes(num_layers)
        raise IndexDamage(f"a record of {len(key)}+{len(value)} B, where this format has {KEY_BYTES}+{want} B")
    return decode_value(value, num_layers)


def decode_value(value: bytes, num_layers: int) -> IndexEntry:
    """Decode a record whose size is known to be this format's."""
    slot, seq, has_parent, parent, checksums, digest = _record_struct(num_layers).unpack(value)
    return IndexEntry(slot, seq, checksums, BlockRecord(BlockDigest(digest), BlockKey(parent) if has_parent else None))


@functools.cache
def _record_struct(num_layers: int) -> struct.Struct:
    """A whole record in one unpack: a lookup decodes one per block it confirms."""
    return struct.Struct(f"{_HEAD.format}{4 * num_layers}s{DIGEST_BYTES}s")
