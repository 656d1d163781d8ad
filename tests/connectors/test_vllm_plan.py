"""The vLLM connector's plan of loads and saves, step by step, without vLLM: exact blocks and token rows.

Toy sizes: kvtier and vLLM blocks of 16 tokens (and kvtier's finer than
vLLM's where said), a prompt of ten blocks of which the service holds eight.
vLLM's side is played by hand: ``computed`` is its ``num_computed_tokens``
(counting tokens being loaded), and after a load that fails it truncates
that count to the first vLLM block that failed, as its scheduler does under
``kv_load_failure_policy: recompute``. The worker's side of a failed load is
:class:`FailedLoads`: which saves it still runs.
"""

from __future__ import annotations

from kvtier.connectors.paged import BlockMap, Segment
from kvtier.connectors.vllm_plan import FailedLoads, RequestPlan, Transfer

B = 16
PROMPT = 10 * B


def plan(**kw: int) -> RequestPlan:
    return RequestPlan(tokens=list(range(PROMPT)), namespace="default", block_table=list(range(100, 110)), **kw)


def covered(t: Transfer) -> tuple[int, int, int]:
    """(first kvtier block, blocks, token rows) of a transfer."""
    return t.first_block, t.num_blocks, sum(s.tokens for s in t.segments)


def test_a_load_then_the_rest_of_the_prompt_saves_only_what_was_computed() -> None:
    r = plan(load_tokens=8 * B)
    load, save = r.step("a", BlockMap(B, B), computed=8 * B, scheduled=2 * B)
    assert load is not None and save is not None
    assert covered(load) == (0, 8, 8 * B) and covered(save) == (8, 2, 2 * B)
    assert save.segments[0] == Segment(kv_block=8, kv_offset=0, engine_block=8, engine_offset=0, tokens=B)
    assert r.step("a", BlockMap(B, B), computed=PROMPT, scheduled=1) == (None, None)  # decoding: nothing new


def test_blocks_that_failed_to_load_are_saved_once_vllm_recomputes_them() -> None:
    r = plan(load_tokens=8 * B)
    r.step("a", BlockMap(B, B), computed=8 * B, scheduled=2 * B)
    # block 3 did not load: vLLM recomputes from it, blocks 3..9 again
    load, save = r.step("a", BlockMap(B, B), computed=3 * B, scheduled=7 * B)
    assert load is None and save is not None
    assert covered(save) == (3, 7, 7 * B)
    assert save.tokens == list(range(PROMPT)) and save.segments[0].engine_block == 3


def test_a_recompute_in_chunks_saves_each_chunk_once() -> None:
    r = plan(load_tokens=8 * B)
    r.step("a", BlockMap(B, B), computed=8 * B, scheduled=2 * B)
    _, first = r.step("a", BlockMap(B, B), computed=3 * B, scheduled=4 * B)
    _, second = r.step("a", BlockMap(B, B), computed=7 * B, scheduled=3 * B)
    assert first is not None and second is not None
    assert (covered(first), covered(second)) == ((3, 4, 4 * B), (7, 3, 3 * B))


def test_kvtier_blocks_finer_than_vllms_are_saved_again_from_the_failed_vllm_block() -> None:
    m = BlockMap(B // 2, B)  # two kvtier blocks per vLLM block
    r = plan(load_tokens=8 * B)
    r.step("a", m, computed=8 * B, scheduled=2 * B)
    _, save = r.step("a", m, computed=3 * B, scheduled=7 * B)  # kvtier block 7 failed: its vLLM block 3 is redone
    assert save is not None and covered(save) == (6, 14, 7 * B)


def test_saves_of_kv_computed_over_a_failed_load_are_dropped_until_the_recompute_is_planned() -> None:
    m = BlockMap(B, B)
    r, other = plan(load_tokens=8 * B), plan()
    _, tainted = r.step("a", m, computed=8 * B, scheduled=2 * B)  # blocks 8, 9 attend to block 3's unfilled rows
    _, fine = other.step("b", m, computed=0, scheduled=2 * B)
    assert tainted is not None and fine is not None
    failed = FailedLoads()
    failed.failed("a", 3)
    assert failed.admitted([tainted, fine]) == [fine]
    ahead = Transfer("a", "default", list(range(PROMPT)), 9, 1, [], [])  # planned before vLLM truncated "a"
    assert failed.admitted([ahead]) == []
    _, redo = r.step("a", m, computed=3 * B, scheduled=7 * B)
    assert redo is not None and failed.admitted([redo]) == [redo]
    assert failed.admitted([ahead]) == [ahead]  # the watch ended with the recompute's save


def test_the_failing_steps_saves_are_dropped_even_when_they_start_at_the_failed_block() -> None:
    m = BlockMap(2 * B, B)  # kvtier blocks coarser than vLLM's: a load may end inside one
    r = plan(load_tokens=3 * B)
    load, save = r.step("a", m, computed=3 * B, scheduled=B)
    assert load is not None and covered(load) == (0, 2, 3 * B)
    assert save is not None and covered(save) == (1, 1, 2 * B)
    failed = FailedLoads()
    failed.failed("a", 1)
    assert failed.admitted([save]) == []


def test_a_finished_request_is_forgotten() -> None:
    failed = FailedLoads()
    failed.failed("a", 3)
    failed.admitted([])
    failed.forget({"a"})
    later = Transfer("a", "default", list(range(PROMPT)), 9, 1, [], [])
    assert failed.admitted([later]) == [later]
