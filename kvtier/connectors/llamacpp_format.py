"""llama.cpp's saved state as bytes kvtier can keep: a versioned header, raw arrays, block-sized chunks.

llama-cpp-python's own ``LlamaDiskCache`` pickles its ``LlamaState``; a
pickle read back from a cache that other processes write is code run on
load. This format is data only: a msgspec header and raw little-endian
arrays, decoded into fixed types or refused.

Payload (one saved state)::

    b"KVLS" | uint32 LE header length | msgpack StateHeader
    | input_ids[:n_tokens] as int32 LE
    | scores as float32 LE, score_rows x n_vocab   (only when kept: see KVTierLlamaCache)
    | llama_state (llama_state_size bytes: llama.cpp's own KV and context serialisation)

A marker (a pointer from a prefix position to a state) is a payload too:
``b"KVLM" | msgpack Marker``.

Chunks: a payload is cut into pieces that each fill one kvtier named block.
Every chunk starts with ``CHUNK_HEAD``: the payload's tag (xxh3-128 of the
whole payload), the chunk's index, the chunk count and the bytes of payload
it carries (uint32 LE each). The tag in every chunk means chunks of two
different writes can never be joined into one payload, and the tag
recomputed over the joined bytes means a payload is used only whole and
exactly as written. The service adds its own CRC-32C per block and the disk
tier checks it on every read; the tag is what makes the *object* whole.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np
import xxhash

FORMAT_VERSION = 1
STATE_MAGIC = b"KVLS"
MARKER_MAGIC = b"KVLM"
CHUNK_HEAD = struct.Struct("<16sIII")  # tag, index, count, payload bytes in this chunk
MAX_CHUNKS = 1 << 20  # a count above this is a damaged head, not a state
_LEN = struct.Struct("<I")


class StateFormatError(ValueError):
    """Chunks or bytes that are not one whole payload of this format: a miss, never a state."""


class StateHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    n_tokens: int  # tokens whose KV llama_state holds
    n_ctx: int  # length of llama-cpp-python's input_ids buffer when saved
    n_vocab: int
    score_rows: int  # rows of LlamaState.scores when saved
    scores_kept: bool
    llama_state_size: int
    seed: int


class Marker(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefix position's pointer to a state stored under another position (see :mod:`.llamacpp_store`)."""

    version: int
    position: bytes  # the state's own position: the chain key of its last full block
    generation: int
    chunks: int
    tag: bytes  # the state's payload tag: a later write into the same slot is not the state pointed to


class SavedLike(Protocol):
    """What is read of a ``llama_cpp.llama.LlamaState`` (duck-typed: this module needs no llama_cpp)."""

    input_ids: np.ndarray
    scores: np.ndarray
    n_tokens: int
    llama_state: bytes
    llama_state_size: int
    seed: int


@dataclass(frozen=True)
class SavedState:
    """A payload decoded: views into its bytes, no copy."""

    header: StateHeader
    input_ids: np.ndarray  # int32 [n_tokens]
    scores: np.ndarray | None  # float32 [score_rows, n_vocab], when kept
    llama_state: memoryview  # llama_state_size bytes


class Payload:
    """Bytes in parts (no concatenation: a state is mostly one large llama_state), its tag, and its chunks."""

    def __init__(self, parts: Sequence[bytes | memoryview | np.ndarray], chunk_bytes: int) -> None:
        if chunk_bytes <= CHUNK_HEAD.size:
            raise ValueError(f"chunks of {chunk_bytes} B cannot hold a {CHUNK_HEAD.size}-byte head")
        self.parts = [np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts]
        self.length = sum(len(p) for p in self.parts)
        self.chunk_bytes = chunk_bytes
        h = xxhash.xxh3_128()
        for part in self.parts:
            h.update(part)
        self.tag = h.digest()

    @property
    def data_per_chunk(self) -> int:
        return self.chunk_bytes - CHUNK_HEAD.size

    @property
    def count(self) -> int:
        return max(1, -(-self.length // self.data_per_chunk))

    def write_chunk(self, i: int, out: np.ndarray) -> None:
        """Chunk ``i`` into ``out`` (uint8, at least ``chunk_bytes``): its head, then its slice of the payload."""
        start = i * self.data_per_chunk
        stop = min(self.length, start + self.data_per_chunk)
        out[: CHUNK_HEAD.size] = np.frombuffer(CHUNK_HEAD.pack(self.tag, i, self.count, stop - start), np.uint8)
        at, dest = 0, CHUNK_HEAD.size
        for part in self.parts:
            lo, hi = max(start, at), min(stop, at + len(part))
            if lo < hi:
                out[dest : dest + hi - lo] = part[lo - at : hi - at]
                dest += hi - lo
            at += len(part)


def chunk_head(chunk: np.ndarray) -> tuple[bytes, int, int, int]:
    """``(tag, index, count, length)`` of one chunk, unchecked."""
    return CHUNK_HEAD.unpack(chunk[: CHUNK_HEAD.size].tobytes())


class Assembly:
    """One payload put back together from its chunks, fed in order (a piece at a time, so few are pinned at once).

    Every chunk must carry the first chunk's tag and count and its own
    index, lengths must fit, and :meth:`finish` checks that the tag hashes
    the joined bytes: anything else is :class:`StateFormatError`.
    """

    def __init__(self, first: np.ndarray) -> None:
        self.tag, index, self.count, _ = chunk_head(first)
        self.room = len(first) - CHUNK_HEAD.size
        if index != 0 or not 0 < self.count <= MAX_CHUNKS:
            raise StateFormatError(f"a first chunk with index {index} of {self.count}")
        self._out = bytearray(self.count * self.room)
        self._view = np.frombuffer(self._out, dtype=np.uint8)
        self._next = 0
        self._length = 0

    def add(self, chunk: np.ndarray) -> None:
        """Copy the next chunk's bytes out (the caller may release its slot right after)."""
        tag, index, count, length = chunk_head(chunk)
        i = self._next
        last = i == self.count - 1
        if (
            tag != self.tag
            or index != i
            or count != self.count
            or length > self.room
            or (length < self.room and not last)
        ):
            raise StateFormatError(f"chunk {i} is not chunk {i} of the write its first chunk belongs to")
        self._view[self._length : self._length + length] = chunk[CHUNK_HEAD.size : CHUNK_HEAD.size + length]
        self._length += length
        self._next += 1

    @property
    def missing(self) -> int:
        return self.count - self._next

    def finish(self) -> bytearray:
        if self.missing:
            raise StateFormatError(f"{self._next} chunks of {self.count}")
        self._view = np.empty(0, dtype=np.uint8)  # release the export before resizing
        del self._out[self._length :]
        if xxhash.xxh3_128_digest(self._out) != self.tag:
            raise StateFormatError("the joined bytes do not hash to their tag")
        return self._out


def join(chunks: Sequence[np.ndarray]) -> bytearray:
    """The payload ``chunks`` carry, all at once (see :class:`Assembly`)."""
    if not chunks:
        raise StateFormatError("no chunks")
    assembly = Assembly(chunks[0])
    for chunk in chunks:
        assembly.add(chunk)
    return assembly.finish()


# -- states ---------------------------------------------------------------------------------------
def pack_state(state: SavedLike, chunk_bytes: int, *, keep_scores: bool) -> Payload:
    """``state`` as a payload; its scores only when ``keep_scores`` (their shape is always kept)."""
    n = int(state.n_tokens)
    scores = np.asarray(state.scores)
    ids = np.ascontiguousarray(np.asarray(state.input_ids)[:n], dtype="<i4")
    if len(ids) != n:
        raise ValueError(f"a state of {n} tokens with {len(ids)} input ids")
    header = StateHeader(
        version=FORMAT_VERSION,
        n_tokens=n,
        n_ctx=len(state.input_ids),
        n_vocab=int(scores.shape[1]) if scores.ndim == 2 else 0,
        score_rows=int(scores.shape[0]) if scores.ndim == 2 else 0,
        scores_kept=keep_scores,
        llama_state_size=int(state.llama_state_size),
        seed=int(state.seed),
    )
    raw = msgspec.msgpack.encode(header)
    body = memoryview(state.llama_state)[: header.llama_state_size]
    if len(body) != header.llama_state_size:
        raise ValueError(f"llama_state holds {len(body)} bytes, llama_state_size says {header.llama_state_size}")
    parts: list[bytes | memoryview | np.ndarray] = [STATE_MAGIC + _LEN.pack(len(raw)) + raw, ids]
    if keep_scores:
        parts.append(np.ascontiguousarray(scores, dtype="<f4"))
    parts.append(body)
    return Payload(parts, chunk_bytes)


def unpack_state(payload: bytes | bytearray | memoryview) -> SavedState:
    """The state a payload holds, as views into it; :class:`StateFormatError` for anything else."""
    view = memoryview(payload).cast("B")
    header = _state_header(view)
    if header.version != FORMAT_VERSION:
        raise StateFormatError(f"state format {header.version}, this code reads {FORMAT_VERSION}")
    at = len(STATE_MAGIC) + _LEN.size + _LEN.unpack(view[len(STATE_MAGIC) : len(STATE_MAGIC) + _LEN.size])[0]
    ids_bytes = 4 * header.n_tokens
    scores_bytes = 4 * header.score_rows * header.n_vocab if header.scores_kept else 0
    if min(header.n_tokens, header.score_rows, header.n_vocab, header.llama_state_size) < 0:
        raise StateFormatError("negative sizes in the header")
    want = at + ids_bytes + scores_bytes + header.llama_state_size
    if len(view) != want:
        raise StateFormatError(f"{len(view)} bytes, the header accounts for {want}")
    ids = np.frombuffer(view, dtype="<i4", count=header.n_tokens, offset=at).astype(np.int32, copy=False)
    at += ids_bytes
    scores = None
    if header.scores_kept:
        flat = np.frombuffer(view, dtype="<f4", count=header.score_rows * header.n_vocab, offset=at)
        scores = flat.reshape(header.score_rows, header.n_vocab)
    at += scores_bytes
    return SavedState(header, ids, scores, view[at : at + header.llama_state_size])


# -- markers --------------------------------------------------------------------------------------
def pack_marker(marker: Marker, chunk_bytes: int) -> Payload:
    return Payload([MARKER_MAGIC + msgspec.msgpack.encode(marker)], chunk_bytes)


def unpack_marker(payload: bytes | bytearray | memoryview) -> Marker:
    view = memoryview(payload).cast("B")
    if bytes(view[: len(MARKER_MAGIC)]) != MARKER_MAGIC:
        raise StateFormatError("not a marker")
    try:
        marker = msgspec.msgpack.decode(view[len(MARKER_MAGIC) :], type=Marker)
    except msgspec.DecodeError as err:
        raise StateFormatError(f"not a marker of format {FORMAT_VERSION}: {err}") from None
    if marker.version != FORMAT_VERSION:
        raise StateFormatError(f"marker format {marker.version}, this code reads {FORMAT_VERSION}")
    return marker


def _state_header(view: memoryview) -> StateHeader:
    start = len(STATE_MAGIC) + _LEN.size
    if len(view) < start or bytes(view[: len(STATE_MAGIC)]) != STATE_MAGIC:
        raise StateFormatError("not a saved llama.cpp state")
    (n,) = _LEN.unpack(view[len(STATE_MAGIC) : start])
    if start + n > len(view):
        raise StateFormatError("the header runs past the payload")
    try:
        return msgspec.msgpack.decode(view[start : start + n], type=StateHeader)
    except msgspec.DecodeError as err:
        raise StateFormatError(f"not a state header of format {FORMAT_VERSION}: {err}") from None
