"""The routing policies on toy candidates: exact orders, as the policies' contract promises."""

from __future__ import annotations

from kvtier.keys import BlockKey
from kvtier.route.choice import Ask, CacheAware, Candidate, LeastLoaded, Reason, RoundRobin, prefill_cost
from kvtier.route.index import BlockIndex, RoutedPrefixes
from kvtier.tiers.base import TierKind

D, H, K = TierKind.DEVICE, TierKind.HOST, TierKind.DISK
B = 16


def keys(*names: str) -> list[BlockKey]:
    return [BlockKey(n.encode().ljust(16, b".")) for n in names]


def test_round_robin_rotates_and_least_loaded_breaks_ties_by_rotation() -> None:
    cands = [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)]
    rr = RoundRobin()
    assert [rr.rank(Ask(10), cands).order[0] for _ in range(4)] == ["a", "b", "c", "a"]
    ll = LeastLoaded()
    loaded = [Candidate("a", 2), Candidate("b", 0), Candidate("c", 1)]
    assert ll.rank(Ask(10), loaded).order == ["b", "c", "a"]
    assert [ll.rank(Ask(10), cands).order[0] for _ in range(3)] == ["b", "c", "a"]  # rotation went on


def test_cost_weights_tiers_fastest_cheapest() -> None:
    assert prefill_cost(100, [], B) == 100
    assert prefill_cost(100, [D, D], B) == 100 - 32
    assert prefill_cost(100, [D, D], B) < prefill_cost(100, [H, H], B) < prefill_cost(100, [K, K], B) < 100


def test_kvtier_prefers_the_backend_holding_the_prompt_unless_it_is_overloaded() -> None:
    policy = CacheAware(B, load_tokens=256, max_imbalance=2)
    holds = [Candidate("a", 0), Candidate("b", 0, (H,) * 6), Candidate("c", 0, (D,))]
    ranking = policy.rank(Ask(100), holds)
    assert (ranking.order, ranking.reason, ranking.predicted_cached_tokens) == (["b", "c", "a"], Reason.CHEAPEST, 96)
    busy = [Candidate("a", 0), Candidate("b", 2, (H,) * 6)]
    assert policy.rank(Ask(100), busy).order == ["a", "b"]  # a queued request costs more than 96 tokens
    hot = [Candidate("a", 0), Candidate("b", 3, (D,) * 60)]  # past the guard, however much it holds
    ranking = policy.rank(Ask(1000), hot)
    assert (ranking.order, ranking.reason) == (["a", "b"], Reason.SPILLED)


def test_a_session_sticks_to_its_backend_until_the_guard_moves_it() -> None:
    policy = CacheAware(B, load_tokens=256, max_imbalance=2)
    idle = [Candidate("a", 0), Candidate("b", 0)]
    first = policy.rank(Ask(10, "s"), idle).order[0]
    other = "b" if first == "a" else "a"
    again = policy.rank(Ask(10, "s"), [Candidate(first, 1), Candidate(other, 0, (D,))])
    assert (again.order[0], again.reason) == (first, Reason.SESSION)  # stays, though the other is cheaper
    moved = policy.rank(Ask(10, "s"), [Candidate(first, 3), Candidate(other, 0)])
    assert (moved.order[0], moved.reason) == (other, Reason.SPILLED)
    assert policy.rank(Ask(10, "s"), [Candidate(first, 0), Candidate(other, 0)]).order[0] == other  # it moved
    policy.forget(other)
    assert policy.rank(Ask(10, "s"), [Candidate(first, 0, (D,)), Candidate(other, 0)]).reason is Reason.CHEAPEST


def test_index_follows_stores_removals_and_clears_per_tier() -> None:
    index = BlockIndex()
    a, b, c = keys("a", "b", "c")
    index.stored("x", H, [a, b, c])
    index.stored("x", D, [a])
    index.stored("y", K, [a, b])
    assert index.match("x", [a, b, c]) == [D, H, H]
    assert index.match("y", [a, b, c]) == [K, K]
    index.removed("x", H, [b])
    assert index.match("x", [a, b, c]) == [D]  # the chain breaks at the first block it lacks
    index.cleared("x", D)
    assert index.match("x", [a]) == [H]
    assert index.counts("x") == {H: 2}
    index.replace("y", {H: [c]})
    assert (index.match("y", [a]), index.counts("y")) == ([], {H: 1})
    index.drop("x")
    assert index.blocks("x") == 0


def test_routed_prefixes_forget_least_recently_routed_first() -> None:
    guesses = RoutedPrefixes(capacity=3)
    a, b, c, d = keys("a", "b", "c", "d")
    guesses.routed("x", [a, b])
    guesses.routed("x", [c])
    guesses.routed("x", [a])  # a is recent again
    guesses.routed("x", [d])  # b goes
    assert guesses.match("x", [a, b]) == 1
    assert guesses.match("x", [c, a, d]) == 3
    assert guesses.match("y", [a]) == 0
