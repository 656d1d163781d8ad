"""kvtier bench route's request streams and summaries, without starting anything."""

from __future__ import annotations

from collections import Counter

from kvtier.bench.route import Outcome, RouteSpec, interleaved, skewed, summary


def test_every_session_turn_once_in_order_and_rounds_shuffled() -> None:
    spec = RouteSpec(sessions=6, turns=3, hot_requests=4)
    stream = interleaved(spec)
    assert Counter(r.session for r in stream) == {f"session-{s}": 3 for s in range(6)}
    for s in range(6):
        turns = [r.turn for r in stream if r.session == f"session-{s}"]
        assert turns == [0, 1, 2]
    rounds = [[r.session for r in stream[k * 6 : (k + 1) * 6]] for k in range(3)]
    assert len({tuple(r) for r in rounds}) > 1  # not one fixed order
    later = next(r for r in stream if r.session == "session-0" and r.turn == 1)
    first = next(r for r in stream if r.session == "session-0" and r.turn == 0)
    assert later.messages[: len(first.messages)] == first.messages  # a turn resends the transcript
    warm, *hot = [r for r in skewed(spec) if r.session == "hot"]
    assert warm.turn == 0 and [r.turn for r in hot] == [1] * 4  # the burst waits for the prefix to be there
    assert len({r.messages[-1]["content"] for r in hot}) == 4
    assert {str(r.messages[:-1]) for r in hot} == {str(warm.messages[:-1])}  # one shared prefix


def test_summary_counts_failures_cuts_hits_and_backends() -> None:
    outcomes = [
        Outcome(1.0, prompt_tokens=100, cached_tokens=50, backend="a"),
        Outcome(3.0, prompt_tokens=100, cached_tokens=0, backend="b"),
        Outcome(None),
        Outcome(None, cut=True),
    ]
    got = summary(outcomes, ["a", "b", "c"])
    assert (got["mean_ttft_s"], got["p95_ttft_s"], got["hit_rate"]) == (2.0, 3.0, 0.25)
    assert (got["failed"], got["cut"], got["requests"], got["requests_per_backend"]) == (1, 1, 4, [1, 1, 0])
    assert got["prefill_tokens"] == 150  # prompt less cached, of the answered ones
