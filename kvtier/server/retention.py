"""Prefixes that clients were promised are kept, per tenant and per tier, within each tenant's quotas.

A promise keeps a prompt's prefix in one tier for a TTL from its last use:
a ``cache_control`` mark (``POST /v1/messages``) in host memory for five
minutes or an hour; OpenAI's ``prompt_cache_retention: "24h"`` on disk for
a day. The cache keeps it with a TTL pin on that tier
(:meth:`kvtier.cache.Cache.pin_for`), which eviction skips whatever another
client sends, and writes the prefix through to disk either way. This
registry is the account behind those pins, so that a promise cannot grow
without bound and one tenant cannot take another's room. Each tier's
promises are accounted apart, with the tenant's own quota there
(:func:`retain_quota`); within one tier:

* each tenant's kept prefixes are remembered, oldest use first, with when
  their promise ends;
* a tenant may keep ``retain_bytes`` of blocks in host memory and
  ``retain_disk_bytes`` on disk (its own limits, or the server's); past
  one, its oldest prefix in that tier is let go (unpinned), then the next,
  never another tenant's: tenants' prefixes never share a block (their
  namespaces differ), so one tenant's release cannot touch another's;
* a block under several live prefixes is kept for the longest of their
  promises: releasing a prefix pins the tenant's other live ones again.

What is let go is not evicted at once: it becomes ordinary cache again.
A prefix kept in both tiers (marked, and retained for a day) holds two
promises; letting one go leaves the other standing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.cache import Cache
from kvtier.config import Config
from kvtier.keys import BlockKey, KeyedTokens
from kvtier.tiers.base import TierKind

RETAINING = (TierKind.HOST, TierKind.DISK)
"""The tiers a promise can name: those the cache evicts by its own policy."""


def retain_quota(config: Config, tenant: str, tier: TierKind) -> int:
    """The bytes ``tenant``'s promises may keep in ``tier``: its own limit, the server's, or half the tier (0: none)."""
    for limits in (config.server.tenants.get(tenant), config.server):
        own = None if limits is None else (limits.retain_disk_bytes if tier is TierKind.DISK else limits.retain_bytes)
        if own is not None:
            return int(own)
    if tier is TierKind.DISK:
        return int(config.disk.capacity_bytes) // 2 if config.disk.enabled else 0
    return int(config.host.capacity_bytes) // 2


@dataclass
class _Kept:
    prefix: KeyedTokens
    until: float  # on the registry's clock
    ttl_s: float  # what each use renews it for


@dataclass(frozen=True)
class TenantRetention:
    """One tenant's promises in one tier now: distinct blocks kept, their bytes, and the prefixes that keep them."""

    blocks: int
    bytes: int
    prefixes: int
    quota_bytes: int


_Prefixes = OrderedDict[tuple[BlockKey, ...], _Kept]  # one tenant's in one tier, least recently used first


class Retention:
    def __init__(
        self,
        cache: Cache,
        quota_bytes: Callable[[str, TierKind], int],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``quota_bytes(tenant name, tier)``: the bytes that tenant's promises may keep in that tier."""
        self._cache = cache
        self._quota = quota_bytes
        self._clock = clock
        self._block_bytes = cache.layout.block_bytes
        self._kept: dict[tuple[str, TierKind], _Prefixes] = {}
        self._lock = threading.Lock()  # request handlers keep prefixes from worker threads

    def lasting_tier(self) -> TierKind:
        """Where a promise of a day is kept: disk, where the cache runs one; else host memory, under its quota.

        A day is longer than host memory should be held for a prompt, and
        disk is where the cache keeps blocks across host pressure (and a
        restart); a node without a disk tier still keeps the promise, in
        the only tier it has.
        """
        return TierKind.DISK if any(t.kind is TierKind.DISK for t in self._cache.tiers) else TierKind.HOST

    def keep(self, tenant: str, marks: list[tuple[KeyedTokens, float]], tier: TierKind = TierKind.HOST) -> list[bool]:
        """Keep each ``(prefix, ttl_s)`` of one request in ``tier`` for its TTL from now; which ones are kept.

        A promise is never shortened: a prefix kept already keeps the later
        of its two ends. A prefix whose blocks alone exceed the tenant's quota
        in that tier is not kept; otherwise the tenant's least recently used
        prefixes there are let go until the quota holds.
        """
        if tier not in RETAINING:
            raise ValueError(f"a promise keeps blocks in host or disk, not {tier.value}")
        quota = self._quota(tenant, tier) // self._block_bytes
        with self._lock:
            now = self._clock()
            kept = self._kept.setdefault((tenant, tier), OrderedDict())
            self._expire(kept, now)
            for prefix, ttl_s in marks:
                if not prefix.keys or len(prefix.keys) > quota:
                    continue
                name = tuple(prefix.keys)
                before = kept.pop(name, None)
                until, ttl = (before.until, max(before.ttl_s, ttl_s)) if before else (now, ttl_s)
                kept[name] = _Kept(prefix, max(now + ttl_s, until), ttl)  # the newest use, last
            while self._blocks(kept) > quota:
                _, oldest = kept.popitem(last=False)
                self._cache.pin_for(oldest.prefix, 0, tier=tier)
            self._pin(kept, now, tier)
            return [tuple(p.keys) in kept if p.keys else False for p, _ in marks]

    def holds(self, tenant: str) -> bool:
        """Whether ``tenant`` keeps anything (a cheap look before :meth:`used`)."""
        return any(self._kept.get((tenant, tier)) for tier in RETAINING)

    def used(self, tenant: str, prompt: KeyedTokens) -> int:
        """A request of ``tenant`` sent ``prompt``: each kept prefix it starts with is renewed; how many.

        Using a kept prefix refreshes its promise, as a mark on it would: its
        TTL runs again from now (never shortened) and it becomes the tenant's
        most recently used, the last to go past the quota.
        """
        keys = prompt.keys
        renewed = 0
        with self._lock:
            now = self._clock()
            for tier in RETAINING:
                kept = self._kept.get((tenant, tier))
                if not kept:
                    continue
                self._expire(kept, now)
                hits = [name for name in kept if len(name) <= len(keys) and tuple(keys[: len(name)]) == name]
                for name in hits:
                    k = kept.pop(name)
                    kept[name] = _Kept(k.prefix, max(k.until, now + k.ttl_s), k.ttl_s)
                if hits:
                    self._pin(kept, now, tier)
                    renewed += len(hits)
        return renewed

    def pin_again(self, tenant: str, tier: TierKind) -> None:
        """Pin ``tenant``'s live promises in ``tier`` again, each to its own end.

        After an operator unpinned a prefix of this tenant (``/admin/pin``
        with ``ttl_s`` 0, as ``kvtier route`` releases a fleet pin): the
        cache unpins keys whoever pinned them, and a promise sharing some of
        them must not end with that.
        """
        with self._lock:
            kept = self._kept.get((tenant, tier))
            if kept:
                now = self._clock()
                self._expire(kept, now)
                self._pin(kept, now, tier)

    def report(self) -> dict[str, dict[TierKind, TenantRetention]]:
        """Every tenant that keeps something now, by the tiers it keeps something in."""
        with self._lock:
            now = self._clock()
            out: dict[str, dict[TierKind, TenantRetention]] = {}
            for (tenant, tier), kept in self._kept.items():
                self._expire(kept, now)
                if kept:
                    blocks = self._blocks(kept)
                    quota = self._quota(tenant, tier)
                    out.setdefault(tenant, {})[tier] = TenantRetention(
                        blocks, blocks * self._block_bytes, len(kept), quota
                    )
            return out

    @staticmethod
    def _blocks(kept: _Prefixes) -> int:
        return len({k for name in kept for k in name})

    @staticmethod
    def _expire(kept: _Prefixes, now: float) -> None:
        """Promises past their TTL end by themselves (their pins expire in the cache at the same moment)."""
        for name in [n for n, k in kept.items() if k.until <= now]:
            del kept[name]

    def _pin(self, kept: _Prefixes, now: float, tier: TierKind) -> None:
        """Pin the tenant's live prefixes in ``tier``, the longest promise last, so a block keeps the longest one.

        Prefixes of one conversation share their leading blocks; pinning them
        in any other order (or releasing one) would cut another's promise short.
        """
        for k in sorted(kept.values(), key=lambda k: k.until):
            self._cache.pin_for(k.prefix, k.until - now, tier=tier)


__all__ = ["RETAINING", "Retention", "TenantRetention", "retain_quota"]
