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
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any, Protocol

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


Held = dict[TierKind, list[BlockKey]]
Listing = Callable[[Callable[[Held], Any]], Any]
"""``listing(then)``: ``then`` of every key some tiers hold, called under the lock their changes are told under."""


class HeldKeys:
    """The keys each tier holds, and the sinks told of every change after it.

    What a subscriber is first sent (a snapshot) and the changes it hears
    after must fit together with nothing between them: :meth:`listen` takes
    both under the one lock the changes are applied under. Sinks are called
    under that lock, on the thread that changed the tier: they only queue.

    Keys are kept here from the events themselves, except those of tiers
    that can list their own (:meth:`list_from`): a cache's tiers index every
    key already, in native arrays, and a copy here would cost a set entry
    and a key object per block, and the listing of every key at start-up.
    Their part of a snapshot is listed by them, under the cache's lock,
    which every change to them and its event happen under: taken there, with
    this lock inside it, the snapshot and the changes still fit together
    (a change made and not yet told can be told twice, which a set of held
    keys absorbs).
    """

    def __init__(self) -> None:
        self._held: dict[TierKind, set[BlockKey]] = {}
        self._sinks: list[BlockEventSink] = []
        self._lock = threading.Lock()
        self._listed: frozenset[TierKind] = frozenset()
        self._listing: Listing | None = None

    def list_from(self, tiers: Iterable[TierKind], listing: Listing) -> None:
        """Keep no keys of ``tiers``: ``listing`` lists theirs when a snapshot is taken (set once, at start)."""
        with self._lock:
            self._listed = frozenset(tiers)
            self._listing = listing
            for tier in self._listed:
                self._held.pop(tier, None)

    def stored(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            if tier not in self._listed:
                self._held.setdefault(tier, set()).update(keys)
            if keys:
                for sink in self._sinks:
                    sink.stored(tier, keys)

    def removed(self, tier: TierKind, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            if tier not in self._listed:
                self._held.setdefault(tier, set()).difference_update(keys)
            if keys:
                for sink in self._sinks:
                    sink.removed(tier, keys)

    def cleared(self, tier: TierKind) -> None:
        with self._lock:
            if tier not in self._listed:
                self._held[tier] = set()
            for sink in self._sinks:
                sink.cleared(tier)

    def snapshot(self) -> Held:
        """Every key each tier holds now."""
        return self._taken(lambda state: state)

    def listen(self, sink: BlockEventSink) -> Held:
        """Tell ``sink`` of every change from now on; returns the snapshot those changes follow."""

        def add(state: Held) -> Held:
            self._sinks.append(sink)
            return state

        return self._taken(add)

    def _taken(self, then: Callable[[Held], Held]) -> Held:
        """``then`` of a snapshot, under this lock (inside the listing's, when tiers list their own keys)."""

        def take(listed: Held) -> Held:
            with self._lock:
                return then({**{tier: list(keys) for tier, keys in self._held.items()}, **listed})

        listing = self._listing
        return take({}) if listing is None else listing(take)

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
