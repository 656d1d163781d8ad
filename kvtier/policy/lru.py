"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable
from itertools import islice

from kvtier.keys import BlockKey
from kvtier.policy.base import EvictionPolicy, PolicyName, Recency, register
from kvtier.tiers.base import BlockRecord


@register(PolicyName.LRU)
class LRUPolicy(EvictionPolicy):
    """Evicts the key whose last insert or access is oldest.

    The ``OrderedDict`` is the recency list (oldest first), so every event is
    O(1) and ``victims(n)`` only walks the first ``n`` keys plus any excluded
    ones it has to skip. Inserting a resident key again counts as an access.

    Over a tier that keeps a recency list for it (:meth:`load` is given one:
    both local tiers keep one), the policy keeps its order there and nothing per key
    here: the same events move the same keys, so the victims are the same;
    at ten million blocks, the dict and its keys would cost more than the
    tier's whole index.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()
        self._tier: Recency | None = None

    def load(self, held: Iterable[tuple[BlockKey, BlockRecord]], recency: Recency | None = None) -> None:
        if recency is not None and not self._order:
            self._tier = recency  # every block held is on it already, in store order
        else:
            super().load(held)

    def on_insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if self._tier is not None:
            self._tier.enter(key)
            return
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: BlockKey) -> None:
        if self._tier is not None:
            self._tier.touch(key)
        elif key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: BlockKey) -> None:
        if self._tier is not None:
            self._tier.leave(key)
        else:
            self._order.pop(key, None)

    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        if self._tier is None:
            return list(islice((k for k in self._order if k not in exclude), max(n, 0)))
        out: list[BlockKey] = []
        seen = 0
        while len(out) < n:  # the tier's list a window at a time: each window is one snapshot
            window = self._tier.oldest(max(64, 2 * (n - len(out))), seen)
            if not window:
                break
            seen += len(window)
            out.extend(islice((k for k in window if k not in exclude), n - len(out)))
        return out

    def __len__(self) -> int:
        return len(self._order) if self._tier is None else self._tier.ranked()

    def __contains__(self, key: object) -> bool:
        return key in self._order if self._tier is None else self._tier.ranks(key)
