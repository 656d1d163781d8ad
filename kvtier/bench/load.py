"""`kvtier bench load` (run by `make soak`): many streaming agents against one real ``kvtier serve``, for minutes.

What it shows: under steady load from 64 clients whose working set is three
times the host tier, nothing errs and nothing grows. Each client is an agent:
a session is a growing transcript (one system prompt every session shares,
then ``turn_tokens`` more per turn), resent whole each turn, so each turn
reuses every full block of the one before; after ``turns`` turns the client
starts a new session. The host tier is sized to a third of the live working
set (every client's transcript at its longest, plus the shared prompt), the
engine's pool to what ``max_batch`` running requests need, so blocks keep
moving between pool, host and disk.

Measured: every request's TTFT at the client (sent → first server-sent
event), its prompt and cached tokens (``stream_options.include_usage``) and
whether it ended cleanly (``[DONE]`` after a finish; anything else is an
error, with its text); every ``sample_s`` the server's RSS (``/proc``) and
``/stats``' pinned blocks. After ``warmup_fraction`` of the run (and not before the host
tier is full: its slab's pages are touched as slots are first used), RSS and
the floor of pinned blocks (each window's least: a leak raises it, load
does not) must stay within 5% of where they were. When the clients stop, the
pinned count must come back to 0.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.bench import results
from kvtier.bench.client import stream_completion
from kvtier.bench.fleet import Proc
from kvtier.bench.peer.machine import describe
from kvtier.bench.soak import kv_bytes_per_token, serving, text_ids, wait

GROWTH_LIMIT = 0.05
FORMAT = 1


@dataclass(frozen=True)
class LoadSpec:
    clients: int = 64
    minutes: float = 10.0
    requests: int | None = None  # stop after this many requests in all (a short run), else at ``minutes``
    shared_tokens: int = 128  # the system prompt every session starts with
    turn_tokens: int = 48  # what each turn adds to the transcript (tool output and the agent's last reply)
    turns: int = 8  # turns per session; then the client starts a new one
    max_tokens: int = 2  # small: 64 clients on a 135M model on two cores must make progress
    capacity_ratio: float = 3.0  # live working set / host capacity
    max_batch: int = 16  # the engine's (its default)
    block_size: int = 16
    window_s: float = 30.0
    sample_s: float = 2.0
    warmup_fraction: float = 0.2

    @property
    def longest_prompt(self) -> int:
        return self.shared_tokens + self.turns * self.turn_tokens

    @property
    def working_set_tokens(self) -> int:
        """Tokens of KV live at once: every client's transcript at its longest, the shared prompt once."""
        return self.shared_tokens + self.clients * self.turns * self.turn_tokens

    def sections(self) -> dict[str, Any]:
        """The server's config: host a third of the working set, a pool for the running batch, disk for the rest."""
        kv = kv_bytes_per_token()  # tiers sized in tokens: the engine's dtype on this machine
        ws = self.working_set_tokens * kv
        running = self.max_batch * (self.longest_prompt + self.max_tokens + self.block_size) * kv
        return {
            "cache": {"block_size": self.block_size},
            "host": {"capacity_bytes": int(ws / self.capacity_ratio)},
            "disk": {"capacity_bytes": 2 * ws},
            "engine": {"pool_bytes": int(1.25 * running), "max_batch": self.max_batch},
            "server": {"max_tokens_limit": max(16, self.max_tokens)},
        }


@dataclass
class Sample:
    """One request, as its client saw it."""

    client: int
    ended_s: float  # since the run began
    ttft_s: float | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


@dataclass
class Probe:
    """One look at the server process."""

    at_s: float
    rss_bytes: int
    pinned_blocks: int
    host_full: bool = False  # the host tier's slots all used: its memory is all touched, RSS stops climbing with it


class Agents:
    """The prompts of every client's sessions: token ids of real text, each session its own slice."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        own = spec.turns * spec.turn_tokens
        ids = text_ids(spec.shared_tokens + own + 4099, offset=17)  # one tokenizer load: seconds on two cores
        self._shared, self._pool = ids[: spec.shared_tokens], ids[spec.shared_tokens :]
        self._span = len(self._pool) - own

    def prompt(self, client: int, session: int, turn: int) -> list[int]:
        """Turn ``turn`` of a session: the shared prompt, then the transcript so far (it only grows)."""
        start = (client * 7919 + session * 104_729) % self._span
        # The first own token names the session, so no two sessions share a block past the shared prompt.
        head = [10_000 + (client * 1_009 + session * 31) % 30_000]
        transcript = head + self._pool[start : start + (turn + 1) * self.spec.turn_tokens - 1]
        return self._shared + transcript


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Run:
    """The clients and the sampler of one load run; ``samples`` and ``probes`` are appended as they happen."""

    def __init__(self, spec: LoadSpec, server: Proc) -> None:
        self.spec = spec
        self.server = server
        self.agents = Agents(spec)
        self.samples: list[Sample] = []
        self.probes: list[Probe] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._all_done = threading.Event()  # set by the last client to finish
        self._started = 0.0
        self._issued = 0
        self._running = 0

    def _now(self) -> float:
        return time.perf_counter() - self._started

    def _take_turn(self) -> bool:
        """Whether another request may start (the request budget, when there is one, is shared)."""
        with self._lock:
            if self._stop.is_set() or (self.spec.requests is not None and self._issued >= self.spec.requests):
                return False
            self._issued += 1
            return True

    def _client(self, c: int) -> None:
        try:
            self._turns(c)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._all_done.set()

    def _turns(self, c: int) -> None:
        session, turn = 0, 0
        while self._take_turn():
            prompt = self.agents.prompt(c, session, turn)
            got = stream_completion(self.server.port, prompt, self.spec.max_tokens, timeout=600)
            ttft, usage, error = got.ttft_s, got.usage, got.error
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            sample = Sample(c, self._now(), ttft, usage.get("prompt_tokens", len(prompt)), cached, error)
            with self._lock:
                self.samples.append(sample)
            turn += 1
            if turn == self.spec.turns:
                session, turn = session + 1, 0

    def _probe(self) -> None:
        stats = self.server.stats()
        host = stats["tiers"]["host"]
        full = host["used_bytes"] >= host["capacity_bytes"]
        probe = Probe(self._now(), _rss_bytes(self.server.process.pid), stats["pinned_blocks"], full)
        with self._lock:
            self.probes.append(probe)

    def _sampler(self) -> None:
        while not self._stop.wait(self.spec.sample_s):  # a period, not a wait for an event
            self._probe()

    def go(self, progress: Callable[[float, int], None] | None = None) -> float:
        """Run the clients to the deadline (each ends the request it is in) or the request budget; seconds taken."""
        self._started = time.perf_counter()
        self._probe()
        self._running = self.spec.clients
        clients = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(self.spec.clients)]
        sampler = threading.Thread(target=self._sampler, daemon=True)
        for t in [*clients, sampler]:
            t.start()
        deadline = self.spec.minutes * 60
        while not self._all_done.wait(max(0.1, min(self.spec.window_s, deadline - self._now()))):
            if self._now() >= deadline:
                self._stop.set()  # each client ends the request it is in, then stops
            elif progress is not None:
                progress(self._now(), len(self.samples))
        wall = self._now()
        self._stop.set()
        for t in [*clients, sampler]:
            t.join()
        self._probe()
        return wall


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _growth(first: float, last: float) -> float:
    """Relative growth from ``first`` to ``last``; from 0, any growth counts as growth of ``last`` over 1."""
    return (last - first) / max(first, 1.0)


def series(samples: list[Sample], probes: list[Probe], window_s: float, wall_s: float) -> list[dict[str, Any]]:
    """Per window: requests, errors, TTFT p99, hit rate (cached / prompt tokens), RSS (median), pinned (min, max)."""
    out = []
    n = max(1, int(-(-wall_s // window_s)))
    for w in range(n):
        lo, hi = w * window_s, min((w + 1) * window_s, wall_s)
        mine = [s for s in samples if lo <= s.ended_s < hi]
        seen = [p for p in probes if lo <= p.at_s < hi]
        prompt = sum(s.prompt_tokens for s in mine if s.error is None)
        out.append(
            {
                "t_s": hi,  # the window's end
                "requests": len(mine),
                "errors": sum(s.error is not None for s in mine),
                "ttft_p99_s": _quantile([s.ttft_s for s in mine if s.ttft_s is not None], 0.99),
                "hit_rate": (sum(s.cached_tokens for s in mine if s.error is None) / prompt) if prompt else None,
                "rss_bytes": int(statistics.median(p.rss_bytes for p in seen)) if seen else None,
                "pinned_min": min((p.pinned_blocks for p in seen), default=None),
                "pinned_max": max((p.pinned_blocks for p in seen), default=None),
            }
        )
    return out


def window_for(spec: LoadSpec, wall_s: float) -> float:
    """``spec.window_s``, or shorter for a short run, so that it still has ten windows."""
    return min(spec.window_s, max(wall_s / 10, spec.sample_s))


def summarize(spec: LoadSpec, samples: list[Sample], probes: list[Probe], wall_s: float) -> dict[str, Any]:
    """The figures and verdicts of one run, every one computed from ``samples`` and ``probes``."""
    full = next((p.at_s for p in probes if p.host_full), None)
    warm_s = max(spec.warmup_fraction * wall_s, full or 0.0)  # and not before host memory is all in use
    after = [s for s in samples if s.ended_s >= warm_s]
    ttfts = [s.ttft_s for s in after if s.ttft_s is not None]
    window_s = window_for(spec, wall_s)
    windows = series(samples, probes, window_s, wall_s)
    steady = [w for i, w in enumerate(windows) if i * window_s >= warm_s and w["rss_bytes"] is not None]
    under_load = [p for p in probes if warm_s <= p.at_s <= wall_s]
    rss_first = steady[0]["rss_bytes"] if steady else (under_load[0].rss_bytes if under_load else 0)
    rss_last = steady[-1]["rss_bytes"] if steady else (under_load[-1].rss_bytes if under_load else 0)
    floor_first = steady[0]["pinned_min"] if steady else 0
    floor_last = steady[-1]["pinned_min"] if steady else 0
    prompt = sum(s.prompt_tokens for s in after if s.error is None)
    errors = [s.error for s in samples if s.error is not None]
    summary = {
        "requests": len(samples),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "wall_s": wall_s,
        "warmup_s": warm_s,
        "host_full_s": full,
        "window_s": window_s,
        "requests_per_s": len(after) / max(wall_s - warm_s, 1e-9),
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p99_s": _quantile(ttfts, 0.99),
        "hit_rate": sum(s.cached_tokens for s in after if s.error is None) / prompt if prompt else None,
        "rss_after_warmup_bytes": rss_first,
        "rss_end_bytes": rss_last,
        "rss_growth": _growth(rss_first, rss_last),
        "pinned_floor_after_warmup": floor_first,
        "pinned_floor_end": floor_last,
        "pinned_floor_growth": _growth(floor_first or 0, floor_last or 0),
        "pinned_max": max((p.pinned_blocks for p in probes), default=0),
        "pinned_idle": probes[-1].pinned_blocks if probes else None,
    }
    summary["checks"] = {
        "no_errors": summary["errors"] == 0,
        "rss_flat": summary["rss_growth"] < GROWTH_LIMIT,
        "pinned_flat": summary["pinned_floor_growth"] < GROWTH_LIMIT,
        "pinned_idle_zero": summary["pinned_idle"] == 0,
    }
    return {"summary": summary, "series": windows}


def run(spec: LoadSpec, progress: Callable[[float, int], None] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvtier-load-") as tmp, serving(None, Path(tmp), spec.sections()) as server:
        load = Run(spec, server)
        wall = load.go(progress)
        wait(server, lambda s: s["engine"]["in_flight"] == 0)
        load._probe()  # the idle look: every client done, nothing in flight
        final = server.stats()
    out = summarize(spec, load.samples, load.probes, wall)
    out["setup"] = {
        "format": FORMAT,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": describe(),
        **asdict(spec),
        "working_set_bytes": spec.working_set_tokens * kv_bytes_per_token(),
        "kv_bytes_per_token": kv_bytes_per_token(),
        "config": spec.sections(),
    }
    out["stats_end"] = {k: final[k] for k in ("tiers", "engine", "pinned_blocks") if k in final}
    out["samples"] = [asdict(x) for x in load.samples]  # the raw data every figure above is computed from
    out["probes"] = [asdict(x) for x in load.probes]
    return out


def recompute(result: dict[str, Any]) -> dict[str, Any]:
    """The summary and series again, from a result's own raw samples and probes (for checking a JSON)."""
    spec = LoadSpec(**{k: result["setup"][k] for k in LoadSpec.__dataclass_fields__})
    samples = [Sample(**x) for x in result["samples"]]
    probes = [Probe(**x) for x in result["probes"]]
    return summarize(spec, samples, probes, result["summary"]["wall_s"])


def table(result: dict[str, Any]) -> str:
    s, setup = result["summary"], result["setup"]

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    lines = [
        f"kvtier bench load, {setup['date']}: {setup['clients']} streaming clients, {s['wall_s'] / 60:.1f} min, "
        f"working set {setup['working_set_bytes'] / 2**20:.0f} MiB = {setup['capacity_ratio']:g}x host",
        f"  {s['requests']} requests, {s['errors']} errors, {s['requests_per_s']:.2f} req/s after warm-up; "
        f"TTFT p50 {secs(s['ttft_p50_s'])}, p99 {secs(s['ttft_p99_s'])}; hit rate "
        + ("-" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}"),
        f"  RSS {s['rss_after_warmup_bytes'] / 2**20:.0f} -> {s['rss_end_bytes'] / 2**20:.0f} MiB "
        f"({s['rss_growth']:+.1%}); pinned floor {s['pinned_floor_after_warmup']} -> {s['pinned_floor_end']}, "
        f"max {s['pinned_max']}, idle {s['pinned_idle']}",
    ]
    lines += [f"  {name}: {'pass' if ok else 'MISS'}" for name, ok in s["checks"].items()]
    return "\n".join(lines)


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    path = results.write(result, out_dir, "load")
    plt = results.pyplot()
    if plt is None:
        return path, None
    windows = result["series"]
    t = [w["t_s"] / 60 for w in windows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    panels = [
        ("RSS (MiB)", [None if w["rss_bytes"] is None else w["rss_bytes"] / 2**20 for w in windows], "#555"),
        ("hit rate (cached / prompt tokens)", [w["hit_rate"] for w in windows], "#2a7"),
        ("TTFT p99 (s)", [w["ttft_p99_s"] for w in windows], "#27a"),
    ]
    warm = result["summary"]["warmup_s"] / 60
    for ax, (label, ys, color) in zip(axes, panels, strict=True):
        ax.plot(t, [float("nan") if y is None else y for y in ys], marker="o", color=color)
        ax.axvspan(0, warm, color="#ddd", label="warm-up")
        ax.set_ylabel(label)
    axes[0].legend(loc="lower right")
    axes[-1].set_xlabel(f"minutes (each point: the {result['summary']['window_s']:.0f} s window ending there)")
    setup = result["setup"]
    fig.suptitle(
        f"kvtier bench load, {setup['date']}: {setup['clients']} streaming clients, working set "
        f"{setup['capacity_ratio']:g}x host\n{setup['machine'].get('cpu', '')} ({', '.join(setup['machine']['isa'])})",
        fontsize=10,
    )
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    (out_dir / "load-latest.png").write_bytes(png.read_bytes())
    return path, png
