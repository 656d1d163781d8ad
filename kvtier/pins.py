"""What eviction must leave alone: blocks being read, and blocks an operator asked to keep.

Two kinds of pin, kept apart because they promise different things. A read
pin guards bytes being copied (a load, a write-through, a flush): it is
counted, so two readers of one block each hold it, and the block may go
once the last lets go. A TTL pin is a retention promise with an expiry (a
shared system prompt kept warm whatever the traffic): set again, it moves
the expiry; it covers keys whether or not they are cached yet.

A TTL pin names the tier it protects: host memory (a prefix kept warm) or
an owned tier under it (disk: a prefix kept for a day, which host may
drop and promote again). The pins of one tier never protect a block in
another, so a day-long disk promise does not fill host memory, and letting
a host promise go leaves the disk one standing. Read pins are host-only:
host is where every block being copied sits.

Not thread-safe on its own: the manager calls it with its lock held, the
same lock under which eviction reads :meth:`Pins.exclude`.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Container, Iterable

from kvtier.keys import BlockKey
from kvtier.tiers.base import TierKind

MAX_TTL_S = 31 * 86400.0
"""The longest TTL pin an admin route or the fleet API takes (a server caps it further: ``server.max_pin_ttl_s``)."""


class PinTier(enum.StrEnum):
    """The tiers a TTL pin can keep blocks in: the ones a node evicts by its own policy (the remote is shared)."""

    HOST = "host"
    DISK = "disk"


class Pins:
    def __init__(self, clock: Callable[[], float]) -> None:
        """``clock`` tells the time TTL pins expire by (tests step it instead of sleeping)."""
        self._reads: Counter[BlockKey] = Counter()
        self._ttl: dict[TierKind, dict[BlockKey, float]] = {}  # tier -> key -> expiry on self._clock
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
    def keep(self, keys: Iterable[BlockKey], ttl_s: float, kind: TierKind) -> list[BlockKey]:
        """Keep ``keys`` in the tier of ``kind`` for ``ttl_s`` seconds from now (``ttl_s=0`` lets them go).

        Expiry is lazy. Setting a pin again moves its expiry either way: the
        longest promise over a block is its caller's to keep (the server's
        retention registry pins the longest last). Returns the keys this
        promise newly covers (no live pin of any tier held them): a renewed
        promise has had its blocks written through already.
        """
        if ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")
        self._expire()
        keys = list(keys)
        fresh = [k for k in keys if not any(k in pins for pins in self._ttl.values())] if ttl_s > 0 else []
        self._ttl.setdefault(kind, {}).update(dict.fromkeys(keys, self._clock() + ttl_s))
        self._expire()
        return fresh

    def kept(self) -> int:
        """Keys under a live TTL pin of any tier (cached or not)."""
        self._expire()
        return len(set().union(*self._ttl.values()))

    def kept_among(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Those of ``keys`` under a live TTL pin of any tier: the blocks someone promised to keep."""
        self._expire()
        if not any(self._ttl.values()):
            return []
        return [k for k in keys if any(k in pins for pins in self._ttl.values())]

    def _expire(self) -> None:
        now = self._clock()
        for pins in self._ttl.values():
            for key in [k for k, until in pins.items() if until <= now]:
                del pins[key]

    # -- what eviction asks ---------------------------------------------------------------
    def exclude(self, kind: TierKind) -> Container[BlockKey]:
        """Keys eviction from the tier of ``kind`` must skip: its live TTL pins, and in host the read pins too."""
        ttl = self._ttl.get(kind)
        if ttl:
            self._expire()
        if kind is not TierKind.HOST:
            return ttl.keys() if ttl else frozenset()
        if not ttl:
            return self._reads
        return self._reads.keys() | ttl.keys()
