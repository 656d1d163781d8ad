"""The protocol every tier implements, and the types it speaks.

Tiers are mechanism only: they hold bytes in fixed-size slots and answer
contains / get / put / remove (and batch forms). They never decide what to
evict or where a block goes (that is the manager's and the policies' job),
and they never import the manager.

Failure contract: a tier raises nothing for a block it cannot serve. An absent
block, a failed read, a checksum mismatch are all ``False`` from ``get``,
counted in :attr:`Tier.stats` and logged once; the caller recomputes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kvtier.keys import BlockDigest, BlockKey
from kvtier.layout import KVLayout
from kvtier.stats import RemoteSnapshot, TierStats


class TierKind(enum.StrEnum):
    """Tiers from fastest to slowest; the manager keeps them in this order."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """What a tier keeps beside a block's payload.

    ``digest`` (:meth:`kvtier.keys.KeyHasher.digest`: a keyed hash of the
    block's key and token ids) lets every hit be confirmed against the
    request's tokens, since a key is only a hint, without any tier holding
    the token ids themselves. ``parent`` is the previous block's key, and
    block 0's is the chain's root (the namespace's, :meth:`KeyHasher.root`):
    kept for prefix-aware eviction, and so that a namespace's blocks can be
    found (the trees that hang from its root) to clear them. None: a named
    block, or a block 0 stored before roots were recorded.
    """

    digest: BlockDigest
    parent: BlockKey | None

    def matches(self, digest: BlockDigest) -> bool:
        return self.digest == digest


@runtime_checkable
class Tier(Protocol):
    kind: TierKind
    layout: KVLayout
    stats: TierStats

    @property
    def capacity_blocks(self) -> int: ...

    @property
    def slot_bytes(self) -> int:
        """Bytes one block occupies in this tier (payload rounded up to the tier's alignment)."""
        ...

    def __len__(self) -> int: ...

    def free_blocks(self) -> int: ...

    def contains(self, key: BlockKey) -> bool: ...

    def record(self, key: BlockKey) -> BlockRecord | None: ...

    def keys(self) -> list[BlockKey]:
        """Every key held, in no particular order (a snapshot of the tier for a router's event stream)."""
        ...

    def confirm(self, key: BlockKey, digest: BlockDigest, /) -> bool | None:
        """Whether the block under ``key`` holds these tokens (its record has ``digest``); None when it is absent.

        What a lookup asks of each block, so a tier keeping its records in
        flat memory answers it without making a record object.
        """
        ...

    def get(self, key: BlockKey, out: torch.Tensor) -> bool:
        """Copy the block's payload into ``out`` (uint8, ``layout.block_bytes``)."""
        ...

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]: ...

    def put(self, key: BlockKey, payload: torch.Tensor, record: BlockRecord) -> bool:
        """Store a block; False when full, failed, or the key holds other tokens.

        A key that already holds the same tokens is a successful no-op. A key
        holding different tokens (a hash collision) keeps its first block: the
        second is refused, so neither can ever be served for the other.
        """
        ...

    def put_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[torch.Tensor], records: Sequence[BlockRecord]
    ) -> list[bool]: ...

    def remove(self, key: BlockKey) -> bool: ...

    def remove_many(self, keys: Sequence[BlockKey]) -> int: ...

    def entries(self) -> Iterator[tuple[BlockKey, BlockRecord]]:
        """Every resident block, oldest store first (rebuilds policies after a restart)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class SharedTier(Tier, Protocol):
    """A tier other nodes write too (the remote): what this node knows of it is what its probes saw.

    Its :meth:`~Tier.record` answers from the last probe, so a lookup
    probes it (without the tier set's lock: it talks to the network) before
    reading records; its :meth:`~Tier.put_many` copies onto a queue and
    returns, so it may be called under the lock; no policy of this node
    evicts it.
    """

    def probe(self, keys: Sequence[BlockKey]) -> list[BlockRecord | None]:
        """The records of ``keys`` as the shared store holds them now (None where absent or not authentic)."""
        ...

    def probe_run(self, keys: Sequence[BlockKey]) -> int:
        """Probe ``keys`` in order until one is absent; how many lead."""
        ...

    def snapshot(self) -> RemoteSnapshot: ...
