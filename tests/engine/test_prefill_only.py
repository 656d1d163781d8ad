"""A prefill alone (``max_tokens`` 0) and a forward abandoned between layers, on the real model.

Both exist for warming a session's next turn in idle time: the warm is a
prefill whose only product is KV, and it must give way to a request within a
layer. Neither may change a token: the follow-up request's greedy output is
compared with an engine that caches nothing.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.engine.engine import Engine, FinishReason
from kvtier.engine.runtime import LoadedModel
from kvtier.engine.sampling import SamplingParams
from tests.engine.test_chunked import GREEDY, B, alone, pooled, reference, run, words

__all__ = ["reference"]  # the module fixture, shared

PREFILL = SamplingParams(max_tokens=0)


def test_a_prefill_alone_ends_with_its_prompt_computed_and_samples_nothing(
    loaded_model: LoadedModel, tmp_path: Path, reference: Engine
) -> None:
    engine = pooled(loaded_model, tmp_path, max_step_tokens=64)
    ids = words(loaded_model, 100, seed=3)
    rid = engine.add_request(engine.keyed(ids), PREFILL)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    (done,) = engine.collect_finished()
    assert (done.id, done.finish_reason, done.output_ids, done.text) == (rid, FinishReason.LENGTH, [], "")
    assert done.first_token_at is None  # no first token: a prefill alone is nobody's TTFT
    assert engine.prefill_tokens_computed == len(ids)

    # Its full blocks stay resident: a turn that extends it computes only what is new, to the same tokens.
    more = ids + words(loaded_model, 20, seed=4)
    follow = engine.add_request(engine.keyed(more), GREEDY)
    out = run(engine)
    assert engine.prefill_tokens_computed == len(ids) + len(more) - len(ids) // B * B
    assert out[follow] == alone(reference, more)


def test_an_interrupted_forward_advances_nothing_and_the_step_is_taken_again(
    loaded_model: LoadedModel, tmp_path: Path, reference: Engine
) -> None:
    engine = pooled(loaded_model, tmp_path, max_step_tokens=64)
    ids = words(loaded_model, 120, seed=5)
    rid = engine.add_request(engine.keyed(ids), GREEDY)
    asked: list[int] = []

    def at_layer_three() -> bool:
        asked.append(1)
        return len(asked) == 3  # after two layers of the first chunk were computed

    assert engine.step(interrupt=at_layer_three) == []
    assert len(asked) == 3 and engine.prefill_tokens_computed == 0
    (req,) = engine._running  # admitted and kept: nothing to admit again, nothing computed
    assert req.table.num_tokens == 0
    never = engine.step(interrupt=lambda: False)  # asked at every layer, never stops
    assert never == [] and engine.prefill_tokens_computed == 64  # a chunk, no token yet
    assert run(engine)[rid] == alone(reference, ids)
