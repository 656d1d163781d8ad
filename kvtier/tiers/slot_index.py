"""The local tiers' index of their blocks, in C: key → slot and record bytes, and a recency list over slots.

Both local tiers index their blocks in a :data:`SlotIndex`
(``native/slot_index.c``): keys and records in arrays by slot and an
open-addressing table, so a block indexed costs bytes, not Python objects.
:data:`CONFIRMED` turns its ``confirm`` answer into :meth:`Tier.confirm`'s.
It also keeps two links a slot for a recency list over what the tier holds. :class:`SlotRecency` is that list as
:class:`kvtier.policy.base.Recency`: an LRU policy given it keeps its order
there instead of holding every key again in a dict of its own. The policy
says who is on the list and where; the tier only takes a block off when it
drops the block, so the list never names a slot the tier does not hold.
"""

from __future__ import annotations

from kvtier.extension import io
from kvtier.keys import KEY_BYTES, BlockKey

SlotIndex = io.SlotIndex
"""``SlotIndex(capacity, record_bytes)``: native/README.md lists its methods."""
CONFIRMED = (False, True, None)
"""``SlotIndex.confirm``'s answer (0, 1, or -1 when the key is absent), indexed, as ``Tier.confirm``'s."""


class SlotRecency:
    """The recency list of a slot index (:class:`kvtier.policy.base.Recency`); changed under the tier's lock."""

    def __init__(self, slots: SlotIndex) -> None:
        self._slots = slots

    def enter(self, key: BlockKey) -> None:
        """Put an indexed ``key`` at the most recent end (moving it there if it is on the list already)."""
        self._slots.enter(key)

    def touch(self, key: BlockKey) -> None:
        """Move ``key`` to the most recent end if it is on the list."""
        self._slots.touch(key)

    def leave(self, key: BlockKey) -> None:
        """Take ``key`` off the list; it stays indexed."""
        self._slots.leave(key)

    def ranks(self, key: object) -> bool:
        return isinstance(key, bytes) and len(key) == KEY_BYTES and self._slots.is_linked(key)

    def ranked(self) -> int:
        return self._slots.linked

    def oldest(self, n: int, skip: int = 0) -> list[BlockKey]:
        """Up to ``n`` keys from the least recent end, after the first ``skip``: a snapshot of that window."""
        return self._slots.oldest(n, skip)
