"""The saved-state format and its chunks, without llama.cpp: exact bytes in, exact bytes out, or a refusal."""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec
import numpy as np
import pytest

from kvtier.connectors.llamacpp_format import (
    CHUNK_HEAD,
    FORMAT_VERSION,
    Marker,
    StateFormatError,
    chunk_head,
    join,
    pack_marker,
    pack_state,
    unpack_marker,
    unpack_state,
)

CHUNK = 1536


@dataclass
class FakeState:
    """What llama-cpp-python's LlamaState carries: input_ids is the whole n_ctx buffer, scores a slice of rows."""

    input_ids: np.ndarray
    scores: np.ndarray
    n_tokens: int
    llama_state: bytes
    llama_state_size: int
    seed: int


def fake_state(n_tokens: int, *, n_ctx: int = 64, vocab: int = 10, state_bytes: int = 5000, seed: int = 0) -> FakeState:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, size=n_ctx).astype(np.intc)  # past n_tokens: whatever the buffer held
    scores = rng.standard_normal((min(n_tokens, 8), vocab)).astype(np.single)
    blob = rng.bytes(state_bytes)
    return FakeState(ids, scores, n_tokens, blob, state_bytes, 4294967295)


def chunks_of(payload) -> list[np.ndarray]:
    out = []
    for i in range(payload.count):
        buf = np.full(CHUNK, 0xEE, dtype=np.uint8)  # a slot's stale bytes past the chunk's end
        payload.write_chunk(i, buf)
        out.append(buf)
    return out


@pytest.mark.parametrize("keep_scores", [False, True])
def test_a_state_round_trips_through_its_chunks(keep_scores: bool) -> None:
    state = fake_state(20)
    payload = pack_state(state, CHUNK, keep_scores=keep_scores)
    chunks = chunks_of(payload)
    assert payload.count == len(chunks) == -(-payload.length // (CHUNK - CHUNK_HEAD.size))
    assert [chunk_head(c)[1:3] for c in chunks] == [(i, payload.count) for i in range(payload.count)]
    got = unpack_state(join(chunks))
    h = got.header
    assert (h.version, h.n_tokens, h.n_ctx, h.n_vocab, h.score_rows) == (FORMAT_VERSION, 20, 64, 10, 8)
    assert h.seed == 2**32 - 1
    assert h.scores_kept is keep_scores and h.llama_state_size == 5000
    assert np.array_equal(got.input_ids, state.input_ids[:20]) and got.input_ids.dtype == np.int32
    assert bytes(got.llama_state) == state.llama_state
    if keep_scores:
        assert got.scores is not None and np.array_equal(got.scores, state.scores)
    else:
        assert got.scores is None  # only the shape travels (see KVTierLlamaCache on why)


def test_a_payload_smaller_than_a_chunk_is_one_chunk() -> None:
    payload = pack_state(fake_state(2, state_bytes=10), CHUNK, keep_scores=False)
    assert payload.count == 1
    assert bytes(unpack_state(join(chunks_of(payload))).llama_state) == payload.parts[-1].tobytes()


def test_chunks_that_are_not_one_whole_write_are_refused() -> None:
    chunks = chunks_of(pack_state(fake_state(20), CHUNK, keep_scores=False))
    other = chunks_of(pack_state(fake_state(20, seed=1), CHUNK, keep_scores=False))
    assert len(chunks) >= 4
    with pytest.raises(StateFormatError, match="chunks of"):
        join(chunks[:-1])  # one missing
    with pytest.raises(StateFormatError, match="not chunk 1"):
        join([chunks[0], chunks[2], chunks[1], *chunks[3:]])  # out of order
    with pytest.raises(StateFormatError, match="not chunk 2"):
        join([*chunks[:2], other[2], *chunks[3:]])  # another write's chunk at its own index
    flipped = [c.copy() for c in chunks]
    flipped[1][CHUNK_HEAD.size + 100] ^= 1
    with pytest.raises(StateFormatError, match="tag"):
        join(flipped)
    with pytest.raises(StateFormatError, match="no chunks"):
        join([])


def test_bytes_that_are_not_a_state_are_refused() -> None:
    good = bytes(join(chunks_of(pack_state(fake_state(12), CHUNK, keep_scores=False))))
    with pytest.raises(StateFormatError, match="not a saved"):
        unpack_state(b"PICKLE" + good)
    with pytest.raises(StateFormatError, match="header accounts"):
        unpack_state(good[:-1])
    with pytest.raises(StateFormatError, match="header runs past"):
        unpack_state(good[:8])
    newer = pack_state(fake_state(12), CHUNK, keep_scores=False)
    (n,) = np.frombuffer(newer.parts[0][4:8].tobytes(), "<u4")
    header = msgspec.msgpack.decode(newer.parts[0][8 : 8 + n].tobytes())
    raw = msgspec.msgpack.encode({**header, "version": FORMAT_VERSION + 1})
    with pytest.raises(StateFormatError, match="format 2"):
        unpack_state(b"KVLS" + len(raw).to_bytes(4, "little") + raw + good[8 + n :])
    extra = msgspec.msgpack.encode({**header, "pickle": "cos\nsystem\n"})
    with pytest.raises(StateFormatError, match="not a state header"):
        unpack_state(b"KVLS" + len(extra).to_bytes(4, "little") + extra + good[8 + n :])


def test_a_state_whose_sizes_disagree_is_not_packed() -> None:
    state = fake_state(12)
    with pytest.raises(ValueError, match="llama_state_size"):
        pack_state(replace(state, llama_state_size=6000), CHUNK, keep_scores=False)
    with pytest.raises(ValueError, match="input ids"):
        pack_state(replace(state, n_tokens=100), CHUNK, keep_scores=False)


def test_markers_round_trip_and_nothing_else_is_one() -> None:
    marker = Marker(FORMAT_VERSION, b"p" * 16, 2, 7, b"t" * 16)
    assert unpack_marker(join(chunks_of(pack_marker(marker, CHUNK)))) == marker
    state = join(chunks_of(pack_state(fake_state(12), CHUNK, keep_scores=False)))
    with pytest.raises(StateFormatError, match="not a marker"):
        unpack_marker(state)
    with pytest.raises(StateFormatError, match="not a saved"):
        unpack_state(join(chunks_of(pack_marker(marker, CHUNK))))
