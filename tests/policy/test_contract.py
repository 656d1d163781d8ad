"""One contract for every registered eviction policy.

Each policy must (1) produce the exact victim orders written in ``EXPECTED``
on shared toy scenarios, so a new policy fails here until its author works
its orders out; (2) answer ``victims`` without changing state, checked
against a twin policy that saw the same events but fewer questions; (3)
drain completely through ``victims(1)`` + ``on_remove``, in the order one
``victims(n)`` call predicted.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import BlockKey
from kvtier.policy import EvictionPolicy, PolicyName, make_policy, registered
from kvtier.policy.base import Protection

N_KEYS = 12
K = [BlockKey(bytes([i]) * 16) for i in range(N_KEYS)]

Forest = tuple[int | None, ...]
"""The parent index of each key index (None for a block 0)."""

TOY_FOREST: Forest = (None, 0, 1, 0, 3, 4, None, 6, 7, 8, None, None)
"""k0 <- k1 <- k2, k0 <- k3 <- k4 <- k5, and the chain k6 <- k7 <- k8 <- k9."""

Event = tuple[str, int]
"""``("insert" | "access", key index)`` or ``("evict", 0)``: victims(1) then on_remove."""

TREE = [("insert", i) for i in range(5)]
HITS = [*TREE, ("access", 0), ("access", 0), ("access", 3), ("access", 1)]
READMIT = [
    *TREE,
    ("access", 0),
    ("access", 0),
    ("evict", 0),
    ("evict", 0),
    ("insert", 1),
    ("insert", 5),
    ("access", 3),
    ("access", 3),
    ("access", 1),
    ("access", 0),
    ("access", 0),
]

SCENARIOS: dict[str, tuple[list[Event], int | None, tuple[int, ...]]] = {
    "chain": ([("insert", i) for i in (6, 7, 8, 9)], 4, ()),
    "hits": (HITS, 5, ()),
    "exclude": (HITS, 4, (4,)),
    "readmit": (READMIT, None, ()),
}
"""name -> (events, n, exclude). The outcome is the keys the ``evict`` events
removed, then ``victims(n, exclude)``; ``n=None`` drains the policy instead."""

EXPECTED: dict[PolicyName, dict[str, list[int]]] = {
    PolicyName.LRU: {
        "chain": [6, 7, 8, 9],
        "hits": [2, 4, 0, 3, 1],
        "exclude": [2, 0, 3, 1],
        "readmit": [1, 2, 4, 5, 3, 1, 0],
    },
    PolicyName.LFU: {
        "chain": [6, 7, 8, 9],
        "hits": [2, 4, 3, 1, 0],
        "exclude": [2, 3, 1, 0],
        "readmit": [1, 2, 4, 5, 1, 3, 0],
    },
    # k0 (hit twice in small) is promoted to main on the first eviction; one hit is not enough.
    # readmit: k1 returns from the ghost queue straight into main, k3 is promoted, and main runs as a
    # CLOCK: k0's two hits buy it two passes (a counter reset would evict it before k1).
    PolicyName.S3FIFO: {
        "chain": [6, 7, 8, 9],
        "hits": [1, 2, 3, 0, 4],
        "exclude": [1, 2, 3, 0],
        "readmit": [1, 2, 4, 3, 1, 0, 5],
    },
    # Leaves first: excluding k4 keeps k3 (and so k0) until nothing else can go.
    PolicyName.PREFIX_LRU: {
        "chain": [9, 8, 7, 6],
        "hits": [2, 4, 3, 1, 0],
        "exclude": [2, 1, 3, 0],
        "readmit": [2, 1, 5, 4, 3, 1, 0],
    },
}


def parent_key(i: int, forest: Forest = TOY_FOREST) -> BlockKey | None:
    p = forest[i]
    return None if p is None else K[p]


def evict_one(policy: EvictionPolicy) -> BlockKey | None:
    victims = policy.victims(1)
    if not victims:
        return None
    policy.on_remove(victims[0])
    return victims[0]


def drain(policy: EvictionPolicy) -> list[BlockKey]:
    """Evict until empty; bounded so that a broken policy fails instead of looping."""
    out = []
    for _ in range(len(policy) + 1):
        key = evict_one(policy)
        if key is None:
            break
        out.append(key)
    return out


def test_every_policy_has_expected_orders() -> None:
    for name in registered():
        assert name in EXPECTED, f"add {name!r} to EXPECTED with its exact victim orders"
        assert set(EXPECTED[name]) == set(SCENARIOS), f"{name!r}: EXPECTED must cover every scenario"


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name", registered())
def test_exact_victim_order(name: PolicyName, scenario: str) -> None:
    events, n, exclude = SCENARIOS[scenario]
    policy = make_policy(name)
    outcome = []
    for op, i in events:
        if op == "insert":
            policy.on_insert(K[i], parent_key(i))
        elif op == "access":
            policy.on_access(K[i])
        else:
            outcome.append(evict_one(policy))
    if n is None:
        outcome += drain(policy)
    else:
        outcome += policy.victims(n, frozenset(K[i] for i in exclude))
    assert outcome == [K[i] for i in EXPECTED[name][scenario]]


FORESTS = st.tuples(*[st.one_of(st.none(), st.integers(0, i - 1)) if i else st.none() for i in range(N_KEYS)])
"""A parent for each key index, always an earlier index: a forest, as chained hashes give."""

INDEX = st.integers(0, N_KEYS - 1)
OPS = ["insert", "insert", "insert", "access", "access", "remove", "evict", "victims", "victims"]
RANDOM_EVENTS = st.lists(st.tuples(st.sampled_from(OPS), INDEX, st.frozensets(INDEX, max_size=4)), max_size=60)
"""``(op, i, exclude)``: for ``victims`` the index is ``n``, otherwise it names a key."""


def assert_tracks(policy: EvictionPolicy, resident: set[int]) -> None:
    assert len(policy) == len(resident)
    assert [K[i] in policy for i in range(N_KEYS)] == [i in resident for i in range(N_KEYS)]


@pytest.mark.parametrize("name", registered())
@settings(max_examples=150, deadline=None)
@given(forest=FORESTS, events=RANDOM_EVENTS)
def test_victims_is_pure_and_well_formed(
    name: PolicyName, forest: Forest, events: list[tuple[str, int, frozenset[int]]]
) -> None:
    policy, twin = make_policy(name), make_policy(name)  # the twin never gets the extra questions
    resident: set[int] = set()
    for op, i, exclude_idx in events:
        if op == "insert":
            for p in (policy, twin):
                p.on_insert(K[i], parent_key(i, forest))
            resident.add(i)
        elif op == "access":
            for p in (policy, twin):
                p.on_access(K[i])
        elif op == "remove":
            for p in (policy, twin):
                p.on_remove(K[i])
            resident.discard(i)
        elif op == "evict":
            key = evict_one(policy)
            assert key == evict_one(twin)
            assert (key is None) == (not resident)
            if key is not None:
                resident.remove(K.index(key))
        else:
            exclude = frozenset(K[j] for j in exclude_idx)
            got = policy.victims(i, exclude)
            assert got == policy.victims(i, exclude)
            assert len(set(got)) == len(got)
            assert all(k in policy and k not in exclude for k in got)
            assert len(got) == min(i, len(resident - exclude_idx))
            assert policy.victims(N_KEYS) == twin.victims(N_KEYS)
        assert_tracks(policy, resident)
    assert drain(policy) == drain(twin)


@pytest.mark.parametrize("name", registered())
@settings(max_examples=100, deadline=None)
@given(forest=FORESTS, events=RANDOM_EVENTS)
def test_eviction_drains_every_key_once(
    name: PolicyName, forest: Forest, events: list[tuple[str, int, frozenset[int]]]
) -> None:
    policy = make_policy(name)
    resident: set[int] = set()
    for op, i, _ in events:
        if op == "insert":
            policy.on_insert(K[i], parent_key(i, forest))
            resident.add(i)
        elif op == "access":
            policy.on_access(K[i])
        elif op == "remove":
            policy.on_remove(K[i])
            resident.discard(i)
    predicted = policy.victims(N_KEYS)
    drained = drain(policy)
    assert drained == predicted  # victims(n) foretells n rounds of victims(1) + on_remove
    assert sorted(drained) == sorted(K[i] for i in resident)
    assert len(policy) == 0
    assert policy.victims(N_KEYS) == []


PROTECT = st.dictionaries(INDEX, st.integers(0, 2), max_size=6)
"""Key index -> protection class (a session's age rank: lower leaves first)."""


@pytest.mark.parametrize("name", registered())
@settings(max_examples=100, deadline=None)
@given(forest=FORESTS, events=RANDOM_EVENTS, protect=PROTECT, n=st.integers(0, N_KEYS), excl=st.frozensets(INDEX))
def test_protected_keys_leave_last_lowest_class_first(
    name: PolicyName,
    forest: Forest,
    events: list[tuple[str, int, frozenset[int]]],
    protect: dict[int, int],
    n: int,
    excl: frozenset[int],
) -> None:
    """Every policy honours protection through base.py: unprotected first (its own order), then by class."""
    policy = make_policy(name)
    for op, i, _ in events:
        if op == "insert":
            policy.on_insert(K[i], parent_key(i, forest))
        elif op == "access":
            policy.on_access(K[i])
        elif op == "remove":
            policy.on_remove(K[i])
    protection = Protection({K[i]: float(c) for i, c in protect.items()})
    exclude = frozenset(K[i] for i in excl)
    got = policy.ranked_victims(n, exclude, protection)
    assert got == policy.ranked_victims(n, exclude, protection)  # pure
    unprotected = policy.victims(n, exclude | protection.rank.keys())
    assert got[: len(unprotected)] == unprotected
    rest = got[len(unprotected) :]
    assert all(k in protection and k not in exclude for k in rest)
    assert [protection.rank[k] for k in rest] == sorted(protection.rank[k] for k in rest)
    evictable = [k for k in policy.victims(N_KEYS, exclude)]
    assert len(got) == min(n, len(evictable))
    assert policy.ranked_victims(n, exclude) == policy.victims(n, exclude)  # no protection: unchanged


def test_unknown_policy_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="no-such-policy"):
        make_policy("no-such-policy")  # type: ignore[arg-type]
