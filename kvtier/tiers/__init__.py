"""Storage tiers: each holds block payloads in fixed-size slots behind one protocol."""

from kvtier.tiers.base import BlockRecord, Tier, TierKind

__all__ = ["BlockRecord", "Tier", "TierKind"]
