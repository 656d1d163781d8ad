"""The routing policies on toy candidates: exact orders, as the policies' contract promises."""

from __future__ import annotations

from collections import Counter

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


def test_kvtier_prefers_the_backend_holding_the_prompt_until_its_queue_costs_more() -> None:
    policy = CacheAware(B, load_tokens=256, max_imbalance=2)
    holds = [Candidate("a", 0), Candidate("b", 0, (H,) * 6), Candidate("c", 0, (D,))]
    ranking = policy.rank(Ask(100), holds)  # costs: a 100, b 4 + 96 x 0.05 = 8.8, c 84
    assert (ranking.order, ranking.reason, ranking.predicted_cached_tokens) == (["b", "c", "a"], Reason.CHEAPEST, 96)
    tails = [Candidate("a", 0), Candidate("b", 2, (H,) * 6, queued_tokens=90)]
    assert policy.rank(Ask(100), tails).order == ["b", "a"]  # two queued requests, but short ones: 98.8 < 100
    longer = [Candidate("a", 0), Candidate("b", 1, (H,) * 6, queued_tokens=92)]
    ranking = policy.rank(Ask(100), longer)  # one request, but a long prefill queued: 100.8 > 100
    assert (ranking.order, ranking.reason) == (["a", "b"], Reason.SPILLED)
    foreign = [Candidate("a", 0), Candidate("b", 1, (H,) * 6, foreign=1)]  # another client's: counted 256
    assert policy.rank(Ask(100), foreign).order == ["a", "b"]
    hot = [Candidate("a", 0), Candidate("b", 3, (D,) * 60)]  # past the backstop, however much it holds
    ranking = policy.rank(Ask(1000), hot)
    assert (ranking.order, ranking.reason) == (["a", "b"], Reason.SPILLED)
    prefix_alone = CacheAware(B, load_tokens=0, max_imbalance=10**6, queue_weight=0.0)
    assert prefix_alone.rank(Ask(100), [Candidate("a", 0), Candidate("b", 9, (H,) * 6, 10**6)]).order == ["b", "a"]


def burst(policy: CacheAware, prefix_blocks: int, tail: int, n: int, cold_queued: int = 0) -> list[str]:
    """``n`` requests on one hot prefix held by "hot", none answered meanwhile, each queued where it went
    as the router queues it (its predicted prefill, one more request)."""
    queued = {"hot": cold_queued, "x": 0, "y": 0}
    load = dict.fromkeys(queued, 0)
    tokens = prefix_blocks * B + tail
    out = []
    for _ in range(n):
        cands = [Candidate(b, load[b], (D,) * prefix_blocks if b == "hot" else (), queued[b]) for b in queued]
        first = next(c for c in cands if c.name == policy.rank(Ask(tokens, "hot-session"), cands).order[0])
        queued[first.name] += round(prefill_cost(tokens, first.cached, B))
        load[first.name] += 1
        out.append(first.name)
    return out


def test_a_hot_prefix_stays_where_it_is_cached_while_its_queue_is_tails() -> None:
    """The skewed stream: sub-agents of one session on one long prefix. A tail queued behind the prefix's
    backend is cheaper than the prefix recomputed elsewhere, so the default policy keeps the burst there
    (as the prefix alone would), which a guard counting requests did not."""
    policy = CacheAware(B, load_tokens=256, max_imbalance=8)
    assert burst(policy, prefix_blocks=80, tail=20, n=9) == ["hot"] * 9
    assert burst(policy, 80, 20, n=10)[-1] != "hot"  # the backstop: nine requests ahead of the least loaded
    by_requests = CacheAware(B, load_tokens=256, max_imbalance=2)  # the old guard's setting
    assert burst(by_requests, 80, 20, n=4).count("hot") == 3
    # A cold prompt as long as the prefix already queued there: waiting for it costs more than recomputing.
    assert burst(policy, 80, 20, n=1, cold_queued=1300) == ["x"]
    assert burst(policy, 80, 20, n=1, cold_queued=1200) == ["hot"]


def test_a_session_breaks_ties_and_follows_its_cost() -> None:
    policy = CacheAware(B, load_tokens=256, max_imbalance=2)
    idle = [Candidate("a", 0), Candidate("b", 0)]
    first = policy.rank(Ask(10, "s"), idle)
    assert (first.order[0], first.reason) == ("a", Reason.CHEAPEST)  # a tie, first in the rotation
    again = policy.rank(Ask(10, "s"), idle)  # the rotation now starts at b: the session decides the tie
    assert (again.order[0], again.reason) == ("a", Reason.SESSION)
    cheaper = policy.rank(Ask(10, "s"), [Candidate("a", 0), Candidate("b", 0, (D,))])
    assert (cheaper.order[0], cheaper.reason) == ("b", Reason.SPILLED)  # the cache beats the session
    queued = policy.rank(Ask(10, "s"), [Candidate("a", 0), Candidate("b", 1, queued_tokens=1)])
    assert (queued.order[0], queued.reason) == ("a", Reason.SPILLED)  # and so does a queue
    assert policy.rank(Ask(10, "s"), idle).order[0] == "a"  # it moved back
    policy.forget("a")
    assert policy.rank(Ask(10, "s"), [Candidate("a", 0, (D,)), Candidate("b", 0)]).reason is Reason.CHEAPEST


def test_new_sessions_spread_over_backends_by_the_sessions_they_host_not_the_queue_of_the_moment() -> None:
    policy = CacheAware(B, load_tokens=256, max_imbalance=8)
    placed = Counter()
    for s in range(6):
        queues = [Candidate("a", 0), Candidate("b", 1, queued_tokens=40 * s), Candidate("c", 1, queued_tokens=5)]
        placed[policy.rank(Ask(100, f"s{s}"), queues).order[0]] += 1  # "a" is always the least queued
    assert placed == {"a": 2, "b": 2, "c": 2}
    held = policy.rank(Ask(100, "s0"), [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0, (D,) * 6)])
    assert held.order[0] == "c"  # a prompt cached somewhere goes by cost, as before
    policy.forget("c")
    assert policy.rank(Ask(100, "new"), [Candidate("a", 0), Candidate("b", 0), Candidate("c", 0)]).order[0] == "c"


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


def test_the_block_index_gives_back_the_keys_it_was_given_whatever_their_length() -> None:
    """Keys are held as integers (less memory per block); a key of another length from a stream is kept as is."""
    index = BlockIndex()
    keys = [BlockKey(bytes([0] * 15 + [7])), BlockKey(bytes(range(16))), BlockKey(b"\x00short"), BlockKey(b"")]
    index.stored("a", TierKind.DISK, keys)
    index.stored("a", TierKind.HOST, keys[:1])
    assert index.match("a", keys) == [TierKind.HOST, TierKind.DISK, TierKind.DISK, TierKind.DISK]
    assert index.match("a", [BlockKey(b"\x07"), *keys]) == []  # not the 16-byte key whose integer is 7
    assert index.removed("a", TierKind.DISK, keys[:2]) == [keys[1]]  # keys[0] is still in host
    assert index.cleared("a", TierKind.DISK) == keys[2:]
    assert index.cleared("a", TierKind.HOST) == keys[:1] and index.blocks("a") == 0
