"""`kvtier bench tenants`: cross-tenant timing at the server, where a client would measure it (TTFT).

One real ``kvtier serve`` with two tenants (API keys A and B). Each round,
tenant A first sends a fresh prompt P (untimed) and the bench waits, through
the admin ``/lookup``, until A's blocks of P are stored. Then three streamed
requests are timed, in a shuffled order: A sends P (a hit), B sends P
(another tenant's cached prompt), A sends a fresh prompt Q of the same length
(a miss). The figures: each arm's TTFT median, and two Mann-Whitney U tests,
hit vs miss (the positive control: a hit must be told apart, faster) and
foreign vs miss (must not be: p > 0.05).

The unit test of the same claim is ``tests/security/test_tenant_timing.py``
(at the manager, where noise is lowest); this is the end-to-end figure, with
the engine's queue and the HTTP stack in the way, as an attacker would see it.
"""

from __future__ import annotations

import http.client
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench import results
from kvtier.bench.client import stream_completion
from kvtier.bench.fleet import Proc
from kvtier.bench.peer.machine import describe
from kvtier.bench.soak import serving, text_ids

KEYS = {"sk-bench-tenant-a-0123": "a", "sk-bench-tenant-b-0123": "b"}
ADMIN = "bench-tenants-admin-token-0123456789"
KEY_A, KEY_B = list(KEYS)


@dataclass(frozen=True)
class TenantSpec:
    rounds: int = 200
    blocks: int = 8  # whole blocks of each prompt (block size 16), plus a 5-token tail
    seed: int = 0


def mann_whitney_p(x: list[float], y: list[float]) -> float:
    """Two-sided p of the Mann-Whitney U test: normal approximation, tie-corrected, with continuity correction."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    n1, n2 = len(a), len(b)
    values = np.concatenate([a, b])
    n = n1 + n2
    ranks = np.empty(n)
    ranks[np.argsort(values, kind="mergesort")] = np.arange(1, n + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    ranks = (np.bincount(inverse, weights=ranks) / counts)[inverse]
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    ties = float((counts.astype(np.float64) ** 3 - counts).sum())
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    if sigma == 0:
        return 1.0
    return math.erfc(max(0.0, abs(u - n1 * n2 / 2) - 0.5) / sigma / math.sqrt(2))


def _post(port: int, path: str, body: dict[str, Any], key: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request(
            "POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {response.read()[:300]!r}")
        return response.read()
    finally:
        conn.close()


def ttft(port: int, prompt: list[int], key: str) -> float:
    got = stream_completion(port, prompt, 1, {"Authorization": f"Bearer {key}"}, timeout=600).checked()
    assert got.ttft_s is not None
    return got.ttft_s


def _stored(server: Proc, prompt: list[int], tenant: str, tokens: int, timeout_s: float = 120) -> None:
    """Poll the admin /lookup until ``tenant`` holds ``tokens`` of ``prompt`` (stores land after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        raw = _post(server.port, "/lookup", {"prompt": prompt, "tenant": tenant}, ADMIN)
        if json.loads(raw)["cached_tokens"] >= tokens:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"tenant {tenant}'s blocks were not stored in {timeout_s}s")


class Arm(StrEnum):
    HIT = "hit"  # tenant A, its own cached prompt
    FOREIGN = "foreign"  # tenant B, A's cached prompt
    MISS = "miss"  # tenant A, a prompt nobody sent


ARMS = (Arm.HIT, Arm.FOREIGN, Arm.MISS)


def run(spec: TenantSpec, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    n = spec.blocks * 16 + 5
    pool = text_ids(2 * spec.rounds * 7 + n + 10, offset=211)
    rng = np.random.default_rng(spec.seed)
    sections = {"server": {"api_keys": KEYS, "admin_token": ADMIN, "max_tokens_limit": 16}}
    samples: dict[Arm, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="kvtier-tenants-") as tmp, serving(None, Path(tmp), sections) as server:
        ttft(server.port, pool[:n], KEY_A)  # warm-up: first forward, allocator, threads
        for i in range(spec.rounds):
            # Each prompt opens with a token of its own, so no two share a block.
            p = [20_000 + 2 * i, *pool[14 * i + 1 : 14 * i + n]]
            q = [20_001 + 2 * i, *pool[14 * i + 7 : 14 * i + 6 + n]]
            ttft(server.port, p, KEY_A)
            _stored(server, p, "a", spec.blocks * 16)
            for j in rng.permutation(len(ARMS)):
                arm = ARMS[j]
                key = KEY_B if arm is Arm.FOREIGN else KEY_A
                samples[arm].append(ttft(server.port, q if arm is Arm.MISS else p, key))
            if progress is not None:
                progress(i + 1)
    return {
        "setup": {
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": describe(),
            **asdict(spec),
            "prompt_tokens": n,
        },
        "ttft_median_s": {arm.value: statistics.median(v) for arm, v in samples.items()},
        "p_hit_vs_miss": mann_whitney_p(samples[Arm.HIT], samples[Arm.MISS]),
        "p_foreign_vs_miss": mann_whitney_p(samples[Arm.FOREIGN], samples[Arm.MISS]),
        "samples_s": {arm.value: v for arm, v in samples.items()},
    }


def table(result: dict[str, Any]) -> str:
    m = result["ttft_median_s"]
    return "\n".join(
        [
            f"kvtier bench tenants, {result['setup']['date']}: {result['setup']['rounds']} rounds of "
            f"{result['setup']['prompt_tokens']}-token prompts, TTFT medians",
            f"  same tenant, cached: {m['hit'] * 1000:.1f} ms; other tenant, the same prompt: "
            f"{m['foreign'] * 1000:.1f} ms; a miss: {m['miss'] * 1000:.1f} ms",
            f"  hit vs miss p = {result['p_hit_vs_miss']:.3g} (must be < 0.05); "
            f"other tenant vs miss p = {result['p_foreign_vs_miss']:.3g} (must be > 0.05)",
        ]
    )


def save(result: dict[str, Any], out_dir: Path) -> Path:
    return results.write(result, out_dir, "tenants")
