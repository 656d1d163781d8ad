"""The tiers one manager runs, in order, and the one lock their metadata changes under.

Lookup, fetch, store and eviction each work on the same tiers and must
agree on one order and one lock: a block is reserved, committed, pinned or
evicted only under :attr:`TierSet.lock`, while payload copies run outside
it.

Host memory has a role no other tier has: it is where blocks are staged.
Every stored block is written into a host slot, every block below host is
read back into one, and the engine copies from there. The tiers under it
are a list, fastest first, in two kinds: tiers this node **owns** (disk:
its policy evicts, its index is ours) and **shared** ones (the remote:
other nodes write it, no policy of ours runs, its records come from a
probe, its writes go to a queue). Code that moves blocks walks those lists;
no module below the manager names a tier below host.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import Config
from kvtier.errors import DiskUnavailableError
from kvtier.keys import BlockKey, Secret
from kvtier.layout import KVLayout
from kvtier.stats import RemoteSnapshot, TierSnapshot, TierStats
from kvtier.tiers.base import BlockRecord, SharedTier, Tier, TierKind
from kvtier.tiers.disk import DiskTier, io_mode_for
from kvtier.tiers.host import HostTier
from kvtier.tiers.remote import RemoteTier

log = logging.getLogger("kvtier")


@dataclass
class TierSet:
    """Fixed at construction: the tier lists below are computed once (every lookup walks them)."""

    host: HostTier  # the staging tier
    owned: tuple[Tier, ...] = ()  # under host, fastest first, evicted by this node's policies
    shared: tuple[SharedTier, ...] = ()  # under those, shared with other nodes
    lock: threading.RLock = field(default_factory=threading.RLock)

    @functools.cached_property
    def local(self) -> list[Tier]:
        """Host, then the owned tiers: the tiers this node evicts from."""
        return [self.host, *self.owned]

    @functools.cached_property
    def every(self) -> list[Tier]:
        """The local tiers, fastest first, then the shared ones."""
        return [*self.local, *self.shared]

    @functools.cached_property
    def below_host(self) -> list[Tier]:
        """The tiers a block is promoted from or copied down to, in the order they are asked."""
        return [*self.owned, *self.shared]

    def find(self, kind: TierKind) -> Tier | None:
        """The tier of ``kind``, where this set runs one (operators and reports; the data path walks the lists)."""
        return next((t for t in self.every if t.kind is kind), None)

    def stats(self, kind: TierKind) -> TierStats:
        return next(t.stats for t in self.every if t.kind is kind)

    def record(self, key: BlockKey) -> BlockRecord | None:
        """The record of the fastest local tier that holds ``key`` (call with the lock held)."""
        for tier in self.local:
            record = tier.record(key)
            if record is not None:
                return record
        return None

    def holder_below_host(self, key: BlockKey) -> tuple[Tier, BlockRecord] | None:
        """The fastest tier under host that holds ``key`` (an owned tier, then what a shared one's probe saw)."""
        for tier in self.below_host:
            record = tier.record(key)
            if record is not None:
                return tier, record
        return None

    def report(self) -> dict[str, TierSnapshot | RemoteSnapshot]:
        """Each tier's counters and occupancy, by tier name (a shared tier reports its own: no sizes of ours)."""
        out: dict[str, TierSnapshot | RemoteSnapshot] = {}
        for tier in self.local:
            out[tier.kind.value] = tier.stats.snapshot(
                capacity_bytes=tier.capacity_blocks * tier.slot_bytes,
                used_bytes=(tier.capacity_blocks - tier.free_blocks()) * tier.slot_bytes,
                blocks=len(tier),
                capacity_blocks=tier.capacity_blocks,
                withheld_blocks=self.host.withheld_blocks if tier is self.host else 0,
            )
        for shared in self.shared:
            out[shared.kind.value] = shared.snapshot()
        return out


def open_tiers(
    config: Config, layout: KVLayout, secret: Secret, model_fingerprint: str, host_file: Path | None = None
) -> TierSet:
    """The tiers ``config`` asks for: host always; disk and remote when enabled (see the helpers for what may fail)."""
    host = HostTier(layout, int(config.host.capacity_bytes), shared_file=host_file)
    disk = _open_disk(config, layout, model_fingerprint) if config.disk.enabled else None
    remote = _open_remote(config, layout, secret, model_fingerprint) if config.remote.enabled else None
    return TierSet(host, () if disk is None else (disk,), () if remote is None else (remote,))


def _open_disk(config: Config, layout: KVLayout, model_fingerprint: str) -> DiskTier | None:
    """The disk tier, or None (said once in the log) where its directory cannot be created or written.

    A read-only or unwritable disk path costs persistence, not service:
    host memory still caches. A disk tier held by another process, or
    damaged under ``disk.on_corrupt: error``, still stops the start.
    """
    cfg = config.disk
    try:
        return DiskTier(
            config.disk_path,
            layout,
            int(cfg.capacity_bytes),
            model_fingerprint=model_fingerprint,
            file_bytes=int(cfg.file_bytes),
            fsync=cfg.fsync,
            on_mismatch=cfg.on_mismatch,
            on_corrupt=cfg.on_corrupt,
            io_mode=io_mode_for(cfg.io),
        )
    except DiskUnavailableError as err:
        log.warning("%s; running without the disk tier (host memory only)", err)
        return None


def _open_remote(config: Config, layout: KVLayout, secret: Secret, model_fingerprint: str) -> RemoteTier:
    """The shared tier; a Redis that is down at start costs misses (and a breaker), never the start."""
    if not secret.persistent:
        log.warning("the remote tier needs a key secret every node shares; this one is process-local")
    return RemoteTier.open(config.remote, layout, secret, model_fingerprint)
