"""Least frequently used, ties broken by least recent use."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator
from itertools import islice

from kvtier.keys import BlockKey
from kvtier.policy.base import EvictionPolicy, PolicyName, register


@register(PolicyName.LFU)
class LFUPolicy(EvictionPolicy):
    """Evicts the key with the fewest uses; among equals, the one used longest ago.

    An insert counts as one use and each access adds one (inserting a resident
    key again is an access). Keys live in one bucket per use count, and a use
    moves a key to the end of the next bucket, so each bucket is ordered by
    last use without storing a clock: the logical time is the bucket order.
    Events are O(1) and ``victims(n)`` costs O(B log B + n + skipped excluded
    keys) for B distinct counts, which does not grow with the number of
    resident keys.
    """

    def __init__(self) -> None:
        self._uses: dict[BlockKey, int] = {}
        self._buckets: dict[int, OrderedDict[BlockKey, None]] = {}

    def _move(self, key: BlockKey, uses: int) -> None:
        old = self._uses.get(key)
        if old is not None:
            self._unlink(key, old)
        self._uses[key] = uses
        self._buckets.setdefault(uses, OrderedDict())[key] = None

    def _unlink(self, key: BlockKey, uses: int) -> None:
        bucket = self._buckets[uses]
        del bucket[key]
        if not bucket:
            del self._buckets[uses]

    def on_insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        self._move(key, self._uses.get(key, 0) + 1)

    def on_access(self, key: BlockKey) -> None:
        if key in self._uses:
            self._move(key, self._uses[key] + 1)

    def on_remove(self, key: BlockKey) -> None:
        uses = self._uses.pop(key, None)
        if uses is not None:
            self._unlink(key, uses)

    def _ranked(self) -> Iterator[BlockKey]:
        for uses in sorted(self._buckets):
            yield from self._buckets[uses]

    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        return list(islice((k for k in self._ranked() if k not in exclude), max(n, 0)))

    def __len__(self) -> int:
        return len(self._uses)

    def __contains__(self, key: object) -> bool:
        return key in self._uses
