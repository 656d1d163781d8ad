"""Step ⑤: new blocks into host slots, two-phase, then copied to the tiers under host that take them.

A store reserves host slots (:meth:`Stores.prepare`: invisible, unevictable
while filled), the caller fills them, and :meth:`Stores.complete` publishes
them or, on failure, gives the slots back: a block that was not written
whole is never indexed. Every store runs through these two phases: the
one-call :meth:`Stores.store` loops over them in plans of at most half the
host tier, so a request larger than host memory still lands whole, its own
earlier blocks becoming evictable (and, write-back, going down to disk)
once committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.evict import Eviction
from kvtier.keys import BlockKey, Digests, KeyedTokens
from kvtier.layout import KVLayout
from kvtier.pins import Pins
from kvtier.tiers.base import BlockRecord, TierKind
from kvtier.tierset import TierSet
from kvtier.writes import Moment, WritePolicy

Fill = Callable[[int, torch.Tensor], object]
"""``fill(i, out)`` writes block ``i``'s payload into its reserved host slot ``out`` (uint8, ``block_bytes``)."""

Payloads = Sequence[torch.Tensor] | torch.Tensor | Fill
"""What a store copies: ``payloads[j]`` for block ``first_block + j``, or a :data:`Fill` (a copy out of a pool)."""

_Blocks = list[tuple[BlockKey, BlockRecord]]
_Copies = list[tuple[Moment, _Blocks]]  # host blocks each moment's takers below host are owed


@dataclass
class StorePlan:
    """Host slots reserved for a request's new blocks; fill ``buffers`` then complete."""

    keys: list[BlockKey]
    records: list[BlockRecord]
    block_indices: list[int]  # index of each planned block in the request
    buffers: list[torch.Tensor]
    already_cached: int = 0
    next_block: int = 0  # first block of the request this plan did not cover
    done: bool = field(default=False, repr=False)

    def reserve(self, i: int, key: BlockKey, record: BlockRecord, buf: torch.Tensor) -> None:
        self.keys.append(key)
        self.records.append(record)
        self.block_indices.append(i)
        self.buffers.append(buf)


class Stores:
    def __init__(self, tiers: TierSet, eviction: Eviction, pins: Pins, layout: KVLayout, writes: WritePolicy) -> None:
        self.tiers = tiers
        self.eviction = eviction
        self.pins = pins
        self.layout = layout
        self.writes = writes

    @property
    def plan_blocks(self) -> int:
        """Blocks one plan may reserve: half the host tier, so two stores can be filled at once."""
        return max(1, self.tiers.host.capacity_blocks // 2)

    # -- token chains ---------------------------------------------------------------------------------
    def prepare(self, prompt: KeyedTokens, start: int, stop: int) -> StorePlan:
        """Reserve host slots for blocks ``start .. stop`` of ``prompt`` not yet cached.

        The plan stops early when host memory cannot make room (everything
        pinned, or the range is larger than the tier) or at a block whose key
        holds other tokens: ``plan.next_block`` says where, and later blocks
        are useless without the missing one anyway.
        """
        keys, digests, host = prompt.keys, prompt.digests, self.tiers.host
        plan = StorePlan([], [], [], [], next_block=start)
        with self.tiers.lock:
            self.eviction.make_room(host, sum(not host.contains(keys[i]) for i in range(start, stop)))
            for i in range(start, stop):
                existing = host.record(keys[i])
                if existing is not None:
                    if not existing.matches(digests[i]):
                        host.stats.add(confirm_mismatches=1)
                        break
                    plan.already_cached += 1
                    plan.next_block = i + 1
                    continue
                record = BlockRecord(digests[i], keys[i - 1] if i else prompt.root)
                buf = host.reserve(keys[i], record)
                if buf is None:
                    break
                plan.reserve(i, keys[i], record, buf)
                plan.next_block = i + 1
        return plan

    def store(self, prompt: KeyedTokens, payloads: Payloads, first_block: int, num_blocks: int | None) -> int:
        """Store blocks ``first_block ..`` of ``prompt`` from ``payloads``, synchronously; how many were new."""
        if callable(payloads):
            fill = payloads
            last = prompt.num_blocks if num_blocks is None else min(prompt.num_blocks, first_block + num_blocks)
        else:
            fill = self._copier(payloads, first_block)
            last = min(prompt.num_blocks, first_block + len(payloads))
        return self._in_plans(lambda i, stop: self.prepare(prompt, i, stop), first_block, last, fill)

    def _copier(self, blocks: Sequence[torch.Tensor] | torch.Tensor, first_block: int) -> Fill:
        want = self.layout.block_bytes
        for j, block in enumerate(blocks):
            got = block.numel() * block.element_size()
            if got != want:
                raise ValueError(f"block {first_block + j}: payload of {got} B, layout wants {want} B")
        return lambda i, out: out.copy_(blocks[i - first_block].reshape(-1).view(torch.uint8))

    def _in_plans(self, prepare: Callable[[int, int], StorePlan], start: int, last: int, fill: Fill) -> int:
        """Prepare, fill and complete plans of :attr:`plan_blocks` from ``start`` to ``last`` while they progress."""
        stored, i = 0, start
        while i < last:
            plan = prepare(i, min(last, i + self.plan_blocks))
            try:
                for buf, b in zip(plan.buffers, plan.block_indices, strict=True):
                    fill(b, buf)
            except BaseException:
                self.complete(plan, success=False)
                raise
            stored += self.complete(plan, success=True)
            if plan.next_block == i:
                break  # no progress: host is pinned full, or a key holds other tokens
            i = plan.next_block
        return stored

    def complete(self, plan: StorePlan, success: bool) -> int:
        """Publish (``success``) or discard the plan's blocks; returns how many were indexed.

        Published blocks are copied at once to the tiers under host that take
        a copy at store (write-through, ``remote.write_on: store``), and those
        under a live TTL pin to the tiers that take a retained block: the
        promise usually comes first (a request is pinned at admission and
        stored after its prefill). Pinned meanwhile, with the lock released.
        """
        if plan.done:
            raise RuntimeError("store plan completed twice")
        plan.done = True
        host = self.tiers.host
        with self.tiers.lock:
            if not success:
                for key in plan.keys:
                    host.abort(key)
                return 0
            for key, record in zip(plan.keys, plan.records, strict=True):
                host.commit(key)
                self.eviction.inserted(TierKind.HOST, key, record.parent)
            copies = self._owed(list(zip(plan.keys, plan.records, strict=True)))
            held = self._hold(copies)
        self._copy(copies, held)
        return len(plan.keys)

    def retain(self, keys: Sequence[BlockKey]) -> None:
        """Copy the host blocks among ``keys``, just promised to be kept, to the tiers that take a retained block.

        The blocks not in host yet are copied when they are stored
        (:meth:`complete` sees their pin); both look under the lock, so a
        block committed while the promise is made is caught by one of the two.
        An owned tier that holds a block already is not written again.
        """
        if not self.eviction.copies_at(Moment.RETAINED):
            return
        host = self.tiers.host
        with self.tiers.lock:
            blocks = [(k, r) for k in keys if (r := host.record(k)) is not None]
            copies = [(Moment.RETAINED, blocks)] if blocks else []
            held = self._hold(copies)
        self._copy(copies, held)

    def _owed(self, blocks: _Blocks) -> _Copies:
        """The copies just-published ``blocks`` owe the tiers below: all at store, the promised ones at retain."""
        owed: _Copies = []
        if blocks and self.eviction.copies_at(Moment.STORED):
            owed.append((Moment.STORED, blocks))
        if blocks and self.eviction.copies_at(Moment.RETAINED):
            kept = set(self.pins.kept_among(k for k, _ in blocks))
            promised = [(k, r) for k, r in blocks if k in kept]
            if promised:
                owed.append((Moment.RETAINED, promised))
        return owed

    def _hold(self, copies: _Copies) -> list[BlockKey]:
        """Read-pin (lock held) the host blocks ``copies`` read, so their slots outlive the lock's release."""
        keys = list(dict.fromkeys(k for _, blocks in copies for k, _ in blocks))
        self.pins.pin(keys)
        return keys

    def _copy(self, copies: _Copies, held: list[BlockKey]) -> None:
        """Run ``copies`` with the lock released, then let go of the read pins :meth:`_hold` took."""
        if not held:
            return
        try:
            for moment, blocks in copies:
                self.eviction.copy_down(moment, blocks)
        finally:
            with self.tiers.lock:
                self.pins.unpin(held)

    def withdraw(self, plan: StorePlan) -> list[int]:
        """Discard a plan whose filler may still be writing: its keys free for others, its slots withheld.

        Returns the slots, for :meth:`release` once the filler can no longer
        write (see :meth:`~kvtier.tiers.host.HostTier.withhold`).
        """
        if plan.done:
            raise RuntimeError("store plan completed twice")
        plan.done = True
        host = self.tiers.host
        with self.tiers.lock:
            return [slot for key in plan.keys if (slot := host.withhold(key)) is not None]

    def release(self, slots: Sequence[int]) -> None:
        """Withheld slots (:meth:`withdraw`) back to the host tier's free list."""
        with self.tiers.lock:
            self.tiers.host.release(slots)

    def flush(self, deadline_s: float | None = None) -> int:
        """Write-back: copy every host block an owned tier under host lacks down to it; how many were written.

        Host memory dies with the process; this is what makes a write-back
        cache survive a clean shutdown (a crash loses only the unflushed
        blocks, which are then misses, never wrong KV). The most recently
        stored blocks go first, and no new batch starts after ``deadline_s``
        seconds (None: no limit): a supervisor's stop timeout must not turn a
        planned restart into a SIGKILL halfway through the index.
        """
        host = self.tiers.host
        takers = [t for t in self.tiers.owned if self.writes.copies(t.kind, Moment.CLOSED)]
        if not takers:
            return 0
        until = None if deadline_s is None else time.monotonic() + deadline_s
        with self.tiers.lock:
            dirty = [(k, r) for k, r in host.entries() if not all(t.contains(k) for t in takers)][::-1]
            self.pins.pin(k for k, _ in dirty)
        try:
            written = 0
            for start in range(0, len(dirty), 64):
                if until is not None and time.monotonic() >= until:
                    break
                written += self.eviction.copy_down(Moment.CLOSED, dirty[start : start + 64])
        finally:
            with self.tiers.lock:
                self.pins.unpin(k for k, _ in dirty)
        return written

    # -- named blocks ---------------------------------------------------------------------------------
    def prepare_named(self, keys: list[BlockKey], digests: Digests, start: int, stop: int) -> StorePlan:
        """Reserve host slots for the named blocks ``start .. stop`` that no local tier holds."""
        plan = StorePlan([], [], [], [], next_block=start)
        with self.tiers.lock:
            # Held for this name, or (a 128-bit collision) for another: either way never reserved again.
            held = [self.tiers.record(keys[i]) is not None for i in range(start, stop)]
            self.eviction.make_room(self.tiers.host, held.count(False))
            for i, present in zip(range(start, stop), held, strict=True):
                if not present:
                    record = BlockRecord(digests[i], None)
                    buf = self.tiers.host.reserve(keys[i], record)
                    if buf is None:
                        break
                    plan.reserve(i, keys[i], record, buf)
                else:
                    plan.already_cached += 1
                plan.next_block = i + 1
        return plan

    def store_named(self, keys: list[BlockKey], digests: Digests, fill: Fill) -> int:
        """Store the named blocks no tier holds, ``fill`` writing each; how many were new."""
        return self._in_plans(lambda i, stop: self.prepare_named(keys, digests, i, stop), 0, len(keys), fill)
