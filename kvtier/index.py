"""Step ② of the data path: the longest confirmed run of cached blocks.

A key is only a hint. A block counts as a hit only when the digest the tier
stored beside it (a keyed 256-bit hash of the block's key and token ids,
:meth:`kvtier.keys.KeyHasher.digest`) equals the request's for that block, so
no key collision (accidental or forced) can ever serve one prompt's KV to another.
Only consecutive blocks from the start count: block *i*'s KV is a function of
every token before it, so a hit after a miss is useless.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.keys import BlockKey, Digests
from kvtier.tiers.base import Tier, TierKind


class MissReason(enum.StrEnum):
    """Why the cached run stopped where it did (the "why miss" answer)."""

    NONE = "none"  # every full block hit; only the partial tail (if any) is uncached
    ABSENT = "absent"  # no tier holds the first missing block's key
    CONFIRM_MISMATCH = "confirm_mismatch"  # a tier holds the key, but for other tokens


@dataclass(frozen=True)
class LookupResult:
    """How much of a request is cached, and where; hides keys-to-slots internals."""

    namespace: str
    block_size: int
    num_tokens: int
    keys: tuple[BlockKey, ...]  # every full block of the request
    tiers: tuple[TierKind, ...]  # tier serving each cached block from ``first_block`` on
    miss_reason: MissReason
    first_block: int = 0  # blocks before it were held by the caller and not probed
    # The tokens' digests the run was confirmed against: a fetch confirms each block again when it pins it,
    # since a colliding key may hold another prompt's block by then (None: results that are never fetched).
    digests: Digests | None = None

    @property
    def cached_blocks(self) -> int:
        """Leading blocks cached, the caller's own ``first_block`` included."""
        return self.first_block + len(self.tiers)

    @property
    def cached_tokens(self) -> int:
        return self.cached_blocks * self.block_size

    @property
    def first_miss_block(self) -> int | None:
        return None if self.miss_reason is MissReason.NONE else self.cached_blocks

    def tokens_by_tier(self) -> dict[TierKind, int]:
        out: dict[TierKind, int] = {}
        for kind in self.tiers:
            out[kind] = out.get(kind, 0) + self.block_size
        return out


@dataclass(frozen=True)
class Probe:
    tiers: list[TierKind]
    reason: MissReason
    mismatched: TierKind | None  # the tier whose stored tokens disagreed


class Evidence(Protocol):
    """What a holder keeps beside a key to confirm it: a tier's digest record, the pool's token block."""

    def matches(self, evidence: Any, /) -> bool: ...


class Holder(Protocol):
    """Anything that holds blocks by key: the tiers, and the engine's resident pool index."""

    @property
    def kind(self) -> TierKind: ...

    def confirm(self, key: BlockKey, evidence: Any, /) -> bool | None:
        """Whether what it holds under ``key`` matches ``evidence`` (see :class:`Evidence`); None when absent."""
        ...


def longest_prefix(
    keys: Sequence[BlockKey], digests: Digests | Sequence[Any], tiers: Sequence[Tier | Holder], *, start: int = 0
) -> Probe:
    """Walk ``keys`` from ``start`` in order; each block is served by the first (fastest) tier holding it, confirmed.

    ``digests`` are the request's, beside ``keys`` (digested only where a
    tier holds the key): what each holder's records are confirmed against
    (a tier's, a digest; the resident pool's, the block's tokens). A holder
    whose record disagrees ends the run (the lower tiers were written from
    the same colliding key and cannot be trusted to differ).
    """
    found: list[TierKind] = []
    for i in range(start, min(len(keys), len(digests))):
        key = keys[i]
        for tier in tiers:
            held = tier.confirm(key, digests[i])
            if held is None:
                continue
            if not held:
                return Probe(found, MissReason.CONFIRM_MISMATCH, tier.kind)
            found.append(tier.kind)
            break
        else:
            return Probe(found, MissReason.ABSENT, None)
    return Probe(found, MissReason.NONE, None)
