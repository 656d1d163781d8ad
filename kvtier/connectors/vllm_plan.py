"""What kvtier's vLLM connector moves each step, decided apart from vLLM (tested without it installed).

The connector's scheduler side keeps one :class:`RequestPlan` per running
request and, each step, turns vLLM's count of the request's computed tokens
into at most one load and one save (:meth:`RequestPlan.step`), each a
:class:`Transfer` the workers carry out. The worker side keeps
:class:`FailedLoads`, which holds back the saves of KV computed over a block
that failed to load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.connectors.paged import BlockMap, Segment, segments


@dataclass
class Transfer:
    """Blocks ``first_block ..`` of one request's kvtier chain and the rows of vLLM's pool they cover.

    ``tokens`` are the request's tokens up to the last block's end (the keys);
    ``block_table`` is the request's vLLM block ids by position.
    """

    req_id: str
    namespace: str
    tokens: list[int]
    first_block: int
    num_blocks: int
    segments: list[Segment]
    block_table: list[int]

    def by_block(self) -> dict[int, list[Segment]]:
        out: dict[int, list[Segment]] = {}
        for s in self.segments:
            out.setdefault(s.kv_block, []).append(s)
        return out


@dataclass
class RequestPlan:
    """The scheduler's view of one running request."""

    tokens: list[int]
    namespace: str
    block_table: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # kvtier blocks of the prompt already saved (or found cached)
    saving: bool = False  # a save was sent to the workers: the blocks outlive the request until they report
    cached_blocks: int | None = None  # the service's answer, asked once per request
    load_tokens: int = 0  # claimed by get_num_new_matched_tokens, granted by update_state_after_alloc

    def step(self, req_id: str, m: BlockMap, computed: int, scheduled: int) -> tuple[Transfer | None, Transfer | None]:
        """This step's load and save: ``computed`` tokens are in vLLM's pool (or loading), ``scheduled`` run now.

        ``computed`` goes back when vLLM recomputes: after blocks failed to
        load (it truncates the count to the first failed block) or a
        preemption. Blocks from there on are not in its pool any more, so
        they count as unsaved again and are saved once recomputed; otherwise
        a block that failed to load (damaged on disk, evicted) would stay a
        miss for every later request. Blocks the service holds already cost
        one round trip, never a second copy.
        """
        self.saved_blocks = min(self.saved_blocks, computed // m.kv_block)
        load = self._load(req_id, m, computed) if self.load_tokens else None
        done = min(computed + scheduled, len(self.tokens)) // m.kv_block  # full prompt blocks computed after this step
        if done <= self.saved_blocks:
            return load, None
        first = self.saved_blocks
        save = Transfer(
            req_id,
            self.namespace,
            self.tokens[: done * m.kv_block],
            first,
            done - first,
            segments(first * m.kv_block, done * m.kv_block, m.kv_block, m.engine_block),
            list(self.block_table),
        )
        self.saved_blocks = done
        self.saving = True
        return load, save

    def _load(self, req_id: str, m: BlockMap, computed: int) -> Transfer:
        start = computed - self.load_tokens  # num_computed_tokens already counts the tokens being loaded
        blocks = m.kv_blocks(start, computed)
        load = Transfer(
            req_id,
            self.namespace,
            self.tokens[: blocks.stop * m.kv_block],
            blocks.start,
            len(blocks),
            segments(start, computed, m.kv_block, m.engine_block),
            list(self.block_table),
        )
        self.saved_blocks = max(self.saved_blocks, computed // m.kv_block)
        self.load_tokens = 0
        return load


class FailedLoads:
    """The worker's record of loads that failed, until the scheduler plans the request's saves again.

    vLLM runs the whole step before it hears that a block did not load, so
    what the step computed after that block attended to rows that were never
    filled. A save of it would store wrong KV under the right keys, and the
    service keeps the first copy of a block, so the good copy computed later
    would be skipped. Such saves are dropped: every save of the failing step
    for that request, and later ones that start past the failed block (planned
    before vLLM truncated the request, under async scheduling). The save the
    scheduler plans once vLLM recomputes starts at or before the failed block
    (:meth:`RequestPlan.step`) and ends the watch.
    """

    def __init__(self) -> None:
        self._first_failed: dict[str, int] = {}  # request -> its first kvtier block that did not load
        self._this_step: set[str] = set()

    def failed(self, req_id: str, kv_block: int) -> None:
        """Kvtier block ``kv_block`` of ``req_id`` (and maybe later ones) did not load in this step."""
        self._first_failed[req_id] = min(kv_block, self._first_failed.get(req_id, kv_block))
        self._this_step.add(req_id)

    def admitted(self, saves: Iterable[Transfer]) -> list[Transfer]:
        """This step's saves that hold only KV computed over loaded or computed blocks; ends the step."""
        out = []
        for t in saves:
            first = self._first_failed.get(t.req_id)
            if t.req_id in self._this_step or (first is not None and t.first_block > first):
                continue
            self._first_failed.pop(t.req_id, None)
            out.append(t)
        self._this_step.clear()
        return out

    def forget(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self._first_failed.pop(r, None)
