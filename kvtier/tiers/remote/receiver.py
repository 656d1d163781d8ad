"""The remote tier's read of one value: off the socket into its host slot, checked as hostile while it lands.

A shared store holds other services' and other deployments' values, so a
value is served only if its header and its payload both authenticate
(:mod:`kvtier.tiers.remote.frame`). This module checks the bytes as
:meth:`~kvtier.tiers.remote.nodes.Nodes.get_into` hands them over; which
values to read, and from which node, the tier decides.
"""

from __future__ import annotations

import torch

from kvtier.keys import BlockKey
from kvtier.stats import RemoteStats
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.remote.frame import HEADER_BYTES, FrameError, Framer, Header, Rejection
from kvtier.tiers.remote.nodes import RespReader

MAC_STEP = 1 << 17  # payload bytes landed before they are fed to the MAC: still in the core's cache, few calls a block


class Receiver:
    """Checks each value read for the tier, counting every rejection by its reason."""

    def __init__(self, framer: Framer, stats: RemoteStats) -> None:
        self._framer = framer
        self._stats = stats

    def receive(
        self, key: BlockKey, length: int, reader: RespReader, record: BlockRecord | None, out: torch.Tensor
    ) -> bool:
        """Read one value off the socket into ``out``: True only if every check passed.

        The header is checked first (MAC, key, layout, the request's
        tokens); a value that fails it is skipped and not a byte of it
        lands. The payload then goes straight into ``out``, fed to its MAC in
        pieces of :data:`MAC_STEP` as each lands, while it is still in the core's
        cache: one pass over memory instead of a copy and a later re-read,
        and no hand-off to another thread (which, on a machine without a
        spare core, only added the hand-off to the same work). Over a real
        network the next bytes arrive while a piece is authenticated.

        On a payload that fails its tag, ``out`` holds refused bytes: the
        manager reads into a reserved host slot and aborts it, so they are
        never served.
        """
        if length != self._framer.value_bytes or record is None:
            reader.skip(length)
            if record is not None:
                self._stats.add(bad_length=1)
            return False
        head = bytearray(HEADER_BYTES)
        reader.read_into(memoryview(head))
        try:
            header = self._framer.header(key, head)
            if not header.record.matches(record.digest):
                raise FrameError(Rejection.FOREIGN_TOKENS)
        except FrameError as err:
            reader.skip(length - HEADER_BYTES)
            self._stats.add(**{err.why.value: 1})
            return False
        return self._receive_payload(header, reader, memoryview(out.numpy()))

    def _receive_payload(self, header: Header, reader: RespReader, payload: memoryview) -> bool:
        mac = self._framer.payload_mac(header)
        for at in range(0, len(payload), MAC_STEP):
            piece = payload[at : at + MAC_STEP]
            reader.read_into(piece)
            mac.update(piece)
        try:
            self._framer.verify_tag(header, mac.tag())
        except FrameError as err:
            self._stats.add(**{err.why.value: 1})
            return False
        return True
