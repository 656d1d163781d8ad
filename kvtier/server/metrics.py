"""What the server reports: one :class:`StatsReport` behind both ``/stats`` (JSON) and ``/metrics`` (Prometheus).

Both views are built from the same snapshot, so they cannot disagree.
Host and disk figures come from the cache manager's own counters; the
device tier (the engine's pool) and the engine totals are recorded here by
the engine thread (:class:`EngineMetrics`, thread-safe) as it steps, so
the HTTP side never reads the engine itself. The reload-vs-recompute cost
model's figures (``break_even``) come from the cache manager, which owns it.

The prefill time saved is an estimate: each step's wall time is split
between its prefilled tokens and its decoded ones in proportion to their
counts, which gives measured seconds per prefilled token; times the tokens
whose prefill was skipped. Attention makes long prompts cost more per
token, so this under-counts what a long cached prefix saves.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvtier import openmp
from kvtier.cache import Cache
from kvtier.engine.request import FinishReason, PrefetchCounters, Request, SpeculationCounters
from kvtier.engine.verify import VerifyCounters
from kvtier.hardware import cpu_isa, gpu_facts
from kvtier.server.schemas import (
    BreakEvenReport,
    EngineReport,
    GpuReport,
    HardwareReport,
    LatencyReport,
    PrefetchReport,
    RemoteReport,
    ServiceLinkReport,
    SpeculationReport,
    StatsReport,
    TierReport,
    VerifyReport,
    WarmingReport,
)
from kvtier.server.warming import WarmCounters
from kvtier.stats import (
    LATENCY_BUCKETS_S,
    TIER_COUNTERS,
    Histogram,
    LatencySnapshot,
    RemoteSnapshot,
    TierSnapshot,
)
from kvtier.tiers.base import TierKind
from kvtier.tiers.breaker import BreakerState
from kvtier.tiers.remote.frame import Rejection

# Time to first token spans milliseconds (a cached prefix) to tens of seconds (a long cold prompt on a CPU).
TTFT_BUCKETS_S: tuple[float, ...] = (*(m * 10.0**e for e in range(-3, 2) for m in (1.0, 2.5, 5.0)), 100.0)


@dataclass(frozen=True)
class PoolSnapshot:
    num_blocks: int
    free_blocks: int
    resident_blocks: int
    block_bytes: int


def latency_report(snapshot: LatencySnapshot) -> LatencyReport:
    """A :meth:`Histogram.snapshot` as a report; JSON has no infinity, so a non-finite percentile becomes None."""

    def finite(v: float | None) -> float | None:
        return v if v is not None and math.isfinite(v) else None

    return LatencyReport(
        count=snapshot.count,
        sum_s=snapshot.sum_s,
        p50_s=finite(snapshot.p50_s),
        p90_s=finite(snapshot.p90_s),
        p99_s=finite(snapshot.p99_s),
        buckets=list(snapshot.buckets),
    )


class EngineMetrics:
    """Engine totals and the device tier's counters; written by the engine thread, read by handlers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ttft = Histogram(TTFT_BUCKETS_S)
        self._finished: Counter[FinishReason] = Counter()
        self._prefill_computed = 0
        self._prefill_skipped = 0
        self._prefill_seconds = 0.0
        self._onboarded = 0
        self._onboarded_full = 0
        self._device_hit = 0
        self._device_miss = 0
        self._in_flight = 0
        self._pool = PoolSnapshot(0, 0, 0, 0)
        self._prefetch = PrefetchCounters()
        self._speculation = SpeculationCounters()
        self._verify = VerifyCounters()
        self._warming = WarmCounters()

    def observe_step(
        self,
        *,
        seconds: float,
        prefill_tokens: int,
        skipped_tokens: int,
        batch: int,
        onboarded: tuple[int, int] = (0, 0),
    ) -> None:
        """``onboarded``: bytes this step copied from host slots into the pool, and what every layer would be."""
        with self._lock:
            self._prefill_computed += prefill_tokens
            self._prefill_skipped += skipped_tokens
            self._onboarded += onboarded[0]
            self._onboarded_full += onboarded[1]
            if prefill_tokens:
                self._prefill_seconds += seconds * prefill_tokens / (prefill_tokens + batch)

    def observe_finished(self, req: Request, block_size: int) -> None:
        with self._lock:
            self._finished[req.finish_reason or FinishReason.ERROR] += 1
            if req.ttft_s is not None:
                self._ttft.observe(req.ttft_s)
                usable = (len(req.prompt_ids) - 1) // block_size * block_size
                hit = req.served_from.get(TierKind.DEVICE, 0)
                self._device_hit += hit
                self._device_miss += max(0, usable - hit)

    def set_in_flight(self, n: int) -> None:
        with self._lock:
            self._in_flight = n

    def set_pool(self, pool: PoolSnapshot) -> None:
        with self._lock:
            self._pool = pool

    def set_prefetch(self, counters: PrefetchCounters) -> None:
        """Takes a copy: the engine thread goes on updating its own."""
        copy = dataclasses.replace(counters)
        with self._lock:
            self._prefetch = copy

    def set_verify(self, counters: VerifyCounters) -> None:
        copy = dataclasses.replace(counters)
        with self._lock:
            self._verify = copy

    def set_warming(self, counters: WarmCounters) -> None:
        copy = dataclasses.replace(counters)
        with self._lock:
            self._warming = copy

    def set_speculation(self, counters: SpeculationCounters) -> None:
        """Takes a copy, like :meth:`set_prefetch`."""
        copy = dataclasses.replace(counters)
        with self._lock:
            self._speculation = copy

    def engine_report(self) -> EngineReport:
        with self._lock:
            per_token = self._prefill_seconds / self._prefill_computed if self._prefill_computed else None
            return EngineReport(
                requests={reason: self._finished[reason] for reason in FinishReason},
                in_flight=self._in_flight,
                prefill_tokens_computed=self._prefill_computed,
                prefill_tokens_skipped=self._prefill_skipped,
                onboarded_bytes=self._onboarded,
                onboarded_full_bytes=self._onboarded_full,
                ttft=latency_report(self._ttft.snapshot()),
                prefill_seconds_per_token=per_token,
                prefill_seconds_saved_estimate=(per_token or 0.0) * self._prefill_skipped,
                prefetch=PrefetchReport.model_validate(dataclasses.asdict(self._prefetch)),
                speculation=_speculation_report(self._speculation),
                verify=VerifyReport.model_validate(dataclasses.asdict(self._verify)),
                warming=WarmingReport.model_validate(dataclasses.asdict(self._warming)),
            )

    def device_report(self) -> TierReport:
        with self._lock:
            pool, hit, miss = self._pool, self._device_hit, self._device_miss
        return tier_report(
            TierSnapshot(
                capacity_bytes=pool.num_blocks * pool.block_bytes,
                used_bytes=(pool.num_blocks - pool.free_blocks) * pool.block_bytes,
                capacity_blocks=pool.num_blocks,
                blocks=pool.resident_blocks,
                hit_tokens=hit,
                miss_tokens=miss,
                load_latency=Histogram(LATENCY_BUCKETS_S).snapshot(),
            )
        )


def tier_report(snap: TierSnapshot) -> TierReport:
    """One tier of :meth:`kvtier.cache.Cache.stats` as a report: its sizes, every counter of
    :data:`~kvtier.stats.TIER_COUNTERS`, its hit rate and its load latency."""
    return TierReport(
        capacity_bytes=snap.capacity_bytes,
        used_bytes=snap.used_bytes,
        capacity_blocks=snap.capacity_blocks,
        blocks=snap.blocks,
        hit_rate=snap.hit_rate,
        load_latency=latency_report(snap.load_latency),
        **{name: getattr(snap, name) for name in TIER_COUNTERS},
    )


def hardware_report(device: torch.device, dtype: torch.dtype) -> HardwareReport:
    gpu = gpu_facts(device)
    return HardwareReport(
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        cpu_isa=list(cpu_isa()),
        omp_wait_policy=openmp.wait_policy,
        gpu=None if gpu is None else GpuReport(**dataclasses.asdict(gpu)),
    )


def remote_report(snap: RemoteSnapshot) -> RemoteReport:
    """The remote tier's own figures out of its stats snapshot (its tier counters go through :func:`tier_report`)."""
    return RemoteReport(
        breakers={name: BreakerState(state) for name, state in snap.breakers.items()},
        breaker_opens=snap.breaker_opens,
        skipped=snap.skipped,
        timeouts=snap.timeouts,
        redirects=snap.redirects,
        probes=snap.probes,
        writes=snap.writes,
        dropped_writes=snap.dropped_writes,
        write_queue=snap.write_queue,
        rejected={r.value: getattr(snap, r.value) for r in Rejection},
    )


def build_report(
    model: str,
    cache: Cache,
    metrics: EngineMetrics,
    hardware: HardwareReport | None = None,
) -> StatsReport:
    stats = cache.stats()
    tiers = {TierKind.DEVICE: metrics.device_report()}
    for tier in cache.tiers:
        tiers[tier.kind] = tier_report(stats.tiers[tier.kind.value])
    remote = stats.remote
    if remote is not None:
        tiers[TierKind.REMOTE] = tier_report(remote)
    return StatsReport(
        remote=remote_report(remote) if remote is not None else None,
        model=model,
        block_size=cache.layout.block_size,
        hardware=hardware,
        tiers=tiers,
        pinned_blocks=stats.pinned_blocks,
        ttl_pinned_blocks=cache.ttl_pinned(),
        engine=metrics.engine_report(),
        break_even=BreakEvenReport.model_validate(stats.break_even),
        service=None
        if stats.service is None
        else ServiceLinkReport.model_validate(stats.service, from_attributes=True),
    )


# -- Prometheus ------------------------------------------------------------------------------------
_TIER_GAUGES = {
    "capacity_bytes": "Bytes the tier can hold.",
    "used_bytes": "Bytes of the tier in use.",
    "capacity_blocks": "Blocks the tier can hold.",
    "blocks": "Blocks cached in the tier.",
    "hit_rate": "hit_tokens / (hit_tokens + miss_tokens).",
}


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _add_histogram(family: HistogramMetricFamily, labels: list[str], report: LatencyReport) -> None:
    cumulative, buckets = 0, []
    for bound, count in report.buckets:
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    family.add_metric(labels, buckets, report.sum_s)


def _tier_families(report: StatsReport) -> Iterator[Metric]:
    for name, doc in _TIER_GAUGES.items():
        gauge = GaugeMetricFamily(f"kvtier_tier_{name}", doc, labels=["tier"])
        for kind, tier in report.tiers.items():
            value = getattr(tier, name)
            if value is not None:
                gauge.add_metric([kind.value], value)
        yield gauge
    for name, doc in TIER_COUNTERS.items():
        counter = CounterMetricFamily(f"kvtier_tier_{name}", doc, labels=["tier"])
        for kind, tier in report.tiers.items():
            counter.add_metric([kind.value], getattr(tier, name))
        yield counter
    latency = _histogram("kvtier_tier_load_latency_seconds", "Time to make one block readable in host.", ["tier"])
    for kind, tier in report.tiers.items():
        _add_histogram(latency, [kind.value], tier.load_latency)
    yield latency


def _speculation_report(c: SpeculationCounters) -> SpeculationReport:
    return SpeculationReport(
        verify_steps=c.verify_steps, drafted=c.drafted, accepted=c.accepted, acceptance_rate=c.acceptance_rate
    )


def _speculation_families(report: StatsReport) -> Iterator[Metric]:
    """Prompt-lookup drafts and acceptances; the rate is their quotient, left to the query."""
    s = report.engine.speculation
    if s is None:
        return
    yield CounterMetricFamily("kvtier_spec_draft_tokens", "Prompt-lookup draft tokens verified.", s.drafted)
    yield CounterMetricFamily("kvtier_spec_accepted_tokens", "Draft tokens the model agreed with.", s.accepted)
    yield CounterMetricFamily("kvtier_spec_verify_steps", "Request-steps that carried drafts.", s.verify_steps)


def _hardware_families(report: StatsReport) -> Iterator[Metric]:
    hw = report.hardware
    if hw is None:
        return
    info = GaugeMetricFamily(
        "kvtier_engine_device_info", "The engine's device and dtype (value 1).", labels=["device", "dtype"]
    )
    info.add_metric([hw.device, hw.dtype], 1)
    yield info
    if hw.gpu is not None:
        yield GaugeMetricFamily("kvtier_gpu_memory_used_bytes", "GPU memory in use (NVML).", hw.gpu.memory_used_bytes)
        yield GaugeMetricFamily("kvtier_gpu_memory_total_bytes", "GPU memory (NVML).", hw.gpu.memory_total_bytes)
        yield GaugeMetricFamily("kvtier_gpu_utilization_percent", "GPU utilisation (NVML).", hw.gpu.utilization_percent)


def _engine_families(report: StatsReport) -> Iterator[Metric]:
    e = report.engine
    yield CounterMetricFamily("kvtier_prefill_tokens_computed", "Prompt tokens prefilled.", e.prefill_tokens_computed)
    yield CounterMetricFamily(
        "kvtier_prefill_tokens_skipped", "Prompt tokens whose prefill was skipped (cached).", e.prefill_tokens_skipped
    )
    requests = CounterMetricFamily("kvtier_requests", "Finished requests.", labels=["finish_reason"])
    for reason, n in e.requests.items():
        requests.add_metric([reason.value], n)
    yield requests
    yield GaugeMetricFamily("kvtier_requests_in_flight", "Requests admitted and not finished.", e.in_flight)
    ttft = _histogram("kvtier_ttft_seconds", "Time to first token, from arrival at the engine.", [])
    _add_histogram(ttft, [], e.ttft)
    yield ttft
    if e.prefill_seconds_per_token is not None:
        yield GaugeMetricFamily(
            "kvtier_prefill_seconds_per_token", "Measured prefill seconds per token.", e.prefill_seconds_per_token
        )
    saved = e.prefill_seconds_saved_estimate
    yield GaugeMetricFamily("kvtier_prefill_seconds_saved_estimate", "Skipped tokens x prefill s/token.", saved)
    yield GaugeMetricFamily("kvtier_pinned_blocks", "Host blocks pinned by loads in progress.", report.pinned_blocks)
    yield GaugeMetricFamily("kvtier_ttl_pinned_blocks", "Keys under a live TTL pin.", report.ttl_pinned_blocks)


def _cost_families(report: StatsReport) -> Iterator[Metric]:
    """The break-even model's fitted figures, in base units (the JSON quotes them in ms and GB/s)."""
    costs = report.break_even
    bandwidth = GaugeMetricFamily(
        "kvtier_tier_bandwidth_bytes_per_second", "Fitted fetch bandwidth of the tier.", labels=["tier"]
    )
    latency = GaugeMetricFamily(
        "kvtier_tier_fetch_latency_seconds", "Fitted fixed cost of one fetch batch from the tier.", labels=["tier"]
    )
    for kind, tier in costs.tiers.items():
        if tier.bandwidth_gbps is not None:
            bandwidth.add_metric([kind.value], tier.bandwidth_gbps * 1e9)
        latency.add_metric([kind.value], tier.latency_ms / 1e3)
    yield bandwidth
    yield latency
    yield GaugeMetricFamily(
        "kvtier_prefill_model_seconds_per_token",
        "Fitted prefill seconds per computed token (the linear part; attention is quoted apart in /stats).",
        costs.prefill.ms_per_token / 1e3,
    )
    prefetch = report.engine.prefetch
    for name, field in PrefetchReport.model_fields.items():
        yield CounterMetricFamily(f"kvtier_prefetch_{name}", field.description or name, getattr(prefetch, name))
    verify = report.engine.verify
    for name, field in VerifyReport.model_fields.items():
        yield CounterMetricFamily(f"kvtier_verify_{name}", field.description or name, getattr(verify, name))
    warming = report.engine.warming
    for name, field in WarmingReport.model_fields.items():
        family = GaugeMetricFamily if name == "running" else CounterMetricFamily
        yield family(f"kvtier_warming_{name}", field.description or name, getattr(warming, name))


def _remote_families(report: StatsReport) -> Iterator[Metric]:
    """The remote tier's breakers, writes and rejections (its hits, bytes and latency are tier metrics)."""
    r = report.remote
    if r is None:
        return
    state = GaugeMetricFamily(
        "kvtier_remote_breaker_open", "1 while the node's circuit breaker is open.", labels=["node"]
    )
    for node, s in r.breakers.items():
        state.add_metric([node], float(s is BreakerState.OPEN))
    yield state
    counters = {
        "breaker_opens": "Times a node's circuit breaker opened.",
        "skipped": "Remote calls skipped while a breaker was open (each a miss).",
        "timeouts": "Remote calls that ran into remote.timeout_ms.",
        "redirects": "Keys a Redis Cluster node sent to another (MOVED/ASK), followed once.",
        "probes": "Remote headers read at lookup.",
        "writes": "Blocks written to the remote.",
        "dropped_writes": "Blocks not written to the remote (queue full, or the write failed).",
    }
    for name, doc in counters.items():
        yield CounterMetricFamily(f"kvtier_remote_{name}", doc, getattr(r, name))
    yield GaugeMetricFamily("kvtier_remote_write_queue", "Blocks waiting to be written to the remote.", r.write_queue)
    rejected = CounterMetricFamily(
        "kvtier_remote_rejected_values", "Remote values refused (never served), by reason.", labels=["reason"]
    )
    for reason, n in r.rejected.items():
        rejected.add_metric([reason], n)
    yield rejected


class StatsCollector(Collector):
    """Reads a fresh :class:`StatsReport` at every scrape; nothing is double-booked in prometheus_client."""

    def __init__(self, report: Callable[[], StatsReport]) -> None:
        self._report = report

    def collect(self) -> Iterator[Metric]:
        report = self._report()
        yield from _hardware_families(report)
        yield from _tier_families(report)
        yield from _engine_families(report)
        yield from _speculation_families(report)
        yield from _cost_families(report)
        yield from _remote_families(report)

    def describe(self) -> Iterator[Metric]:
        return iter(())
