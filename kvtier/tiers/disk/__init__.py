"""The disk tier, one module per job: the tier's face (:mod:`.tier`), its LMDB index (:mod:`.index`), the index
record (:mod:`.records`) and its in-memory mirror by slot (:mod:`.mirror`), slab files
(:mod:`.slabs`), batched slab I/O (:mod:`.slab_io`), its directory and lock (:mod:`.directory`) and the offline
check of a stopped tier (:mod:`.check`)."""

from kvtier.tiers.disk.tier import FORMAT_VERSION, DiskTier, IOMode, io_mode_for

__all__ = ["FORMAT_VERSION", "DiskTier", "IOMode", "io_mode_for"]
