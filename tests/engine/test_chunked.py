"""Chunked prefill, prefixes shared while being computed, and aborts, on the real model.

Every case compares greedy tokens with an engine that prefills each prompt
in one piece and caches nothing: chunking and sharing must not change a
single token. Progress is asserted in engine steps, never in seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import Config, load_config
from kvtier.engine.engine import Engine, FinishReason
from kvtier.engine.runtime import LoadedModel, make_engine
from kvtier.engine.sampling import SamplingParams
from kvtier.keys import KeyHasher, Secret

B = 16
GREEDY = SamplingParams(max_tokens=6)


def config(tmp: Path, **engine: object) -> Config:
    cfg = load_config(environ={"KVTIER_DATA_DIR": str(tmp / "data"), "KVTIER_ENGINE__DTYPE": "float32"})
    tree = cfg.model_dump()
    tree["engine"] = {**tree["engine"], "pool_bytes": 400 * 46080 * B, **engine}
    return Config.model_validate(tree)


def pooled(loaded: LoadedModel, tmp: Path, **engine: object) -> Engine:
    """An engine with its own resident pool and keys, no kvtier tiers: sharing happens in the pool alone."""
    hasher = KeyHasher(
        Secret.load_or_create(tmp / "data"),
        model_fingerprint=loaded.fingerprint,
        layout_descriptor=loaded.model.kv_layout(B).descriptor,
        block_size=B,
    )
    return make_engine(loaded, config(tmp, **engine), cache=None, keep_resident=True, hasher=hasher)


def words(loaded: LoadedModel, n: int, seed: int) -> list[int]:
    text = " ".join(f"item{(i * 7919 + seed) % 1000}" for i in range(n))
    return loaded.tokenizer.encode(text)


@pytest.fixture(scope="module")
def reference(loaded_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    tmp = tmp_path_factory.mktemp("whole")
    return make_engine(loaded_model, config(tmp, max_step_tokens=8192), cache=None, keep_resident=False)


def alone(reference: Engine, ids: list[int]) -> list[int]:
    (done,) = reference.generate([ids], GREEDY)
    return done.token_ids


def run(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        engine.step()
        out.update((r.id, r.output_ids) for r in engine.collect_finished())
    return out


def test_a_prompt_prefilled_in_chunks_decodes_the_same_tokens(
    loaded_model: LoadedModel, tmp_path: Path, reference: Engine
) -> None:
    ids = words(loaded_model, 300, seed=1)
    engine = make_engine(loaded_model, config(tmp_path, max_step_tokens=64), cache=None, keep_resident=False)
    rid = engine.add_request(engine.keyed(ids), GREEDY)
    steps = 0
    while not engine.step():
        steps += 1
    # 17 chunks of 64, then the last 79 tokens (within a quarter budget over 64) in the step that samples.
    assert (len(ids), steps) == (1167, 17)
    assert engine.prefill_tokens_computed == len(ids)
    assert run(engine)[rid] == alone(reference, ids)


def test_a_short_request_is_not_held_behind_a_long_prefill(
    loaded_model: LoadedModel, tmp_path: Path, reference: Engine
) -> None:
    long_ids, short_ids = words(loaded_model, 200, seed=2), words(loaded_model, 3, seed=3)
    engine = make_engine(loaded_model, config(tmp_path, max_step_tokens=64), cache=None, keep_resident=False)
    long_id = engine.add_request(engine.keyed(long_ids), GREEDY)
    engine.step()  # the long prompt's first chunk
    short_id = engine.add_request(engine.keyed(short_ids), GREEDY)
    first = engine.step()
    assert [o.request_id for o in first] == [short_id]  # its first token, the very next step
    assert engine._running[0].prefilling  # while the long prompt is still being prefilled
    done = run(engine)
    assert done[long_id] == alone(reference, long_ids)
    assert done[short_id] == alone(reference, short_ids)


def test_a_prefix_being_computed_is_computed_once(loaded_model: LoadedModel, tmp_path: Path, reference: Engine) -> None:
    prefix = words(loaded_model, 200, seed=4)
    cut = len(prefix) // B * B
    prompts = [prefix[:cut] + words(loaded_model, 12 + i, seed=10 + i) for i in range(4)]
    engine = pooled(loaded_model, tmp_path, max_step_tokens=96)
    ids = [engine.add_request(engine.keyed(p), GREEDY) for p in prompts]
    done = run(engine)
    assert [done[i] for i in ids] == [alone(reference, p) for p in prompts]
    assert engine.prefill_tokens_computed == sum(len(p) for p in prompts) - 3 * cut  # the prefix once, not 4x
    assert engine.prefill_tokens_skipped == 3 * cut


def test_abort_frees_the_pool_whether_waiting_prefilling_or_decoding(
    loaded_model: LoadedModel, tmp_path: Path, reference: Engine
) -> None:
    engine = pooled(loaded_model, tmp_path, max_step_tokens=64, max_batch=2)
    params = SamplingParams(max_tokens=200)
    decoding = engine.add_request(engine.keyed(words(loaded_model, 20, seed=5)), params)
    prefilling = engine.add_request(engine.keyed(words(loaded_model, 300, seed=6)), params)
    waiting = engine.add_request(engine.keyed(words(loaded_model, 30, seed=7)), params)
    engine.step()
    engine.step()
    states = {r.id: r.prefilling for r in engine._running}
    assert states == {decoding: False, prefilling: True}
    assert [r.id for r in engine._waiting] == [waiting]
    for rid in (waiting, prefilling, decoding):
        assert engine.abort(rid)
    assert not engine.abort(decoding)  # already gone
    assert not engine.has_unfinished()
    ended = engine.collect_finished()
    assert {r.id: r.finish_reason for r in ended} == dict.fromkeys((waiting, prefilling, decoding), FinishReason.ABORT)
    assert engine.publisher.producing == {}
    # Nothing is held but the resident index's one reference per kept block: every other page is free.
    assert engine.pool.num_free + len(engine.resident) == engine.pool.num_blocks
    assert engine.resident.evictable() == len(engine.resident)
    again = words(loaded_model, 300, seed=6)
    rid = engine.add_request(engine.keyed(again), GREEDY)
    assert run(engine)[rid] == alone(reference, again)


def test_without_a_resident_pool_nobody_waits_for_blocks_it_could_not_attach(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    prefix = words(loaded_model, 100, seed=8)
    cut = len(prefix) // B * B
    prompts = [prefix[:cut] + words(loaded_model, 5 + i, seed=20 + i) for i in range(2)]
    engine = make_engine(loaded_model, config(tmp_path, max_step_tokens=64), cache=None, keep_resident=False)
    for p in prompts:
        engine.add_request(engine.keyed(p), GREEDY)
    engine.step()
    assert len(engine._running) == 2 and not engine._waiting  # both admitted at once: no producer to wait for
    assert engine.publisher.producing == {}
