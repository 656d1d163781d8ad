"""The disk tier's bytes in motion: a batch of slot reads or writes is one call into :mod:`kvtier.tiers.native`.

That call spreads the requests over a few threads with the GIL released, and
its threads also take each layer's CRC-32C while the bytes are in cache.
O_DIRECT needs aligned memory, and torch/numpy allocations are not
page-aligned: requests whose memory is not aligned go through an aligned
bounce buffer (one per calling thread, reused) and are copied.

This module moves and checks bytes; what a read that fails its check means
for the index, and when a write is acknowledged, is the tier's business
(:mod:`kvtier.tiers.disk`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.config import FsyncMode
from kvtier.errors import warn_once
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.stats import DiskStats
from kvtier.tiers import native
from kvtier.tiers.disk.records import IndexEntry, pack_checksums
from kvtier.tiers.disk.slabs import DiskSlabs, IOMode
from kvtier.tiers.host import SLOT_ALIGN

# Per calling thread: four 4 MiB slices, one per I/O thread. Adjacent slots of a batch are
# gathered into requests of up to a slice (a SmolLM2 bf16 block is 360 KiB): under O_DIRECT
# large requests keep the disk streaming, while per-request overhead dominates small ones.
BOUNCE_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class SlotRead:
    """One block to read into ``buf``: bytes at ``offset`` checked against ``checksums``, one per layer."""

    index: int  # in the caller's batch
    key: BlockKey
    entry: IndexEntry
    buf: np.ndarray
    fd: int
    offset: int
    checksums: bytes  # packed, as the index entry keeps them


class SlabIO:
    """Batched, checksummed reads and writes of slots, in the I/O mode the tier opened with."""

    def __init__(
        self,
        slabs: DiskSlabs,
        layout: KVLayout,
        stats: DiskStats,
        *,
        backend: native.IOBackend,
        io_mode: IOMode,
        fsync: FsyncMode,
    ) -> None:
        self._slabs = slabs
        self._layout = layout
        self._stats = stats
        self._io = backend
        self._io_mode = io_mode
        self._fsync = fsync
        self._local = threading.local()  # this thread's bounce buffer

    def read(
        self,
        keys: Sequence[BlockKey],
        entries: list[IndexEntry | None],
        outs: Sequence[torch.Tensor],
    ) -> tuple[list[bool], list[SlotRead]]:
        """Read each entry's whole block into its out, in one call, every layer checked against its CRC-32C.

        A key without an entry (not indexed) is a miss, and so is every block
        when the call fails (read_errors: the records are kept). Also returns
        the reads whose bytes are bad (short, or failing their checksum), for
        the tier to forget.
        """
        results = [False] * len(keys)
        if all(e is None for e in entries):
            return results, []
        nbytes = self._layout.block_bytes
        reads: list[SlotRead] = []
        for i, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            if entry is None:
                continue
            buf = outs[i].numpy()
            if buf.nbytes != nbytes:
                self._stats.add(errors=1)  # an out of the wrong size: never read past the slot
                continue
            fd, offset = self._slabs.where(entry.slot)
            reads.append(SlotRead(i, key, entry, buf, fd, offset, entry.checksums))
        try:
            counts, sums = self._io.preadv_crc32c_batch(
                [r.fd for r in reads],
                [r.buf for r in reads],
                [r.offset for r in reads],
                self._layout.layer_bytes,
                self.bounce(),
            )
        except OSError as err:
            self._stats.add(errors=len(reads), read_errors=len(reads))
            warn_once("disk-read", "disk tier read failed (%s); serving misses (read_errors)", err)
            return results, []
        bad = []
        for r, got, crcs in zip(reads, counts, sums, strict=True):
            ok = results[r.index] = self._verify(r, got == nbytes, pack_checksums(crcs))
            if not ok:
                bad.append(r)
        return results, bad

    def _verify(self, r: SlotRead, whole: bool, crcs: bytes) -> bool:
        if not whole:  # the slab ends early: truncated under us, and it will not grow back
            self._stats.add(lost_blocks=1)
            warn_once("disk-short", "disk tier block ends past its slab file's end (truncated); dropped (lost_blocks)")
            return False
        if crcs != r.checksums:
            self._stats.add(checksum_failures=1)
            warn_once("disk-checksum", "disk tier block failed its checksum; dropped (counted in checksum_failures)")
            return False
        self._stats.add(bytes_read=r.buf.nbytes)
        return True

    def write(self, slots: list[int], datas: list[np.ndarray]) -> list[bytes]:
        """Write each block into its slot, then fsync each file written (unless ``never``); each block's CRC-32Cs.

        Raises ``OSError`` (the write or the sync failed): then nothing of the batch may be acknowledged.
        """
        where = [self._slabs.where(slot) for slot in slots]
        checksums = self._io.pwritev_crc32c_batch(
            [fd for fd, _ in where],
            datas,
            [off for _, off in where],
            self._layout.layer_bytes,
            self.bounce(),
        )
        if self._fsync is not FsyncMode.NEVER:
            for fd in {fd for fd, _ in where}:
                self._io.fsync(fd)
        return [pack_checksums(sums) for sums in checksums]

    def bounce(self) -> native.Buffer | None:
        """This thread's aligned bounce buffer (O_DIRECT only), allocated on first use and kept."""
        if self._io_mode is IOMode.BUFFERED:
            return None
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = self._io.alloc_aligned(BOUNCE_BYTES, SLOT_ALIGN)
        return bounce
