"""Step ⑤'s second half: making room in a tier, and where its victims go.

Policies (``kvtier/policy``) only rank victims; this module acts on their
answer: it skips what :class:`~kvtier.pins.Pins` and live sessions protect,
records each victim for ``explain``, demotes host victims (write-back to
disk, a copy to the remote by config) and keeps every tier's policy told of
what enters and leaves. Everything here runs with the tier set's lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvtier.events import BlockEventSink, ObservedPolicy
from kvtier.explain import EvictionLog
from kvtier.keys import BlockKey
from kvtier.pins import Pins
from kvtier.policy import EvictionPolicy
from kvtier.policy.base import NO_PROTECTION, Protection
from kvtier.tiers.base import BlockRecord, Tier, TierKind
from kvtier.tierset import TierSet
from kvtier.writes import Moment, WritePolicy


class Eviction:
    def __init__(
        self,
        tiers: TierSet,
        policies: dict[TierKind, EvictionPolicy],
        pins: Pins,
        log: EvictionLog,
        writes: WritePolicy,
        clock: Callable[[], float],
    ) -> None:
        self.tiers = tiers
        self.policies = policies
        self.pins = pins
        self.log = log  # what explain says was evicted
        self.writes = writes
        self.protect: Callable[[int], Protection] | None = None  # host capacity -> keys to keep (sessions)
        self._clock = clock
        for tier in tiers.local:
            policies[tier.kind].load(tier.entries(), getattr(tier, "recency", None))

    # -- what the policies hear -------------------------------------------------------------
    def inserted(self, kind: TierKind, key: BlockKey, parent: BlockKey | None) -> None:
        self.policies[kind].on_insert(key, parent)

    def accessed(self, kind: TierKind, key: BlockKey) -> None:
        """A hit in ``kind``; the remote tier has no policy of ours, so its hits refresh nothing here."""
        if kind in self.policies:
            self.policies[kind].on_access(key)

    def indexed(self, tier: Tier, written: list[tuple[BlockKey, BlockRecord]], ok: list[bool]) -> None:
        """Blocks an owned tier under host took: its policy hears of the new ones."""
        policy = self.policies[tier.kind]
        for (key, record), stored in zip(written, ok, strict=True):
            if stored and key not in policy:
                policy.on_insert(key, record.parent)

    def lost(self, tier: Tier, keys: Iterable[BlockKey]) -> None:
        """Keys whose read from an owned tier failed: those the tier dropped by itself leave its policy (and sinks).

        Under the lock. A key the tier holds (a failure it kept, or a block
        stored again since) is left alone.
        """
        policy = self.policies[tier.kind]
        for key in keys:
            if not tier.contains(key):
                policy.on_lost(key)

    # -- making room -----------------------------------------------------------------------------
    def make_room(self, tier: Tier, n: int) -> bool:
        """Evict (demoting host victims) until ``n`` slots are free or nothing more may go."""
        short = n - tier.free_blocks()
        if short <= 0:
            return True
        host = tier is self.tiers.host
        exclude = self.pins.exclude(tier.kind)
        protection = self.protect(tier.capacity_blocks) if host and self.protect else NO_PROTECTION
        policy = self.policies[tier.kind]
        victims = policy.ranked_victims(short, exclude, protection)
        self.log.record(victims, tier.kind, policy.name, self._clock())
        if host:
            self._demote(victims)
        for key in victims:  # first: a policy (and a sink listening to it) may ask the tier about the key
            policy.on_remove(key)
        tier.remove_many(victims)
        tier.stats.add(evictions=len(victims))
        return len(victims) == short

    def _demote(self, victims: list[BlockKey]) -> None:
        """Write-back: host victims go down to the tiers under host that take a copy at eviction.

        This runs under the lock (the victims' slots are about to be freed, so
        they cannot be pinned and written later); it is the one place where an
        owned tier's I/O holds the lock, and only when host memory is full. A
        shared tier gets copies on its queue, never a network call here.
        """
        host = self.tiers.host
        down = [(k, r) for k in victims if (r := host.record(k)) is not None]
        host.stats.add(demotions=self.copy_down(Moment.EVICTED, down))

    # -- copies below host ----------------------------------------------------------------------
    def copies_at(self, moment: Moment) -> bool:
        """Whether any tier under host takes a copy of a block at ``moment``."""
        return any(self.writes.copies(t.kind, moment) for t in self.tiers.below_host)

    def copy_down(self, moment: Moment, blocks: list[tuple[BlockKey, BlockRecord]]) -> int:
        """Copy host blocks to each tier under host that takes a copy at ``moment``; how many owned tiers took.

        The caller keeps the blocks' host slots alive, by holding the lock or
        by pinning them; the lock is taken here only around metadata, so a
        pinned copy never holds it across an owned tier's I/O. An owned tier
        gets the blocks it lacks, room made first and its policy told after;
        a shared tier gets them all on its queue (what it holds is not ours to
        know without a round trip).
        """
        host, taken = self.tiers.host, 0
        for tier in self.tiers.below_host:
            if not blocks or not self.writes.copies(tier.kind, moment):
                continue
            owned = tier in self.tiers.owned
            todo = blocks
            if owned:
                with self.tiers.lock:
                    todo = [(k, r) for k, r in blocks if not tier.contains(k)]
                    self.make_room(tier, min(len(todo), tier.capacity_blocks))
            if not todo:
                continue
            ok = tier.put_many([k for k, _ in todo], [host.view(k) for k, _ in todo], [r for _, r in todo])  # type: ignore[misc]
            if owned:
                with self.tiers.lock:
                    self.indexed(tier, todo, ok)
                taken += sum(ok)
        return taken

    # -- operators ----------------------------------------------------------------------------------
    def observe(self, sink: BlockEventSink, *, announce: bool = True) -> None:
        """Tell ``sink`` of every key that enters or leaves a tier from now on, after the keys held now (``announce``).

        The policies hear of every insert and removal already, so the sink
        listens beside them (:class:`ObservedPolicy`); under the lock, so no
        change slips between the keys reported now and the first event. A
        sink that lists the tiers' keys itself when it needs them is not told
        them now (``announce=False``: see :meth:`kvtier.events.HeldKeys.list_from`).
        """
        for tier in self.tiers.local:
            if announce:
                sink.stored(tier.kind, tier.keys())
            self.policies[tier.kind] = ObservedPolicy(self.policies[tier.kind], tier.kind, sink)

    def clear(self, kind: TierKind | None = None, root: BlockKey | None = None) -> int:
        """Drop every block of one tier (or all) that no read pins; returns how many.

        ``root``: only the blocks of that namespace's chains, the trees that
        hang from it by the parents the records keep, through any local tier
        (a block on disk whose parent is in host memory is found too).
        """
        doomed = None if root is None else self.descendants(root)
        dropped = 0
        for tier in self.tiers.local:
            if kind is not None and tier.kind is not kind:
                continue
            keys = [
                k
                for k, _ in tier.entries()
                if not (tier is self.tiers.host and k in self.pins) and (doomed is None or k in doomed)
            ]
            for key in keys:
                self.policies[tier.kind].on_remove(key)
            dropped += tier.remove_many(keys)
        return dropped

    def descendants(self, root: BlockKey) -> set[BlockKey]:
        """Every key the local tiers hold whose chain of parents leads to ``root``."""
        children: dict[BlockKey, list[BlockKey]] = {}
        for tier in self.tiers.local:
            for key, record in tier.entries():
                if record.parent is not None:
                    children.setdefault(record.parent, []).append(key)
        found: set[BlockKey] = set()
        todo = [root]
        while todo:
            for child in children.pop(todo.pop(), ()):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found
