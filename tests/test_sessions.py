"""Sessions as an eviction input, and the "why miss" answer, on a toy manager (exact outcomes, a stepped clock)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtier.cache import Promotion
from kvtier.config import SessionConfig, WriteMode
from kvtier.explain import ExplainReason, divergence
from kvtier.manager import CacheManager
from kvtier.policy import PolicyName
from kvtier.sessions import SessionRegistry
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, Clock, make_hasher, prompt, toy_layout
from tests.test_manager import kv, manager

H, D = TierKind.HOST, TierKind.DISK


def with_sessions(m: CacheManager, clock: Clock, **cfg) -> SessionRegistry:
    registry = SessionRegistry(SessionConfig(**{"ttl_s": 60.0, **cfg}), BLOCK, clock)
    m.protect(registry.protection)
    return registry


def speak(m: CacheManager, registry: SessionRegistry, sid: str, tokens: np.ndarray, seed: int) -> None:
    """A session's turn as the server runs it: recorded, then its blocks stored."""
    registry.turn(m.config.cache.namespace, sid, tokens, m.keys(tokens))
    m.store(m.keyed(tokens), kv(len(tokens) // BLOCK, seed))


def test_live_session_blocks_outlive_anonymous_ones_until_expiry(tmp_path: Path) -> None:
    clock = Clock()
    with manager(tmp_path, host_blocks=8, clock=clock) as m:
        registry = with_sessions(m, clock)
        agent = prompt(3 * BLOCK, seed=1)
        speak(m, registry, "agent", agent, seed=1)
        for s in range(2, 6):  # anonymous traffic, four times the free room
            m.store(m.keyed(prompt(2 * BLOCK, seed=s)), kv(2, s))
        assert m.lookup(m.keyed(agent)).tiers == (H, H, H)  # LRU alone would have evicted it first
        clock.now += 61  # the session expires: its blocks are ordinary again
        m.store(m.keyed(prompt(8 * BLOCK, seed=9)), kv(8, 9))  # a whole tier of new blocks
        assert m.lookup(m.keyed(agent)).tiers == (D, D, D)
        assert len(registry) == 0 and registry.expired == 1


def test_protection_is_bounded_and_goes_to_the_oldest_sessions(tmp_path: Path) -> None:
    clock = Clock()
    with manager(tmp_path, host_blocks=8, clock=clock) as m:
        registry = with_sessions(m, clock, max_protected_share=0.5)  # 4 of 8 blocks
        old, new, third = (prompt(2 * BLOCK, seed=s) for s in (1, 2, 3))
        for sid, tokens, seed in (("old", old, 1), ("new", new, 2), ("third", third, 3)):
            clock.now += 1
            speak(m, registry, sid, tokens, seed)
        assert set(registry.protection(8).rank) == set(m.keys(old) + m.keys(new))  # over the share: third gets none
        speak(m, registry, "third", third, seed=3)  # speaking again does not buy a place
        assert set(registry.protection(8).rank) == set(m.keys(old) + m.keys(new))
        m.lookup(m.keyed(third))  # the most recently used: LRU alone would evict old first
        m.store(m.keyed(prompt(4 * BLOCK, seed=4)), kv(4, 4))
        assert m.lookup(m.keyed(third)).tiers == (D, D)
        assert m.lookup(m.keyed(old)).tiers == (H, H) and m.lookup(m.keyed(new)).tiers == (H, H)


def test_a_round_of_more_agents_than_fit_keeps_the_oldest_hitting_where_lru_misses_all(tmp_path: Path) -> None:
    """Six agents in turn over a tier that holds four transcripts: LRU evicts each just before it speaks."""
    agents = [prompt(2 * BLOCK, seed=a) for a in range(6)]

    def rounds(m: CacheManager, registry: SessionRegistry | None, clock: Clock) -> list[list[int]]:
        hits = []
        for _ in range(3):
            seen = []
            for a, tokens in enumerate(agents):
                clock.now += 1
                seen.append(m.lookup(m.keyed(tokens)).tiers.count(H))
                if registry is not None:
                    registry.turn(m.config.cache.namespace, f"agent-{a}", tokens, m.keys(tokens))
                m.store(m.keyed(tokens), kv(2, a))
            hits.append(seen)
        return hits

    clock = Clock()
    with manager(tmp_path / "lru", host_blocks=8, clock=clock, disk={"enabled": False}) as m:
        assert rounds(m, None, clock)[1:] == [[0] * 6] * 2
    with manager(tmp_path / "sessions", host_blocks=8, clock=clock, disk={"enabled": False}) as m:
        registry = with_sessions(m, clock, max_protected_share=0.75)  # 6 of 8 blocks: three agents
        assert rounds(m, registry, clock)[1:] == [[2, 2, 2, 0, 0, 0]] * 2


def test_protected_blocks_still_go_when_nothing_else_can_youngest_session_first(tmp_path: Path) -> None:
    clock = Clock()
    with manager(tmp_path, host_blocks=4, clock=clock) as m:
        registry = with_sessions(m, clock, max_protected_share=1.0)
        old, new = prompt(2 * BLOCK, seed=1), prompt(2 * BLOCK, seed=2)
        speak(m, registry, "old", old, seed=1)
        clock.now += 1
        speak(m, registry, "new", new, seed=2)
        m.lookup(m.keyed(new))  # most recently used, but its session is the younger one
        assert m.store(m.keyed(prompt(2 * BLOCK, seed=3)), kv(2, 3)) == 2
        assert m.lookup(m.keyed(new)).tiers == (D, D) and m.lookup(m.keyed(old)).tiers == (H, H)


def test_registry_forgets_the_idlest_past_max_sessions_and_keeps_tenants_apart() -> None:
    clock = Clock()
    registry = SessionRegistry(SessionConfig(max_sessions=2), BLOCK, clock)
    for i, ns in enumerate(["t/a", "t/b", "t/a"]):
        clock.now += 1
        registry.turn(ns, f"s{i}" if i < 2 else "s0", prompt(BLOCK, seed=i), [])
    assert registry.get("t/b", "s0") is None  # same id, other tenant: another session
    assert registry.get("t/a", "s0") is not None and registry.get("t/b", "s1") is not None
    clock.now += 1
    registry.turn("t/c", "s9", prompt(BLOCK), [])
    assert registry.get("t/b", "s1") is None  # the idlest was forgotten


def test_prefetch_promotes_a_session_from_disk_to_host(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=4) as m:
        agent = prompt(3 * BLOCK, seed=1)
        m.store(m.keyed(agent), kv(3, 1))
        m.store(m.keyed(prompt(4 * BLOCK, seed=2)), kv(4, 2))
        assert m.lookup(m.keyed(agent)).tiers == (D, D, D)
        assert m.prefetch(m.keyed(agent, m.config.cache.namespace)) == Promotion({D: 3 * BLOCK}, 3)
        assert m.lookup(m.keyed(agent)).tiers == (H, H, H)
        assert m.prefetch(m.keyed(agent, m.config.cache.namespace)) == Promotion(
            {}, 3
        )  # already there: nothing to move
        assert all(m.pinned(k) == 0 for k in m.keys(agent))


def test_explain_names_each_reason(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=4, disk={"enabled": False}) as m:
        ns = m.config.cache.namespace
        tokens = prompt(3 * BLOCK + 2, seed=1)
        never = m.explain(m.keyed(tokens, ns))
        assert (never.reason, never.first_miss_token) == (ExplainReason.NEVER_STORED, 0)
        m.store(m.keyed(tokens), kv(3, 1))
        tail = m.explain(m.keyed(tokens, ns))
        assert (tail.reason, tail.first_miss_token, tail.result.tiers) == (ExplainReason.PARTIAL_TAIL, 12, (H,) * 3)
        assert m.explain(m.keyed(tokens[: 3 * BLOCK], ns)).reason is ExplainReason.ALL_CACHED
        m.store(m.keyed(prompt(2 * BLOCK, seed=2)), kv(2, 2))  # evicts blocks 0 and 1 (no disk: dropped)
        gone = m.explain(m.keyed(tokens, ns))
        assert gone.reason is ExplainReason.EVICTED and gone.first_miss_token == 0
        assert gone.eviction is not None and (gone.eviction.tier, gone.eviction.policy) == (H, PolicyName.LRU)
        other = prompt(2 * BLOCK, seed=3)
        m.store(m.keyed(other, "mine/b"), kv(2, 3))
        moved = m.explain(m.keyed(other, ns), own_namespaces=["mine/b"])
        assert (moved.reason, moved.other_namespace) == (ExplainReason.OTHER_NAMESPACE, "mine/b")
        assert (
            m.explain(m.keyed(other, ns)).reason is ExplainReason.NEVER_STORED
        )  # a namespace not the caller's: unseen


def test_explain_reports_a_rejected_collision(tmp_path: Path) -> None:
    colliding = make_hasher(tmp_path, toy_layout(), hash128=lambda data, seed: b"\x00" * 16)
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH, hasher=colliding) as m:
        m.store(m.keyed(prompt(BLOCK, seed=1)), kv(1, 1))
        assert (
            m.explain(m.keyed(prompt(BLOCK, seed=2), m.config.cache.namespace)).reason is ExplainReason.HASH_COLLISION
        )


def test_explain_finds_where_a_session_diverged(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=16) as m:
        ns = m.config.cache.namespace
        turn1 = prompt(6 * BLOCK, seed=1)
        m.store(m.keyed(turn1), kv(6, 1))
        turn2 = np.concatenate([turn1, prompt(BLOCK, seed=2)])
        turn2[9] += 1  # one token changed inside block 2, as a timestamp would
        at = divergence(turn1, turn2)
        assert at == 9 and divergence(turn1, turn1[:10]) is None
        why = m.explain(m.keyed(turn2, ns), diverged_at=at)
        assert (why.reason, why.divergence, why.first_miss_token) == (ExplainReason.SESSION_DIVERGED, 9, 8)
