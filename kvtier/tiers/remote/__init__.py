"""The remote tier, one module per job: the tier's face (:mod:`.tier`), its value frames (:mod:`.frame`), the
Redis/Valkey nodes and their breakers (:mod:`.nodes`), and the reader and writer threads (:mod:`.receiver`,
:mod:`.writer`)."""

from kvtier.tiers.remote.tier import MAC_STEP, RemoteTier

__all__ = ["MAC_STEP", "RemoteTier"]
