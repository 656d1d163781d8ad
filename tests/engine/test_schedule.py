"""The step budget's split between prompt chunks: exact grants for toy cases."""

from __future__ import annotations

from kvtier.engine.schedule import prefill_budget, prefill_chunks

B = 16


def test_a_lone_prompt_takes_the_whole_budget_in_whole_blocks() -> None:
    assert prefill_chunks([1000], [0], 512, B) == [512]
    assert prefill_chunks([1000], [8], 512, B) == [504]  # ends on a block boundary: 8 + 504 = 512
    assert prefill_chunks([100], [0], 512, B) == [100]  # the last chunk of a prompt ends where the prompt does


def test_a_short_prompt_goes_before_a_long_one_already_running() -> None:
    # The long one (admitted first) keeps its guaranteed quarter; the 2-token one is served at once.
    assert prefill_chunks([7000, 2], [1024, 0], 512, B) == [496, 2]


def test_equal_prompts_are_served_in_admission_order() -> None:
    assert prefill_chunks([600, 600, 600], [0, 0, 0], 512, B) == [512, 0, 0]
    assert prefill_chunks([88, 600, 600], [512, 0, 0], 512, B) == [88, 416, 0]


def test_the_oldest_prompt_always_progresses() -> None:
    many_short = [5000] + [30] * 20
    grants = prefill_chunks(many_short, [0] * 21, 512, B)
    # A quarter of the budget to the oldest, before any short one; then shortest first, in whole blocks.
    assert grants == [128] + [30] * 12 + [16] + [0] * 7


def test_decodes_come_first_but_never_leave_prefills_nothing() -> None:
    assert prefill_budget(512, 16, B) == 496
    assert prefill_budget(16, 40, B) == B
    assert prefill_chunks([], [], 512, B) == []
