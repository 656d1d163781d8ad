"""What eviction must leave alone: blocks being read, and blocks an operator asked to keep.

Two kinds of pin, kept apart because they promise different things. A read
pin guards bytes being copied (a load, a write-through, a flush): it is
counted, so two readers of one block each hold it, and the block may go
once the last lets go. A TTL pin is a retention promise with an expiry (a
shared system prompt kept warm whatever the traffic): set again, it moves
the expiry; it covers keys whether or not they are cached yet.

Not thread-safe on its own: the manager calls it with its lock held, the
same lock under which eviction reads :meth:`Pins.exclude`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterable

from kvtier.keys import BlockKey


class Pins:
    def __init__(self, clock: Callable[[], float]) -> None:
        """``clock`` tells the time TTL pins expire by (tests step it instead of sleeping)."""
        self._reads: Counter[BlockKey] = Counter()
        self._ttl: dict[BlockKey, float] = {}  # key -> expiry on self._clock
        self._clock = clock

    # -- read pins --------------------------------------------------------------------
    def pin(self, keys: Iterable[BlockKey]) -> None:
        self._reads.update(keys)

    def unpin(self, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            self._reads[key] -= 1
            if self._reads[key] <= 0:
                del self._reads[key]

    def count(self, key: BlockKey) -> int:
        return self._reads.get(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._reads

    def __len__(self) -> int:
        """Blocks under at least one read pin."""
        return len(self._reads)

    # -- TTL pins -----------------------------------------------------------------------
    def keep(self, keys: Iterable[BlockKey], ttl_s: float) -> None:
        """Keep ``keys`` for ``ttl_s`` seconds from now (``ttl_s=0`` lets them go); expiry is lazy."""
        if ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")
        self._ttl.update(dict.fromkeys(keys, self._clock() + ttl_s))
        self._expire()

    def kept(self) -> int:
        """Keys under a live TTL pin (cached or not)."""
        self._expire()
        return len(self._ttl)

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, until in self._ttl.items() if until <= now]:
            del self._ttl[key]

    # -- what eviction asks ---------------------------------------------------------------
    def exclude(self) -> Container[BlockKey]:
        """Host keys eviction must skip: read pins, then live TTL pins."""
        if not self._ttl:
            return self._reads
        self._expire()
        return self._reads.keys() | self._ttl.keys()
