"""Prefixes that ``cache_control`` marks promised to keep, per tenant, within each tenant's quota.

A mark is a promise: the prompt up to it stays in host memory for the
mark's TTL from its last use. The cache keeps it with a TTL pin
(:meth:`kvtier.cache.Cache.pin_for`), which eviction skips whatever
another client sends; this registry is the account behind those pins, so
that a promise cannot grow without bound and one tenant cannot take host
memory from another:

* each tenant's kept prefixes are remembered, oldest use first, with when
  their promise ends;
* a tenant may keep ``retain_bytes`` of blocks (its own limit, or the
  server's); past it, its oldest prefix is let go (unpinned), then the next,
  never another tenant's: tenants' prefixes never share a block (their
  namespaces differ), so one tenant's release cannot touch another's;
* a block under several live prefixes is kept for the longest of their
  promises: releasing a prefix pins the tenant's other live ones again.

What is let go is not evicted at once: it becomes ordinary cache again.
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


def retain_quota(config: Config, tenant: str) -> int:
    """The host bytes ``tenant``'s marks may keep: its own limit, the server's, or half the host tier."""
    own = config.server.tenants.get(tenant)
    if own is not None and own.retain_bytes is not None:
        return int(own.retain_bytes)
    if config.server.retain_bytes is not None:
        return int(config.server.retain_bytes)
    return int(config.host.capacity_bytes) // 2


@dataclass
class _Kept:
    prefix: KeyedTokens
    until: float  # on the registry's clock


@dataclass(frozen=True)
class TenantRetention:
    """One tenant's promises now: distinct blocks kept, their bytes, and the prefixes that keep them."""

    blocks: int
    bytes: int
    prefixes: int
    quota_bytes: int


class Retention:
    def __init__(
        self,
        cache: Cache,
        quota_bytes: Callable[[str], int],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``quota_bytes(tenant name)``: the host bytes that tenant's marks may keep."""
        self._cache = cache
        self._quota = quota_bytes
        self._clock = clock
        self._block_bytes = cache.layout.block_bytes
        self._kept: dict[str, OrderedDict[tuple[BlockKey, ...], _Kept]] = {}
        self._lock = threading.Lock()  # request handlers keep prefixes from worker threads

    def keep(self, tenant: str, marks: list[tuple[KeyedTokens, float]]) -> list[bool]:
        """Keep each ``(prefix, ttl_s)`` of one request for its TTL from now; which ones are kept.

        A promise is never shortened: a prefix kept already keeps the later
        of its two ends. A prefix whose blocks alone exceed the tenant's quota
        is not kept; otherwise the tenant's least recently used prefixes are
        let go until the quota holds.
        """
        quota = self._quota(tenant) // self._block_bytes
        with self._lock:
            now = self._clock()
            kept = self._kept.setdefault(tenant, OrderedDict())
            self._expire(kept, now)
            for prefix, ttl_s in marks:
                if not prefix.keys or len(prefix.keys) > quota:
                    continue
                name = tuple(prefix.keys)
                before = kept.pop(name, None)
                kept[name] = _Kept(prefix, max(now + ttl_s, before.until if before else now))  # the newest use, last
            while self._blocks(kept) > quota:
                _, oldest = kept.popitem(last=False)
                self._cache.pin_for(oldest.prefix, 0)
            self._pin(kept, now)
            return [tuple(p.keys) in kept if p.keys else False for p, _ in marks]

    def report(self) -> dict[str, TenantRetention]:
        """Every tenant that keeps something now."""
        with self._lock:
            now = self._clock()
            out = {}
            for tenant, kept in self._kept.items():
                self._expire(kept, now)
                if kept:
                    blocks = self._blocks(kept)
                    quota = self._quota(tenant)
                    out[tenant] = TenantRetention(blocks, blocks * self._block_bytes, len(kept), quota)
            return out

    @staticmethod
    def _blocks(kept: OrderedDict[tuple[BlockKey, ...], _Kept]) -> int:
        return len({k for name in kept for k in name})

    @staticmethod
    def _expire(kept: OrderedDict[tuple[BlockKey, ...], _Kept], now: float) -> None:
        """Promises past their TTL end by themselves (their pins expire in the cache at the same moment)."""
        for name in [n for n, k in kept.items() if k.until <= now]:
            del kept[name]

    def _pin(self, kept: OrderedDict[tuple[BlockKey, ...], _Kept], now: float) -> None:
        """Pin the tenant's live prefixes, the longest promise last, so a block keeps the longest promise over it.

        Prefixes of one conversation share their leading blocks; pinning them
        in any other order (or releasing one) would cut another's promise short.
        """
        for k in sorted(kept.values(), key=lambda k: k.until):
            self._cache.pin_for(k.prefix, k.until - now)


__all__ = ["Retention", "TenantRetention", "retain_quota"]
