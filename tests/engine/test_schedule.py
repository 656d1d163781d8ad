"""The step budget's split between prompt chunks: exact grants for toy cases."""

from __future__ import annotations

from kvtier.engine.schedule import oldest_share, prefill_budget, prefill_chunks

B = 16


def test_a_lone_prompt_takes_the_whole_budget_in_whole_blocks() -> None:
    assert prefill_chunks([1000], [0], 512, B) == [512]
    assert prefill_chunks([1000], [8], 512, B) == [504]  # ends on a block boundary: 8 + 504 = 512
    assert prefill_chunks([100], [0], 512, B) == [100]  # the last chunk of a prompt ends where the prompt does
    assert prefill_chunks([640], [0], 512, B) == [640]  # alone, a tail of up to a quarter budget comes along
    assert prefill_chunks([641], [0], 512, B) == [512]


def test_a_short_prompt_goes_first_and_its_step_stays_short() -> None:
    # The 2-token request finishes now; the long one (admitted first) gets no more than those 2 tokens.
    assert prefill_chunks([7000, 2], [1024, 0], 512, B) == [2, 2]
    # A starved oldest prompt gets its quarter first.
    assert prefill_chunks([7000, 2], [1026, 0], 512, B, oldest_starved=True) == [126, 2]


def test_equal_prompts_are_served_in_admission_order() -> None:
    assert prefill_chunks([600, 600, 600], [0, 0, 0], 512, B) == [512, 0, 0]
    # The first finishes (88 tokens), so the second gets 88 too, cut back to a block boundary.
    assert prefill_chunks([88, 600, 600], [512, 0, 0], 512, B) == [88, 80, 0]
    assert prefill_chunks([300, 600], [0, 0], 512, B) == [300, 208]  # 300 finishing: the rest, up to 300


def test_the_oldest_prompt_always_progresses() -> None:
    many_short = [5000] + [30] * 20
    assert prefill_chunks(many_short, [0] * 21, 512, B) == [0] + [30] * 17 + [2, 0, 0]  # first tokens owed: 510
    # Starved in that step, it gets a quarter of the budget in the next, before the short ones.
    assert prefill_chunks(many_short, [0] * 21, 512, B, oldest_starved=True) == [128] + [30] * 12 + [16] + [0] * 7
    assert oldest_share(512) == 128


def test_decodes_come_first_but_never_leave_prefills_nothing() -> None:
    assert prefill_budget(512, 16, B) == 496
    assert prefill_budget(16, 40, B) == B
    assert prefill_chunks([], [], 512, B) == []
