"""Prefix-aware LRU: a block leaves before the blocks its key was chained from."""

from __future__ import annotations

import heapq
from collections.abc import Container

from kvtier.keys import BlockKey
from kvtier.policy.base import EvictionPolicy, PolicyName, register


@register(PolicyName.PREFIX_LRU)
class PrefixLRUPolicy(EvictionPolicy):
    """LRU restricted to leaves: keys none of whose children are resident here.

    A block is only reachable through its prefix, so evicting a parent while
    a child stays strands the child; evicting leaves first keeps every
    resident chain a contiguous prefix. Once a leaf goes, its parent may
    become a leaf and then competes by its own recency, so a chain a→b→c
    leaves as c, b, a even when a is the least recently used.

    ``_children`` counts resident children per parent key, whether or not the
    parent itself is resident (a child may arrive before, or outlive, its
    parent in this tier). ``victims`` replays that unwinding on a heap of
    leaves without touching this state. An excluded key is never returned and
    keeps its ancestors in place as long as anything else can go; only then
    is the least recent excluded leaf set aside, unblocking its parent, so the
    answer still covers every key that is not excluded. Keys must form a
    forest, which chained hashes guarantee. Inserting a resident key again
    counts as an access.
    """

    def __init__(self) -> None:
        self._tick: dict[BlockKey, int] = {}
        self._parent: dict[BlockKey, BlockKey | None] = {}
        self._children: dict[BlockKey, int] = {}
        self._clock = 0

    def _touch(self, key: BlockKey) -> None:
        self._clock += 1
        self._tick[key] = self._clock

    def on_insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key not in self._tick:
            self._parent[key] = parent
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
        self._touch(key)

    def on_access(self, key: BlockKey) -> None:
        if key in self._tick:
            self._touch(key)

    def on_remove(self, key: BlockKey) -> None:
        if self._tick.pop(key, None) is None:
            return
        parent = self._parent.pop(key)
        if parent is not None:
            self._children[parent] -= 1
            if not self._children[parent]:
                del self._children[parent]

    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        def entry(k: BlockKey) -> tuple[bool, int, BlockKey]:
            return (k in exclude, self._tick[k], k)  # excluded leaves sort after every other leaf

        heap = [entry(k) for k in self._tick if k not in self._children]
        heapq.heapify(heap)
        children_left: dict[BlockKey, int] = {}
        out: list[BlockKey] = []
        while heap and len(out) < n:
            excluded, _, key = heapq.heappop(heap)
            if not excluded:
                out.append(key)
            parent = self._parent[key]
            if parent is not None and parent in self._tick:
                left = children_left.get(parent, self._children[parent]) - 1
                children_left[parent] = left
                if not left:
                    heapq.heappush(heap, entry(parent))
        return out

    def __len__(self) -> int:
        return len(self._tick)

    def __contains__(self, key: object) -> bool:
        return key in self._tick
