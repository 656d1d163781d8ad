"""Reload or recompute: the cost model behind prefetch sizes and deadlines.

Fetching a cached block is worth it only while it beats recomputing it. Both
sides are measured as the service runs and refitted after every observation:

* each tier's fetch cost, ``seconds = latency + bytes / bandwidth``, from the
  batches it actually served (disk → host promotions, host → pool copies);
  a disk block also pays the host → pool copy, since it lands in host first;
* the engine's prefill cost, ``seconds = overhead + a·n + b·Σ context``, where
  ``n`` is the tokens a forward computes and ``Σ context`` sums, over those
  tokens, how many positions each attends to (the quadratic part of
  attention). Only forwards that prefill something are observed: decode steps
  alone would teach the model nothing about long prompts.

Both are exponentially weighted least-squares fits, so the model follows the
machine as it warms up or gets loaded by neighbours, anchored by a ridge prior
(the development machine's figures) until the first samples arrive.

:meth:`BreakEvenModel.plan` picks how many leading cached blocks to fetch so
that fetch time plus recomputing the rest is smallest, and a deadline: the
fetch is abandoned once waiting longer would cost more than it could save,
and whatever has not arrived by then is recomputed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.tiers.base import TierKind

# Ridge priors: this project's 2-core development machine (float32 SmolLM2).
_TIER_PRIOR: dict[TierKind, tuple[float, float]] = {  # (latency s, bandwidth bytes/s)
    TierKind.DEVICE: (0.0, 50e9),
    TierKind.HOST: (20e-6, 10e9),
    TierKind.DISK: (300e-6, 2e9),
    TierKind.REMOTE: (500e-6, 1e9),  # a loopback Redis; a network one is refitted from its first fetches
}
_PREFILL_PRIOR = (0.03, 1.5e-3, 2.5e-7)  # overhead s, s per token, s per attended position
_FORGET = 0.9  # each new sample weighs as much as the last ten together, roughly
_FLOOR = 0.1  # no coefficient falls below a tenth of its prior, whatever the samples say
_PRIOR_WEIGHT = 0.05  # the prior counts as a twentieth of a sample: data wins fast, the prior fills gaps
BREAK_EVEN_CONTEXTS = (1024, 4096)  # where /stats quotes per-block costs


class _Fit:
    """Exponentially weighted ridge regression ``y ≈ x · theta``, as relative corrections to ``prior``.

    It fits ``theta = prior · (1 + delta)`` on each term's share of the
    measured seconds (``x · prior``) and puts the ridge on ``delta``. A term
    the data barely exercises (the attention term, while prompts are short;
    latency vs bandwidth, while every batch has the same size) contributes
    almost nothing to the measured seconds, so its correction stays near
    zero and the prior stands; terms that carry the measured time are fitted
    freely. The ridge is ``_PRIOR_WEIGHT`` times one average sample's weight.
    """

    def __init__(self, prior: Sequence[float]) -> None:
        self._prior = np.asarray(prior, dtype=np.float64)
        n = len(self._prior)
        self._vtv = np.zeros((n, n))
        self._vtr = np.zeros(n)
        self._weight = 0.0  # the samples' total weight, after forgetting
        self.samples = 0
        self._theta: np.ndarray | None = None  # solved once per observation, not once per question

    def observe(self, x: Sequence[float], y: float) -> None:
        v = np.asarray(x, dtype=np.float64) * self._prior  # seconds each term predicts
        self._vtv = _FORGET * self._vtv + np.outer(v, v)
        self._vtr = _FORGET * self._vtr + v * (y - v.sum())
        self._weight = _FORGET * self._weight + 1.0
        self.samples += 1
        self._theta = None

    @property
    def theta(self) -> np.ndarray:
        """Coefficients, each at least ``_FLOOR`` of its prior.

        Short prompts spend their time in the fixed per-forward cost, and a
        free fit may then put the per-token cost at zero: a model that
        believes recomputing is free would never fetch anything.
        """
        if self._theta is None:
            self._theta = self._solve()
        return self._theta.copy()

    def _solve(self) -> np.ndarray:
        if not self.samples:
            return self._prior.copy()
        n = len(self._prior)
        ridge = _PRIOR_WEIGHT * max(float(np.trace(self._vtv)) / (n * self._weight), 1e-300)
        delta = np.linalg.solve(self._vtv + ridge * np.eye(n), self._vtr)
        return self._prior * np.maximum(1.0 + delta, _FLOOR)


@dataclass(frozen=True)
class FetchPlan:
    """How many leading cached blocks to fetch, and until when waiting for them pays."""

    blocks: int  # leading blocks worth fetching, counted from the plan's first block
    fetch_s: float  # predicted time to bring them to the pool
    recompute_s: float  # predicted time to prefill those blocks' tokens instead
    deadline_s: float  # seconds from now: after this, the rest is recomputed


class BreakEvenModel:
    """Per-tier fetch costs and the engine's prefill cost, refitted from measurements (thread-safe)."""

    def __init__(self, block_size: int, block_bytes: int, *, deadline_slack: float = 2.0) -> None:
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.deadline_slack = deadline_slack
        self._lock = threading.Lock()
        self._tiers = {kind: _Fit((lat, 1.0 / bw)) for kind, (lat, bw) in _TIER_PRIOR.items()}  # x = [1, bytes]
        self._prefill = _Fit(_PREFILL_PRIOR)  # x = [1, tokens, attended positions]

    # -- measurements ----------------------------------------------------------
    def observe_fetch(self, kind: TierKind, nbytes: int, seconds: float) -> None:
        """One batch of ``nbytes`` served by tier ``kind`` in ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._tiers[kind].observe((1.0, float(nbytes)), seconds)

    def observe_forward(self, spans: Sequence[tuple[int, int]], seconds: float) -> None:
        """One forward that computed ``(start, count)`` new tokens per sequence in ``seconds``."""
        if seconds <= 0 or not any(count > 1 for _, count in spans):
            return
        tokens = sum(count for _, count in spans)
        attended = sum(_attended(start, count) for start, count in spans)
        with self._lock:
            self._prefill.observe((1.0, float(tokens), attended), seconds)

    # -- predictions -------------------------------------------------------------
    def fetch_s(self, kind: TierKind, blocks: int) -> float:
        """Seconds to bring ``blocks`` blocks from tier ``kind`` into the engine's pool."""
        if blocks <= 0:
            return 0.0
        with self._lock:
            return self._fetch_locked(kind, blocks)

    def _fetch_locked(self, kind: TierKind, blocks: float, *, latency: bool = True) -> float:
        lat, per_byte = self._tiers[kind].theta
        own = (lat if latency else 0.0) + per_byte * blocks * self.block_bytes
        if kind in (TierKind.DEVICE, TierKind.HOST):
            return float(own)
        return float(own) + self._fetch_locked(TierKind.HOST, blocks, latency=latency)  # via host to the pool

    def prefill_s(self, start: int, count: int) -> float:
        """Seconds to prefill ``count`` tokens on top of ``start`` cached positions."""
        if count <= 0:
            return 0.0
        with self._lock:
            c, a, b = self._prefill.theta
        return float(c + a * count + b * _attended(start, count))

    def extension_s(self, first_block: int, wanted: int, landed: int, elapsed_s: float, total_tokens: int) -> float:
        """More time worth granting a fetch at its deadline, judged on its own progress so far.

        The deadline was a prediction; this is the check against reality.
        With blocks landed, the rest will take ``(wanted - landed) / rate``
        at the fetch's own rate, and waiting for it is worth it only while
        that is less than recomputing those blocks (then it gets
        ``deadline_slack`` times that remaining time). With nothing landed
        yet there is no rate (a first cold read, one large batch): it may wait
        until it has spent half of what the whole fetch would save, so a late
        fetch costs at most half the recompute it was meant to avoid, and a
        dead tier is given up on without stalling the request.
        """
        if landed >= wanted:
            return 0.0
        bs = self.block_size
        start, stop = (first_block + landed) * bs, (first_block + wanted) * bs
        saved = self.prefill_s(start, total_tokens - start) - self.prefill_s(stop, total_tokens - stop)
        if landed <= 0 or elapsed_s <= 0:
            return max(0.0, saved / 2 - elapsed_s)
        remaining = (wanted - landed) * elapsed_s / landed
        return self.deadline_slack * remaining if remaining < saved else 0.0

    def plan(self, tiers: Sequence[TierKind], first_block: int, total_tokens: int) -> FetchPlan:
        """The fetch of ``tiers[j]``-held blocks ``first_block + j`` that minimises fetch + recompute.

        A prefix is only useful whole, so the choice is a cut ``k``: fetch
        blocks ``[first_block, first_block + k)`` and prefill everything from
        there on. Costs are cumulative per tier (each tier's latency is paid
        once). The deadline allows ``deadline_slack`` times the predicted
        fetch time, but never more than the fetch saves: waiting past that
        point loses even if the blocks then arrive at once.
        """
        bs = self.block_size
        start = first_block * bs
        with self._lock:
            c, a, b = self._prefill.theta
            # fetch[k]: every tier among the first k blocks pays its latency once, plus its bytes.
            fetch = np.zeros(len(tiers) + 1)
            for kind in set(tiers):
                held = np.concatenate(([0], np.cumsum([t is kind for t in tiers])))
                per_block = self._fetch_locked(kind, 1, latency=False)
                latency = self._fetch_locked(kind, 1) - per_block
                fetch += np.where(held > 0, latency + per_block * held, 0.0)
        cut = start + bs * np.arange(len(tiers) + 1)  # the first recomputed position for each choice
        count = np.maximum(total_tokens - cut, 0)
        rest = np.where(count > 0, c + a * count + b * _attended_np(cut, count), 0.0)
        k = int(np.argmin(fetch + rest))
        recompute = float(rest[0] - rest[k])
        deadline = min(self.deadline_slack * float(fetch[k]), recompute) if k else 0.0
        return FetchPlan(k, float(fetch[k]), recompute, max(0.0, deadline))

    # -- /stats ------------------------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        """The model's current figures, for operators: what a block costs each way."""
        with self._lock:
            tiers = {}
            for kind, fit in self._tiers.items():
                if kind is TierKind.REMOTE and not fit.samples:
                    continue  # most deployments have no remote tier: its prior shows from its first fetch on
                lat, per_byte = fit.theta
                tiers[kind.value] = {
                    "latency_ms": round(float(lat) * 1e3, 4),
                    "bandwidth_gbps": round(1e-9 / float(per_byte), 3) if per_byte > 0 else None,
                    "samples": fit.samples,
                }
            c, a, b = (float(v) for v in self._prefill.theta)
            samples = self._prefill.samples
            # The marginal cost of one more block in a batch; each tier's latency is quoted apart.
            fetch_block = {
                kind.value: self._fetch_locked(kind, 1, latency=False) for kind in (TierKind.HOST, TierKind.DISK)
            }
        per_block = {}
        for ctx in BREAK_EVEN_CONTEXTS:
            recompute = a * self.block_size + b * _attended(ctx, self.block_size)
            per_block[str(ctx)] = {
                "recompute_ms": round(recompute * 1e3, 4),
                **{f"{t}_fetch_ms": round(s * 1e3, 4) for t, s in fetch_block.items()},
                **{f"{t}_wins_x": round(recompute / s, 1) if s > 0 else None for t, s in fetch_block.items()},
            }
        return {
            "tiers": tiers,
            "prefill": {
                "overhead_ms": round(c * 1e3, 3),
                "ms_per_token": round(a * 1e3, 5),
                "ns_per_attended_position": round(b * 1e9, 4),
                "samples": samples,
            },
            "per_block_at_context": per_block,
            "block_tokens": self.block_size,
            "block_bytes": self.block_bytes,
            "deadline_slack": self.deadline_slack,
        }


def _attended(start: int, count: int) -> float:
    """Σ over ``count`` new tokens at positions ``start ..`` of the positions each attends to."""
    return float(count * start + count * (count + 1) / 2)


def _attended_np(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    return count * start + count * (count + 1) / 2


__all__ = ["BREAK_EVEN_CONTEXTS", "BreakEvenModel", "FetchPlan"]
