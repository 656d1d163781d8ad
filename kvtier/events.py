"""Block events: which keys entered or left which tier, as a router needs to know where each prefix lives.

A router that sends a request to the instance already holding its prefix
must learn, instance by instance, what each one holds. The tiers' eviction
policies already hear of every key that enters (``on_insert``) or leaves
(``on_remove``) a tier, so :class:`ObservedPolicy` listens there, beside
the policy, and the manager needs no second bookkeeping path. The engine's
own pool (the device tier) reports through the same :class:`BlockEventSink`.

Events carry keys only, never tokens or payloads: a key is a keyed hash, so
whoever reads the stream without the deployment's secret learns nothing
about any prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Sequence
from typing import Protocol

import msgspec

from kvtier.keys import BlockKey
from kvtier.policy.base import EvictionPolicy
from kvtier.tiers.base import TierKind

EVENTS_VERSION = 1
PING_S = 2.0
"""A stream of events says something this often, a ``Ping`` when nothing else: a reader silent past a few is lost."""


class BlockEventSink(Protocol):
    """Hears of keys entering and leaving a tier; called on the thread that changed the tier, under its lock."""

    def stored(self, tier: TierKind, keys: Sequence[BlockKey]) -> None: ...

    def removed(self, tier: TierKind, keys: Sequence[BlockKey]) -> None: ...

    def cleared(self, tier: TierKind) -> None: ...


class HeldKeys:
    """The keys each tier holds, kept from the events themselves, and the sinks told of every change after it.

    What a subscriber is first sent (a snapshot) and the changes it hears
    after must fit together with nothing between them: :meth:`listen` takes
    both under the one lock the changes are applied under. Sinks are called
    under that lock, on the thread that changed the tier: they only queue.
    """

    def __init__(self) -> None:
        self._held: dict[TierKind, set[BlockKey]] = {}
        self._sinks: list[BlockEventSink] = []
        self._lock = threading.Lock()

    def stored(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._held.setdefault(tier, set()).update(keys)
            if keys:
                for sink in self._sinks:
                    sink.stored(tier, keys)

    def removed(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            self._held.setdefault(tier, set()).difference_update(keys)
            if keys:
                for sink in self._sinks:
                    sink.removed(tier, keys)

    def cleared(self, tier: TierKind) -> None:
        with self._lock:
            self._held[tier] = set()
            for sink in self._sinks:
                sink.cleared(tier)

    def snapshot(self) -> dict[TierKind, list[BlockKey]]:
        """Every key each tier holds now."""
        with self._lock:
            return {tier: list(keys) for tier, keys in self._held.items()}

    def listen(self, sink: BlockEventSink) -> dict[TierKind, list[BlockKey]]:
        """Tell ``sink`` of every change from now on; returns the snapshot those changes follow."""
        with self._lock:
            self._sinks.append(sink)
            return {tier: list(keys) for tier, keys in self._held.items()}

    def unlisten(self, sink: BlockEventSink) -> None:
        with self._lock:
            self._sinks.remove(sink)


# -- the wire: one JSON object per line, tagged by "type" ------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    """First line of a stream: what keys mean there, so a subscriber can check it computes the same keys.

    ``root`` is the key chain's origin for the default namespace: equal roots
    mean the same secret, model fingerprint, KV layout and block size.
    """

    version: int
    block_size: int
    root: str  # hex
    tiers: list[TierKind]


class Snapshot(msgspec.Struct, tag="snapshot"):
    """Every key each tier holds now; replaces whatever the subscriber knew of this instance."""

    tiers: dict[TierKind, list[str]]


class Stored(msgspec.Struct, tag="stored"):
    tier: TierKind
    keys: list[str]


class Removed(msgspec.Struct, tag="removed"):
    tier: TierKind
    keys: list[str]


class Cleared(msgspec.Struct, tag="cleared"):
    tier: TierKind


class Ping(msgspec.Struct, tag="ping"):
    """Sent when nothing else was: a subscriber that hears nothing for a while knows the stream is lost."""


Event = Hello | Snapshot | Stored | Removed | Cleared | Ping
ENCODER = msgspec.json.Encoder()
DECODER = msgspec.json.Decoder(Event)


def hexkeys(keys: Sequence[BlockKey]) -> list[str]:
    return [bytes(k).hex() for k in keys]


class ObservedPolicy(EvictionPolicy):
    """An eviction policy that also tells ``sink`` of every key entering or leaving its tier.

    Only inserts and removals of keys new to (or still in) the tier are
    reported: the manager may offer a key the policy already tracks.
    """

    def __init__(self, inner: EvictionPolicy, tier: TierKind, sink: BlockEventSink) -> None:
        self.inner = inner
        self.name = inner.name
        self._tier = tier
        self._sink = sink

    def on_insert(self, key: BlockKey, parent: BlockKey | None) -> None:
        new = key not in self.inner
        self.inner.on_insert(key, parent)
        if new:
            self._sink.stored(self._tier, [key])

    def on_access(self, key: BlockKey) -> None:
        self.inner.on_access(key)

    def on_remove(self, key: BlockKey) -> None:
        held = key in self.inner
        self.inner.on_remove(key)
        if held:
            self._sink.removed(self._tier, [key])

    def on_lost(self, key: BlockKey) -> None:
        self.inner.on_lost(key)
        self._sink.removed(self._tier, [key])  # gone from the tier, whatever the policy still ranks

    def victims(self, n: int, exclude: Container[BlockKey] = frozenset()) -> list[BlockKey]:
        return self.inner.victims(n, exclude)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner
