"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from itertools import islice

from kvtier.keys import BlockKey
from kvtier.policy.base import EvictionPolicy, PolicyName, register


@register(PolicyName.LRU)
class LRUPolicy(EvictionPolicy):
    """Evicts the key whose last insert or access is oldest.

    The ``OrderedDict`` is the recency list (oldest first), so every event is
    O(1) and ``victims(n)`` only walks the first ``n`` keys plus any excluded
    ones it has to skip. Inserting a resident key again counts as an access.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def on_insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        return list(islice((k for k in self._order if k not in exclude), max(n, 0)))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order
