"""Step ② across the tiers: the confirmed run of a request's blocks, local tiers first, then the remote.

:func:`kvtier.index.longest_prefix` walks one list of holders; this module
runs it over a manager's tiers in their order and under their lock, asks the
shared remote tier only for the blocks after the local run (its headers
read without the lock: it talks to the network), and keeps the counts a
lookup is reported by. A probe answers the same question without counting
or refreshing anything, for operators and ``explain``.
"""

from __future__ import annotations

from collections import Counter

from kvtier.evict import Eviction
from kvtier.index import LookupResult, MissReason, Probe, longest_prefix
from kvtier.keys import BlockKey, Digests, KeyedTokens
from kvtier.tiers.base import BlockRecord
from kvtier.tierset import TierSet


class Lookups:
    def __init__(self, tiers: TierSet, eviction: Eviction, block_size: int) -> None:
        self.tiers = tiers
        self.eviction = eviction
        self.block_size = block_size

    def lookup(self, prompt: KeyedTokens, first_block: int) -> LookupResult:
        """The confirmed run from ``first_block``, counted as traffic: policies hear of the hits, stats of both."""
        keys, bs = prompt.keys, self.block_size
        probe = self.run(keys, prompt.digests, first_block)
        self._accessed(keys[first_block:], probe)
        served = Counter(probe.tiers)
        remaining = len(keys) - first_block  # blocks that reached this tier: not served by a faster one
        for tier in self.tiers.every:
            hit = served[tier.kind]
            # A tier under host counts its hits when they are read back and verified (promote.py): a disk
            # index hit can still fail its checksum, end short, or never be fetched (deadline, host full); a
            # remote header can be followed by a value that expired or fails its check. Host memory cannot
            # fail a read, so its lookup-time hits are what it serves.
            counted = hit if tier is self.tiers.host else 0
            tier.stats.add(lookups=1, hit_tokens=counted * bs, miss_tokens=max(0, remaining - hit) * bs)
            remaining -= hit
        for shared in self.tiers.shared:
            if probe.mismatched is shared.kind:
                shared.stats.add(foreign_tokens=1)  # another node's block under the key: counted where it lives
        ns, n = prompt.namespace, len(prompt)
        return LookupResult(ns, bs, n, tuple(keys), tuple(probe.tiers), probe.reason, first_block, prompt.digests)

    def probe(self, prompt: KeyedTokens, first_block: int = 0) -> LookupResult:
        """What :meth:`lookup` would answer, without touching policies or stats."""
        found = self.run(prompt.keys, prompt.digests, first_block)
        keys, tiers = tuple(prompt.keys), tuple(found.tiers)
        ns, bs, n = prompt.namespace, self.block_size, len(prompt)
        return LookupResult(ns, bs, n, keys, tiers, found.reason, first_block, prompt.digests)

    def named(self, keys: list[BlockKey], digests: Digests, namespace: str) -> LookupResult:
        """A named run, counted like a lookup for the policies (each name is a block; no token count)."""
        probe = self.run(keys, digests)
        self._accessed(keys, probe)
        return LookupResult(namespace, self.block_size, 0, tuple(keys), tuple(probe.tiers), probe.reason, 0, digests)

    def run(self, keys: list[BlockKey], digests: Digests, first_block: int = 0) -> Probe:
        """The confirmed run from ``first_block``: local tiers under the lock, then the remote's headers without it.

        The remote's records are confirmed against the request's digests
        like any tier's, so a value of other tokens ends the run there.
        """
        with self.tiers.lock:
            probe = longest_prefix(keys, digests, self.tiers.local, start=first_block)
        if self.tiers.shared and probe.reason is MissReason.ABSENT:
            at = first_block + len(probe.tiers)
            for shared in self.tiers.shared:
                shared.probe_run(keys[at:])
            with self.tiers.lock:
                rest = longest_prefix(keys, digests, self.tiers.every, start=at)
            probe = Probe([*probe.tiers, *rest.tiers], rest.reason, rest.mismatched)
        return probe

    def exists(self, keys: list[BlockKey], digests: Digests) -> list[bool]:
        """Which of ``keys`` some tier holds, confirmed; the remote is asked (batched) only for the absent ones."""
        with self.tiers.lock:
            records: list[BlockRecord | None] = [self.tiers.record(key) for key in keys]
        for shared in self.tiers.shared:
            absent = [i for i, r in enumerate(records) if r is None]
            if not absent:
                break
            for i, record in zip(absent, shared.probe([keys[i] for i in absent]), strict=True):
                records[i] = record
        return [r is not None and r.matches(digests[i]) for i, r in enumerate(records)]

    def _accessed(self, keys: list[BlockKey], probe: Probe) -> None:
        with self.tiers.lock:
            for key, kind in zip(keys, probe.tiers, strict=False):
                self.eviction.accessed(kind, key)
        if probe.mismatched is not None:
            self.tiers.stats(probe.mismatched).add(confirm_mismatches=1)
