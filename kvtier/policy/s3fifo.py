"""S3-FIFO (Yang et al., SOSP'23): a small probation FIFO in front of a main FIFO.

Most blocks of a KV cache are used once (a prompt nobody repeats); S3-FIFO
lets them leave from the small queue quickly, while blocks that prove
themselves there move to the main queue, which behaves like a 2-bit CLOCK.
"""

from __future__ import annotations

from collections import ChainMap, OrderedDict, deque
from collections.abc import Container, MutableMapping
from typing import Protocol

from kvtier.keys import BlockKey
from kvtier.policy.base import EvictionPolicy, PolicyName, register

MAX_FREQ = 3
"""The paper's two-bit access counter saturates here."""

PROMOTE_ABOVE = 1
"""A key leaving the small queue moves to main when its counter exceeds this.

Counters start at 0 on insert, so the key must have been hit twice while in
the small queue. This follows the paper's Algorithm 1 (``if t.freq > 1``);
some descriptions, such as libCacheSim's source comments, say "accessed at
all" (``> 0``) instead.
"""

SMALL_SHARE = 0.1


def small_target(resident: int) -> int:
    """The small queue's share of the resident keys: 10%, at least 1.

    The policy never learns the tier's capacity, so the share follows the
    current number of resident keys instead of a fixed cache size. Eviction
    takes from small while small holds *more* than this (or main has nothing
    to give), so a lone small key outlives a main that still has candidates.
    """
    return max(1, int(resident * SMALL_SHARE))


class _Queue(Protocol):
    def pop_tail(self) -> BlockKey: ...
    def push_head(self, key: BlockKey) -> None: ...
    def __len__(self) -> int: ...


class _Fifo(OrderedDict[BlockKey, None]):
    """A FIFO that iterates tail (next to leave) first and also deletes by key in O(1)."""

    def pop_tail(self) -> BlockKey:
        return self.popitem(last=False)[0]

    def push_head(self, key: BlockKey) -> None:
        self[key] = None


class _DryFifo:
    """Reads through to a real :class:`_Fifo` without changing it, so a dry run costs O(keys moved)."""

    def __init__(self, real: _Fifo) -> None:
        self._rest, self._left = iter(real), len(real)
        self._pushed: deque[BlockKey] = deque()

    def pop_tail(self) -> BlockKey:
        if self._left:
            self._left -= 1
            return next(self._rest)
        return self._pushed.popleft()

    def push_head(self, key: BlockKey) -> None:
        self._pushed.append(key)

    def __len__(self) -> int:
        return self._left + len(self._pushed)


def _live(fifo: _Fifo, exclude: Container[BlockKey]) -> int:
    return sum(k not in exclude for k in fifo) if exclude else len(fifo)


class _Queues:
    """Queues and counters, and the one eviction step that the real and the dry run share.

    ``live_*`` count the keys the step may evict (the non-excluded ones).
    """

    def __init__(self, small: _Queue, main: _Queue, freq: MutableMapping[BlockKey, int], live: tuple[int, int]):
        self.small, self.main, self.freq = small, main, freq
        self.live_small, self.live_main = live

    def evict(self, exclude: Container[BlockKey]) -> tuple[BlockKey, bool]:
        """Move keys until one that is not excluded leaves: ``(key, it left the small queue)``.

        Requires ``live_small + live_main > 0``; the evicted key's counter is
        left for the caller to drop. Excluded keys are kept, never lost: one
        at the small tail moves to main (so a small queue of excluded keys
        drains), one at the main tail goes back to its head. Termination:
        the small loop shrinks small, and each main pass lowers a live counter.
        """
        resident = len(self.small) + len(self.main)
        if self.live_small and (len(self.small) > small_target(resident) or not self.live_main):
            while self.live_small:
                key = self.small.pop_tail()
                if key in exclude or self.freq[key] > PROMOTE_ABOVE:
                    self.main.push_head(key)
                    if key not in exclude:
                        self.freq[key] = 0  # access bits are cleared on the move
                        self.live_small, self.live_main = self.live_small - 1, self.live_main + 1
                else:
                    self.live_small -= 1
                    return key, True
        while True:
            key = self.main.pop_tail()
            if key in exclude or self.freq[key]:
                self.main.push_head(key)
                if key not in exclude:
                    self.freq[key] -= 1
            else:
                self.live_main -= 1
                return key, False


@register(PolicyName.S3FIFO)
class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO over the resident keys, with a ghost queue for quick readmission.

    Insert goes to the small queue, or straight to main if the key is in the
    ghost queue (it was evicted from small recently, so it is not one-hit).
    ``victims`` runs the eviction steps dry, over read-through views of the
    queues, in O(keys moved) (plus one O(N) pass to count what ``exclude``
    leaves). ``on_remove(key)`` dry-runs one step too: if ``key`` is what it
    evicts, the step is replayed on the real queues (its promotions and
    counter decrements happen) and a key evicted from small enters the ghost
    queue, so ``victims(1)`` + ``on_remove`` cycles run the textbook
    algorithm. Any other removal just deletes the key from its queue. The
    ghost queue is bounded by main's share (90%) of the resident keys, the
    analogue of the paper's "as many ghosts as M holds" when M is full.
    Inserting a resident key again counts as an access.
    """

    def __init__(self) -> None:
        self._small, self._main, self._ghost = _Fifo(), _Fifo(), _Fifo()
        self._freq: dict[BlockKey, int] = {}

    def _dry_run(self, exclude: Container[BlockKey]) -> _Queues:
        live = (_live(self._small, exclude), _live(self._main, exclude))
        return _Queues(_DryFifo(self._small), _DryFifo(self._main), ChainMap({}, self._freq), live)

    def on_insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        if key in self._freq:
            self.on_access(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            self._main.push_head(key)
        else:
            self._small.push_head(key)
        self._freq[key] = 0

    def on_access(self, key: BlockKey) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def on_remove(self, key: BlockKey) -> None:
        if key not in self._freq:
            return
        if self._dry_run(frozenset()).evict(frozenset())[0] != key:
            del (self._small if key in self._small else self._main)[key]
            del self._freq[key]
            return
        real = _Queues(self._small, self._main, self._freq, (len(self._small), len(self._main)))
        _, from_small = real.evict(frozenset())
        del self._freq[key]
        if from_small:
            self._remember(key)

    def _remember(self, key: BlockKey) -> None:
        self._ghost.push_head(key)
        resident = len(self)
        while len(self._ghost) > max(1, resident - small_target(resident)):
            self._ghost.pop_tail()

    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        dry = self._dry_run(exclude)
        out: list[BlockKey] = []
        while len(out) < n and dry.live_small + dry.live_main:
            out.append(dry.evict(exclude)[0])
        return out

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
