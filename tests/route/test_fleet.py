"""The router's view of its backends: events feed the index, a lost stream falls back on routed guesses,
a dead backend is forgotten. No network: the event lines are fed as a stream would bring them."""

from __future__ import annotations

import pytest

from kvtier.events import ENCODER, Hello, Removed, Snapshot, Stored
from kvtier.keys import BlockKey
from kvtier.route.backends import Backend, Fleet
from kvtier.route.choice import CacheAware, Candidate
from kvtier.route.prompt import RoutedPrompt
from kvtier.route.subscribe import KeyMismatch, apply, lost
from kvtier.tiers.base import TierKind

H = TierKind.HOST
ROOT = "ab" * 16


class FakePrompts:
    def agrees(self, root: str, block_size: int) -> bool:
        return root == ROOT and block_size == 16


def keys(n: int, tag: str = "k") -> list[BlockKey]:
    return [BlockKey(f"{tag}{i}".encode().ljust(16, b".")) for i in range(n)]


def line(event: object) -> bytes:
    return ENCODER.encode(event)


def make_fleet() -> Fleet:
    backends = {u: Backend(u, up=True) for u in ("a", "b")}
    return Fleet(backends, CacheAware(16, load_tokens=256, max_imbalance=2), 16)


def test_events_then_loss_then_guesses_then_snapshot() -> None:
    fleet, prompts = make_fleet(), FakePrompts()
    a = fleet.backends["a"]
    ks = keys(4)
    prompt = RoutedPrompt(64, ks, None, False)
    apply(fleet, a, prompts, line(Hello(1, 16, ROOT, [H])))
    apply(fleet, a, prompts, line(Snapshot({H: [k.hex() for k in ks[:1]]})))
    apply(fleet, a, prompts, line(Stored(H, [k.hex() for k in ks[1:3]])))
    assert a.events_live and fleet.candidate(a, prompt).cached == (H, H, H)
    fleet.routed(a, prompt)  # the router sent the whole prompt there
    lost(fleet, a)
    assert fleet.candidate(a, prompt).cached == (None,) * 4  # a guess now, not the index
    assert fleet.rank(prompt).order[0] == "a"
    apply(fleet, a, prompts, line(Snapshot({H: [ks[0].hex()]})))
    assert fleet.candidate(a, prompt).cached == (H,)  # the snapshot is the truth again


def test_a_backend_keying_otherwise_is_refused() -> None:
    fleet = make_fleet()
    with pytest.raises(KeyMismatch):
        apply(fleet, fleet.backends["a"], FakePrompts(), line(Hello(1, 16, "cd" * 16, [])))
    with pytest.raises(KeyMismatch):
        apply(fleet, fleet.backends["a"], FakePrompts(), line(Hello(1, 32, ROOT, [])))


def test_a_dead_backend_is_forgotten_and_never_ranked() -> None:
    fleet = make_fleet()
    a, b = fleet.backends["a"], fleet.backends["b"]
    ks = keys(2)
    fleet.index.stored("a", H, ks)
    a.events_live = b.events_live = True
    prompt = RoutedPrompt(40, ks, "s", False)
    assert fleet.rank(prompt).order == ["a", "b"]
    fleet.take_out(a, "test")
    assert fleet.index.blocks("a") == 0 and not a.up and a.epoch == 1
    assert fleet.rank(prompt).order == ["b"]
    fleet.take_out(b, "test")
    assert fleet.rank(prompt) is None


def test_blocks_sent_but_not_yet_announced_count_as_guesses_until_a_removal_or_snapshot() -> None:
    fleet, prompts = make_fleet(), FakePrompts()
    a = fleet.backends["a"]
    ks = keys(4)
    prompt = RoutedPrompt(70, ks, None, False)
    apply(fleet, a, prompts, line(Hello(1, 16, ROOT, [H])))
    apply(fleet, a, prompts, line(Snapshot({H: [ks[0].hex()]})))
    assert fleet.prefill(a, prompt) == 70 - 16 + round(16 * 0.05)
    fleet.routed(a, prompt)  # its stored events are still on their way
    assert fleet.candidate(a, prompt).cached == (H, None, None, None)
    assert fleet.prefill(a, prompt) == round(70 - 64 + 16 * 0.05 + 3 * 16 * 0.2)
    apply(fleet, a, prompts, line(Stored(H, [k.hex() for k in ks[1:]])))
    apply(fleet, a, prompts, line(Removed(H, [ks[2].hex()])))  # evicted: not a guess any more either
    assert fleet.candidate(a, prompt).cached == (H, H)
    fleet.routed(a, prompt)
    apply(fleet, a, prompts, line(Snapshot({H: [ks[0].hex()]})))  # the snapshot is the truth
    assert fleet.candidate(a, prompt).cached == (H,)


def test_queued_prefill_is_a_candidates_load() -> None:
    fleet = make_fleet()
    a = fleet.backends["a"]
    a.open_requests, a.queued_tokens, a.others = 2, 300, 1
    assert fleet.candidate(a, RoutedPrompt(40, keys(2), None, False)) == Candidate("a", 3, (), 300, 1)
