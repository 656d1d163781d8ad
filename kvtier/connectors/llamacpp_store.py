"""Where llama.cpp's saved states live among kvtier's named blocks, and how the longest prefix is found.

**Positions.** A state is stored under its *position*: the chain key
(kvtier's :class:`~kvtier.keys.KeyHasher` chain over the state's tokens,
full blocks only) of its last full block. Its chunks are the named blocks
``state(position, generation, i)``. Chunk 0 is written last, so a visible
chunk 0 means every chunk was committed before it.

**Finding.** The chain keys of a query name every position at which a state
covering a prefix of it could be stored. One ``named_exists`` over all of
them (round trip 1) says which are taken; the deepest wins, and one
``named_load`` of its chunks (round trip 2) brings it. The load asks for as
many chunks as a state ending there can have, from the KV bytes a token
takes; a state larger than that (scores kept) costs a third trip.

**Markers.** A state sits at its own end, but the next prompt often leaves
it before that end: the same document with another question after a
completion, a transcript edited half-way. So a save also leaves *markers*
(one block each: the state's position, generation, chunk count and tag)
at a few positions inside the state: the end of the prompt the state
answered, and every ``mark_every`` blocks. A query that ends inside a state
finds the deepest marker in round trip 1, reads it (2), then the state (3).
Markers cost a block each, which is why not every position gets one: a
query that diverges between two marks reuses the prefix up to the earlier.
A marker names its state's tag, so it never leads to a later write.

**Generations.** Named blocks are write-once (a held name is not written
again) and each chunk is evicted on its own, so a position may hold a
damaged state: a chunk evicted, or dropped by the disk tier for failing its
checksum. A save that finds one writes the next generation beside it; a
find tries the newest generation first. ``GENERATIONS`` bounds both.

Every state is returned only when every chunk loaded and the joined bytes
hash to their tag (:func:`~kvtier.connectors.llamacpp_format.join`);
anything else is a miss and the next candidate is tried, at most
``MAX_TRIES`` of them. This module needs no llama_cpp, so it is tested over
an embedded :class:`~kvtier.manager.CacheManager` as well as the service.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.cache import NamedBlocks
from kvtier.connectors.llamacpp_format import (
    CHUNK_HEAD,
    FORMAT_VERSION,
    MAX_CHUNKS,
    Assembly,
    Marker,
    Payload,
    SavedState,
    StateFormatError,
    StateHeader,
    chunk_head,
    join,
    pack_marker,
    unpack_marker,
    unpack_state,
)
from kvtier.keys import KeyHasher

GENERATIONS = 3
MARK_EVERY = 32  # blocks between markers: a block's worth of marker per this many blocks of state
MAX_TRIES = 3  # candidates read before a find gives up: each may cost a state's worth of reads
STATE_SLACK_BYTES = 1 << 20  # what a state holds beyond its tokens' KV (headers, llama.cpp's own fields)
_NAME = b"kvtier-llamacpp-1"
_GEN_INDEX = struct.Struct("<BI")


def state_name(position: bytes, generation: int, index: int) -> bytes:
    return _NAME + b"S" + position + _GEN_INDEX.pack(generation, index)


def mark_name(position: bytes, generation: int) -> bytes:
    return _NAME + b"M" + position + bytes([generation])


class Kind(enum.Enum):
    STATE = "state"  # the state's own chunks: it ends at this position
    MARK = "mark"  # a pointer: a state that goes on past this position


@dataclass(frozen=True)
class Candidate:
    block: int  # the query's block this position is the key of
    kind: Kind
    generation: int


@dataclass(frozen=True)
class Found:
    state: SavedState
    blocks: int  # leading full blocks of the query the state covers
    kind: Kind


class SaveOutcome(enum.StrEnum):
    STORED = "stored"
    HELD = "held"  # a whole state already sits at its position: nothing written
    TOO_SHORT = "too_short"  # not one full block: nothing to find it by
    NO_ROOM = "no_room"  # every generation at its position is taken
    FAILED = "failed"  # the service stored only part of it (full, or gone): not published


@dataclass(frozen=True)
class Saved:
    outcome: SaveOutcome
    where: Marker | None = None  # the state that now serves the position (stored, or held already)


class StateStore:
    """Saved states of one model and context flavour in one namespace of a cache (service or embedded)."""

    def __init__(
        self,
        blocks: NamedBlocks,
        hasher: KeyHasher,
        namespace: str,
        *,
        chunk_bytes: int,
        token_bytes: int,
        flavour: str = "",
        mark_every: int = MARK_EVERY,
        max_pinned: int | None = None,
    ) -> None:
        """``hasher`` chains the tokens into positions; ``flavour`` names whatever else makes two states
        incompatible (llama.cpp's KV types, flash attention), so that they never share a position.
        ``token_bytes``: KV bytes one token takes in a state (sizes the first load).
        ``max_pinned``: chunks one load may pin (None: a whole state), so that a
        state larger than the host tier still loads, a piece at a time.
        """
        if mark_every <= 0:
            raise ValueError("mark_every must be positive")
        self.blocks = blocks
        self.hasher = hasher
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self.token_bytes = token_bytes
        self.mark_every = mark_every
        self.max_pinned = max_pinned or MAX_CHUNKS
        self._chain_namespace = f"{namespace}\0llama.cpp\0{flavour}"

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def positions(self, tokens: np.ndarray) -> list[bytes]:
        return list(self.hasher.keys(tokens, self._chain_namespace))

    # -- finding -----------------------------------------------------------------------------------
    def candidates(self, positions: Sequence[bytes]) -> list[Candidate]:
        """Every state or marker stored at one of ``positions``, best first (deepest, state before marker, newest)."""
        names: list[bytes] = []
        where: list[Candidate] = []
        for j in range(len(positions) - 1, -1, -1):
            for g in reversed(range(GENERATIONS)):
                names.append(state_name(positions[j], g, 0))
                where.append(Candidate(j, Kind.STATE, g))
            for g in reversed(range(GENERATIONS)):
                names.append(mark_name(positions[j], g))
                where.append(Candidate(j, Kind.MARK, g))
        if not names:
            return []
        flags = self.blocks.named_exists(names, self.namespace)
        return [c for c, present in zip(where, flags, strict=True) if present]

    def find(self, tokens: np.ndarray, accept: Callable[[StateHeader], bool] = lambda _: True) -> Found | None:
        """The stored state covering the most leading full blocks of ``tokens`` that ``accept`` takes; None: a miss."""
        positions = self.positions(tokens)
        for cand in self.candidates(positions)[:MAX_TRIES]:
            state = self._read(positions[cand.block], cand)
            if state is not None and accept(state.header):
                return Found(state, cand.block + 1, cand.kind)
        return None

    def _read(self, position: bytes, cand: Candidate) -> SavedState | None:
        try:
            if cand.kind is Kind.STATE:
                return self._read_state(position, cand.generation, self._chunks_for(cand.block + 1), None)
            marker = unpack_marker(self._load_whole([mark_name(position, cand.generation)]))
            return self._read_state(marker.position, marker.generation, marker.chunks, marker.tag)
        except StateFormatError:
            return None

    def _chunks_for(self, blocks: int) -> int:
        """Chunks a state ending in block ``blocks - 1`` can take: its tokens' KV (a partial block too), and slack."""
        most = (blocks + 1) * self.block_size * self.token_bytes + STATE_SLACK_BYTES
        return -(-most // (self.chunk_bytes - CHUNK_HEAD.size))

    def _read_state(self, position: bytes, generation: int, ask: int, tag: bytes | None) -> SavedState:
        """Load a state's chunks a piece at a time (``max_pinned``), copying each piece out before the next.

        The first piece asks for ``ask`` chunks (the count is in chunk 0,
        unknown until it is read); a state with more costs more pieces.
        """
        names = [state_name(position, generation, i) for i in range(min(ask, self.max_pinned))]
        assembly: Assembly | None = None
        while names:
            with self.blocks.named_load(names, self.namespace) as piece:
                chunks = [b.numpy() for b in piece.blocks]
                if assembly is None:
                    if not chunks:
                        raise StateFormatError("its first chunk is gone")
                    assembly = Assembly(chunks[0])
                    if tag is not None and assembly.tag != tag:
                        raise StateFormatError("the marker's state was replaced")
                for chunk in chunks[: assembly.missing]:
                    assembly.add(chunk)
            if len(chunks) < len(names) and assembly.missing:
                raise StateFormatError(f"chunk {assembly.count - assembly.missing} of {assembly.count} is gone")
            done = assembly.count - assembly.missing
            names = [
                state_name(position, generation, i) for i in range(done, min(assembly.count, done + self.max_pinned))
            ]
        assert assembly is not None
        return unpack_state(assembly.finish())

    def _load_whole(self, names: list[bytes]) -> bytearray:
        with self.blocks.named_load(names, self.namespace) as load:
            return join([b.numpy() for b in load.blocks])

    # -- saving ------------------------------------------------------------------------------------
    def marks(self, blocks: int, prompt_tokens: int) -> list[int]:
        """Blocks inside a state of ``blocks`` full blocks that get a marker: every ``mark_every``, the prompt's end."""
        end = blocks - 1
        marks = set(range(self.mark_every - 1, end, self.mark_every))
        prompt_end = prompt_tokens // self.block_size - 1
        if 0 <= prompt_end < end:
            marks.add(prompt_end)
        return sorted(marks)

    def save(self, tokens: np.ndarray, payload: Payload, prompt_tokens: int = 0) -> Saved:
        """Store a state whose KV covers ``tokens`` (its ``input_ids[:n_tokens]``) unless one sits at its position.

        ``prompt_tokens``: how many leading ``tokens`` were the prompt it
        answered (0: unknown); that prompt's end gets a marker.
        """
        positions = self.positions(tokens)
        if not positions:
            return Saved(SaveOutcome.TOO_SHORT)
        position, n = positions[-1], payload.count
        marks = self.marks(len(positions), prompt_tokens)
        state_names = [state_name(position, g, i) for g in range(GENERATIONS) for i in range(n)]
        mark_names = [mark_name(positions[p], g) for p in marks for g in range(GENERATIONS)]
        flags = self.blocks.named_exists(state_names + mark_names, self.namespace)
        taken = [flags[g * n : (g + 1) * n] for g in range(GENERATIONS)]
        target = next((m for g in range(GENERATIONS) if taken[g][0] and (m := self._whole_at(position, g))), None)
        outcome = SaveOutcome.HELD
        if target is None:
            free = next((g for g in range(GENERATIONS) if not any(taken[g])), None)
            if free is None:
                return Saved(SaveOutcome.NO_ROOM)
            if not self._write(position, free, payload):
                return Saved(SaveOutcome.FAILED)
            target = Marker(FORMAT_VERSION, position, free, n, payload.tag)
            outcome = SaveOutcome.STORED
        repair = outcome is SaveOutcome.STORED and target.generation > 0
        self._mark([positions[p] for p in marks], flags[len(state_names) :], target, repair=repair)
        return Saved(outcome, target)

    def _whole_at(self, position: bytes, generation: int) -> Marker | None:
        """A marker to the state at ``(position, generation)`` if all its chunks are held, else None."""
        with self.blocks.named_load([state_name(position, generation, 0)], self.namespace) as head:
            if not head.blocks:
                return None
            tag, index, count, _ = chunk_head(head.blocks[0].numpy())
        if index != 0 or not 0 < count <= MAX_CHUNKS:
            return None
        names = [state_name(position, generation, i) for i in range(count)]
        if not all(self.blocks.named_exists(names, self.namespace)):
            return None
        return Marker(FORMAT_VERSION, position, generation, count, tag)

    def _write(self, position: bytes, generation: int, payload: Payload) -> bool:
        """Body first, chunk 0 last: nobody can find the state before every chunk is committed."""
        names = [state_name(position, generation, i) for i in range(payload.count)]
        body = self.blocks.named_store_from(
            names[1:], lambda i, out: payload.write_chunk(i + 1, out.numpy()), self.namespace
        )
        if body != len(names) - 1:
            return False
        return (
            self.blocks.named_store_from(names[:1], lambda _, out: payload.write_chunk(0, out.numpy()), self.namespace)
            == 1
        )

    def _mark(self, positions: list[bytes], flags: list[bool], target: Marker, *, repair: bool) -> None:
        """A marker at each of ``positions`` that has none (or, after a repair, at its first free generation).

        First come keeps a position: a state that extends a marked prefix
        is as good a hit there as any other. A repair is the exception: the
        markers already there may lead to the damaged generation it replaced.
        """
        names: list[bytes] = []
        for k, position in enumerate(positions):
            taken = flags[k * GENERATIONS : (k + 1) * GENERATIONS]
            free = next((g for g in range(GENERATIONS) if not taken[g]), None)
            if free is not None and (repair or not any(taken)):
                names.append(mark_name(position, free))
        if names:
            marker = pack_marker(target, self.chunk_bytes)
            self.blocks.named_store_from(names, lambda _, out: marker.write_chunk(0, out.numpy()), self.namespace)
