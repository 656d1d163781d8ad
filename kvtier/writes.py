"""Where a block is written, and when: the one place that decides on ``cache.write_mode`` and ``remote.write_on``.

Two moments put bytes below host memory: a block is **stored** (the engine
computed it) and a block is **evicted** from host (it outgrew host memory);
a clean **close** is a third for whatever host alone still holds, and a
block being **retained** (under a TTL pin: a client was promised it is
kept) is a fourth. Which
tiers get a copy at each moment is policy; copying it there is mechanism
(:mod:`kvtier.store` and :mod:`kvtier.evict`), which asks this module and
never the config. So a new mode (say, write-through for sessions only) is a
change here alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.config import RemoteWriteOn, WriteMode
from kvtier.tiers.base import TierKind


class Moment(enum.StrEnum):
    STORED = "stored"  # committed to host by the engine
    EVICTED = "evicted"  # leaving host memory to make room
    CLOSED = "closed"  # still in host alone when the cache closes
    RETAINED = "retained"  # promised to be kept (a TTL pin), whether stored before the promise or after it


@dataclass(frozen=True)
class WritePolicy:
    """Which tiers below host take a copy of a block at each :class:`Moment`."""

    mode: WriteMode
    remote_on: RemoteWriteOn | None  # None: no remote tier

    def copies(self, kind: TierKind, moment: Moment) -> bool:
        """Whether the tier of ``kind`` under host takes a copy of a block at ``moment``.

        Disk: write-through copies at store; write-back at eviction and on
        close (so a clean restart keeps them); either mode at retain: a
        promise to keep a block is written through at once, since a crash
        or a day's host pressure must not break it, and a write-back copy
        would wait for an eviction. The remote: ``remote.write_on``, every
        stored block or only those host evicts, never on close (behind no
        request) nor at retain (its blocks expire by Redis's TTL, not ours:
        no promise of ours holds there).
        """
        if moment is Moment.RETAINED:
            return kind is TierKind.DISK
        if kind is TierKind.DISK:
            if self.mode is WriteMode.WRITE_THROUGH:
                return moment is Moment.STORED
            return moment in (Moment.EVICTED, Moment.CLOSED)
        if kind is TierKind.REMOTE and self.remote_on is not None:
            wanted = Moment.STORED if self.remote_on is RemoteWriteOn.STORE else Moment.EVICTED
            return moment is wanted
        return False
