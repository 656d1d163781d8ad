"""Cross-tenant timing: another tenant's request for a cached prompt takes the time of a miss, per tier.

Tenant = namespace. Tenant A has prompt P cached (in host memory; or on disk
only; or in a real redis-server only, the remote tier). Three requests are timed at the manager, where noise is lowest:
lookup + load of P by A (a hit), of P by tenant B (foreign), and of a prompt
Q of the same length that nobody stored, by A (a miss).

Why "indistinguishable" holds by construction: the namespace is bound into
the root of B's key chain, so B's keys for P are other keys than A's; B's
lookup hashes the same number of blocks, finds its first key in no tier and
returns ``ABSENT`` without digesting a block or pinning anything: the very
path of a miss (``MissReason.ABSENT``, asserted below). The statistics check
that no difference hides in what surrounds that path.

The positive control is that the same measurement does tell a hit from a
miss. At the manager a hit costs *more* than a miss (its blocks are digested,
confirmed, pinned, and read from disk on the disk tier); the recompute that
makes a miss slow in the end happens in the engine, outside this measurement
(``kvtier bench tenants`` measures that side: TTFT at a real server). So
the control is two-sided: hit vs miss differ with p < 1e-6.

Robustness on a shared, noisy machine: the three requests of each round run
in a shuffled order (seeded), so load changes hit every arm alike; nothing is
compared with a wall-clock threshold; the test is Mann-Whitney U (two-sided,
tie-corrected normal approximation, :func:`kvtier.bench.tenants.mann_whitney_p`;
scipy is not a dependency). A true null
still gives p <= 0.05 one time in twenty, so a tier passes when any of up to
three independent runs of 300 rounds gives p > 0.05 (a false alarm in
0.05**3 = 1 of 8,000 runs); a real leak large enough to see fails all three.

Being over wall-clock samples, the statistical test is marked ``timing``:
``make test-timing`` runs it alone; ``make test`` runs the path test (the
construction, counted) and no timing.
"""

from __future__ import annotations

import enum
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis

from kvtier.bench.tenants import mann_whitney_p
from kvtier.config import WriteMode
from kvtier.index import MissReason
from kvtier.manager import CacheManager
from kvtier.stats import CacheStats
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, make_config, payload, prompt, toy_layout
from tests.remote import remote_section

ROUNDS = 300
RUNS = 3
BLOCKS = 4
A, B = "tenant/a", "tenant/b"


def test_mann_whitney_separates_shifted_samples_and_not_equal_ones() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, 300)
    assert mann_whitney_p(x, x + 1) < 1e-12
    assert mann_whitney_p(x, x.copy()) == 1.0
    assert mann_whitney_p(np.array([1.0, 2, 3, 4]), np.array([5.0, 6, 7, 8])) == pytest.approx(0.0304, abs=1e-3)
    same = [mann_whitney_p(rng.normal(0, 1, 300), rng.normal(0, 1, 300)) for _ in range(200)]
    assert 0.01 < np.mean(np.array(same) <= 0.05) < 0.12  # a true null: about one in twenty below 0.05


class Arm(enum.Enum):
    HIT = "same tenant, cached"
    FOREIGN = "other tenant, cached for A"
    MISS = "same tenant, never stored"


@dataclass
class Bench:
    m: CacheManager
    tier: TierKind
    redis_port: int | None = None  # the remote tier's server, emptied with the local tiers before a run

    def request(self, arm: Arm, tokens: np.ndarray) -> int:
        """One timed lookup + load (ns); the tier is set up first, untimed."""
        self.only_in_tier()
        ns = B if arm is Arm.FOREIGN else A
        started = time.perf_counter_ns()
        with self.m.load(self.m.lookup(self.m.keyed(tokens, ns))) as handle:
            served = handle.num_tokens
        elapsed = time.perf_counter_ns() - started
        assert (served > 0) is (arm is Arm.HIT)
        return elapsed

    def only_in_tier(self) -> None:
        """Leave P in the measured tier alone, so a hit reads that tier (a hit promotes what it reads)."""
        if self.tier is TierKind.DISK:
            self.m.clear(TierKind.HOST)
        elif self.tier is TierKind.REMOTE:
            self.m.clear()  # host and disk: only Redis holds P

    def store(self, tokens: np.ndarray) -> None:
        assert self.m.store(self.m.keyed(tokens, A), [payload(toy_layout(), i) for i in range(BLOCKS)]) == BLOCKS
        if self.m.remote is not None:
            assert self.m.remote.flush(60)  # written behind the store: wait until Redis holds it

    def run(self, seed: int) -> dict[Arm, np.ndarray]:
        """``ROUNDS`` rounds, each with prompts of its own: P (stored for A) and Q (stored by nobody).

        Fresh prompts each round, because an absent key's cost in a tier's
        index depends a little on the key itself (its hash's probe sequence):
        one fixed P and one fixed Q would compare two keys, not two arms.
        """
        rng = np.random.default_rng(seed)
        ps = [prompt(BLOCKS * BLOCK, seed=10_000 * seed + 2 * i) for i in range(ROUNDS)]
        qs = [prompt(BLOCKS * BLOCK, seed=10_000 * seed + 2 * i + 1) for i in range(ROUNDS)]
        self.m.clear()
        if self.redis_port is not None:
            with redis.Redis(port=self.redis_port) as client:
                client.flushall()
        for p in ps:
            self.store(p)
        out: dict[Arm, list[int]] = {arm: [] for arm in Arm}
        arms = list(Arm)
        gc.collect()
        gc.disable()  # a collection lands in whichever arm it lands in: keep it out of all of them
        try:
            for p, q in zip(ps, qs, strict=True):
                for i in rng.permutation(len(arms)):
                    out[arms[i]].append(self.request(arms[i], q if arms[i] is Arm.MISS else p))
        finally:
            gc.enable()
        return {arm: np.array(v) for arm, v in out.items()}


@pytest.fixture(params=[TierKind.HOST, TierKind.DISK, TierKind.REMOTE], ids=lambda k: k.value)
def bench(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Bench]:
    slots = ROUNDS * BLOCKS + 64
    remote, port = {}, None
    if request.param is TierKind.REMOTE:
        server = request.getfixturevalue("redis_server")
        remote, port = remote_section(server.url, timeout_ms=5000), server.port
    cfg = make_config(
        tmp_path,
        host={"capacity_bytes": slots * 4096},
        disk={"capacity_bytes": slots * 4096, "fsync": "never"},  # durability is not what is measured
        cache={"write_mode": WriteMode.WRITE_THROUGH},
        remote=remote,
    )
    with CacheManager(cfg, toy_layout(), model_fingerprint="toy-model") as m:
        yield Bench(m, request.param, port)


def _stats_moved(m: CacheManager, before: CacheStats) -> dict[str, object]:
    after = m.stats()
    return {
        f"{tier}.{k}": getattr(after.tiers[tier], k) - getattr(before.tiers[tier], k)
        for tier in ("host", "disk", "remote")
        if tier in after.tiers
        for k in ("lookups", "hit_tokens", "miss_tokens", "confirm_mismatches", "bytes_read", "checksum_failures")
    } | {"pinned_blocks": after.pinned_blocks}


def test_another_tenant_takes_the_path_of_a_miss(bench: Bench) -> None:
    """What makes the timing below hold by construction: B's lookup of A's prompt does exactly a miss's work."""
    p, q = prompt(BLOCKS * BLOCK, seed=1), prompt(BLOCKS * BLOCK, seed=2)
    bench.store(p)
    bench.only_in_tier()
    moved = {}
    for arm, tokens, ns in ((Arm.FOREIGN, p, B), (Arm.MISS, q, A)):
        before = bench.m.stats()
        got = bench.m.lookup(bench.m.keyed(tokens, ns))
        assert (got.cached_tokens, got.miss_reason) == (0, MissReason.ABSENT)  # not CONFIRM_MISMATCH: other keys
        moved[arm] = _stats_moved(bench.m, before)
    assert moved[Arm.FOREIGN] == moved[Arm.MISS]
    work = {k: v for k, v in moved[Arm.MISS].items() if not k.endswith(("lookups", "miss_tokens"))}
    assert work == dict.fromkeys(work, 0)  # nothing hit, confirmed, read or pinned
    assert bench.m.lookup(bench.m.keyed(p, A)).tiers == (bench.tier,) * BLOCKS


@pytest.mark.timing
def test_another_tenant_takes_the_time_of_a_miss(bench: Bench) -> None:
    p, q = prompt(BLOCKS * BLOCK, seed=1), prompt(BLOCKS * BLOCK, seed=2)
    bench.store(p)
    foreign, miss = bench.m.lookup(bench.m.keyed(p, B)), bench.m.lookup(bench.m.keyed(q, A))
    assert (foreign.cached_tokens, foreign.miss_reason) == (0, MissReason.ABSENT)  # not CONFIRM_MISMATCH: other keys
    assert (miss.cached_tokens, miss.miss_reason) == (0, MissReason.ABSENT)
    bench.only_in_tier()
    assert bench.m.lookup(bench.m.keyed(p, A)).tiers == (bench.tier,) * BLOCKS
    verdicts = []
    for run in range(RUNS):
        samples = bench.run(seed=run)
        control = mann_whitney_p(samples[Arm.HIT], samples[Arm.MISS])
        same = mann_whitney_p(samples[Arm.FOREIGN], samples[Arm.MISS])
        verdicts.append((control, same))
        assert control < 1e-6, f"run {run}: the measurement cannot tell a hit from a miss (p={control:.3g})"
        if same > 0.05:
            break
    assert max(same for _, same in verdicts) > 0.05, f"another tenant's request differs from a miss: {verdicts}"
    assert bench.m.stats().pinned_blocks == 0
