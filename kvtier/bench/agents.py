"""`kvtier bench agents`: interleaved agent sessions with tool-call pauses, sessions + prefetch vs plain LRU.

(a) ``sessions``: ``agents`` agents, each with its own long transcript
(real text, no prefix shared between agents), take turns round-robin; each
turn resends the whole transcript plus ``turn_tokens`` of new tool output.
Between two turns of one agent every other agent speaks once: that is its
tool-call pause. The host tier holds ``host_agents`` transcripts, fewer than
there are agents. By default the engine caches in its pool and host memory
only (a GPU server's shape: HBM and pinned host memory), so under plain LRU
each agent's transcript is evicted just before its next turn and recomputed;
``disk`` adds a disk tier that holds every transcript (then LRU's later
turns are disk hits, and what sessions save is the disk read). Two servers,
same config except the session features, see the same stream from one
client:

* ``lru``: ``session.enabled: false``; requests carry no session.
* ``sessions``: requests carry ``X-Session-ID``; the live sessions that fit
  in ``session.max_protected_share`` are protected in host memory (the
  oldest ones: :mod:`kvtier.sessions` says why), and when an agent's tool
  call starts returning (here: as the agent before it starts its turn) the
  agent calls ``POST /v1/sessions/{id}/prefetch``, which moves what of its
  transcript is on a lower tier up to host during the pause.

Measured at the client: TTFT of every turn after each agent's first (the
first is a cold prefill in both runs). ``sessions_speedup`` is the ratio of
the two runs' total TTFT (medians are reported beside it), taken in one
invocation on one machine, whose ISA is recorded.

(b) ``spec``: prompt-lookup decoding's figures from
:func:`kvtier.bench.spec.run_spec`, included as it reports them.
"""

from __future__ import annotations

import http.client
import json
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
from kvtier.bench.soak import kv_bytes_per_token, serving, text_ids
from kvtier.bench.warm import WarmSpec, run_warm

FORMAT = 1


@dataclass(frozen=True)
class AgentsSpec:
    agents: int = 8
    transcript_tokens: int = 1024  # each agent's transcript before its first turn
    turn_tokens: int = 48  # tool output each turn adds
    turns: int = 6  # turns per agent
    host_agents: float = 6.0  # transcripts (at their longest) the host tier holds
    max_tokens: int = 2
    block_size: int = 16
    reps: int = 2  # lru, sessions, lru, sessions, ...: a load change on a shared machine hits both
    disk: bool = False  # a disk tier under host that holds every transcript
    disk_io: str = "buffered"  # disk.io for both runs; "direct": a disk tier the page cache does not hold
    spec: bool = True  # include prompt-lookup decoding's run_spec (half b)
    warm: bool = True  # include the next turn warmed while a tool runs (part c, kvtier.bench.warm)

    @property
    def longest(self) -> int:
        return self.transcript_tokens + self.turns * self.turn_tokens

    def sections(self, sessions: bool) -> dict[str, Any]:
        """Both runs' config, apart from ``session.enabled``: host below the agents, a pool for one request."""
        pool_tokens = 2 * (self.longest + self.max_tokens + self.block_size)
        kv = kv_bytes_per_token()  # tiers sized in tokens: the engine's dtype on this machine
        disk = {"capacity_bytes": 4 * self.agents * self.longest * kv, "io": self.disk_io}
        return {
            "cache": {"block_size": self.block_size},
            "host": {"capacity_bytes": int(self.host_agents * self.longest * kv)},
            "disk": disk if self.disk else {"enabled": False},
            "engine": {"pool_bytes": pool_tokens * kv},
            "session": {"enabled": sessions},
        }


class Stream:
    """Every agent's transcript at every turn: the same token ids for both runs."""

    def __init__(self, spec: AgentsSpec) -> None:
        per_agent = spec.longest
        ids = text_ids(spec.agents * per_agent)
        self.spec = spec
        self._agent = [ids[a * per_agent : (a + 1) * per_agent] for a in range(spec.agents)]

    def prompt(self, agent: int, turn: int) -> list[int]:
        return self._agent[agent][: self.spec.transcript_tokens + turn * self.spec.turn_tokens]

    def order(self) -> list[tuple[int, int]]:
        """(agent, turn) in the order sent: round-robin, so each agent's pause is every other agent's turn."""
        return [(a, t) for t in range(self.spec.turns) for a in range(self.spec.agents)]


def _post(port: int, path: str, body: dict[str, Any] | None, headers: dict[str, str]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", path, json.dumps(body or {}), {"Content-Type": "application/json", **headers})
    return conn.getresponse()


def ttft(port: int, prompt: list[int], max_tokens: int, session: str | None) -> tuple[float, int]:
    """Seconds to the first streamed event, and the cached tokens the usage chunk reports."""
    headers = {} if session is None else {"X-Session-ID": session}
    got = stream_completion(port, prompt, max_tokens, headers).checked()
    assert got.ttft_s is not None
    return got.ttft_s, got.cached_tokens


def prefetch(port: int, session: str) -> dict[str, Any]:
    response = _post(port, f"/v1/sessions/{session}/prefetch", None, {})
    body = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"prefetch HTTP {response.status}: {body}")
    return body


@dataclass
class Turn:
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


def drive(server: Proc, stream: Stream, sessions: bool) -> list[Turn]:
    """Send the stream in order; with ``sessions``, the next agent prefetches while the current one's turn runs."""
    spec = stream.spec
    order = stream.order()
    out: list[Turn] = []
    for i, (agent, turn) in enumerate(order):
        helper = None
        nxt = order[i + 1] if i + 1 < len(order) else None
        if sessions and nxt is not None and nxt[1] > 0:  # its tool call is returning
            helper = threading.Thread(target=prefetch, args=(server.port, f"agent-{nxt[0]}"))
            helper.start()
        prompt = stream.prompt(agent, turn)
        seconds, cached = ttft(server.port, prompt, spec.max_tokens, f"agent-{agent}" if sessions else None)
        out.append(Turn(agent, turn, len(prompt), cached, seconds))
        if helper is not None:
            helper.join()
    return out


def _run(spec: AgentsSpec, stream: Stream, sessions: bool) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-agents-") as tmp,
        serving(None, Path(tmp), spec.sections(sessions)) as server,
    ):
        turns = drive(server, stream, sessions)
        stats = server.stats()
    later = [t for t in turns if t.turn > 0]
    return {
        "total_ttft_s": sum(t.ttft_s for t in later),
        "median_ttft_s": statistics.median(t.ttft_s for t in later),
        "cached_share": sum(t.cached_tokens for t in later) / sum(t.prompt_tokens for t in later),
        "host_hit_tokens": stats["tiers"]["host"]["hit_tokens"],
        "disk_hit_tokens": stats["tiers"].get("disk", {}).get("hit_tokens", 0),
        "sessions": (stats.get("sessions") or {}).get("live"),
        "turns": [asdict(t) for t in turns],
    }


def run_sessions(spec: AgentsSpec, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Half (a): the same stream against plain LRU and against sessions + prefetch, alternating, ``reps`` each.

    Each side's figure is its median over reps (of total TTFT, and of each
    rep's median TTFT); the speedups are the ratios of those medians.
    """
    stream = Stream(spec)
    runs: dict[str, list[dict[str, Any]]] = {"lru": [], "sessions": []}
    for rep in range(spec.reps):
        for name, on in (("lru", False), ("sessions", True)):
            if progress is not None:
                progress(f"{name} {rep + 1}/{spec.reps}")
            runs[name].append(_run(spec, stream, on))
    out: dict[str, Any] = {name: _merge(rs) for name, rs in runs.items()}
    out["sessions_speedup"] = out["lru"]["total_ttft_s"] / out["sessions"]["total_ttft_s"]
    out["median_speedup"] = out["lru"]["median_ttft_s"] / out["sessions"]["median_ttft_s"]
    return out


def _merge(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures: medians over its reps, each rep's totals kept, the last rep's turns for the plot."""
    merged = {k: statistics.median(r[k] for r in reps) for k in ("total_ttft_s", "median_ttft_s", "cached_share")}
    merged["total_ttft_s_by_rep"] = [r["total_ttft_s"] for r in reps]
    merged |= {k: reps[-1][k] for k in ("host_hit_tokens", "disk_hit_tokens", "sessions", "turns")}
    return merged


def run_spec_half() -> dict[str, Any]:
    """Half (b), from the prompt-lookup module when it is on this checkout; otherwise the gap, said plainly."""
    try:
        from kvtier.bench.spec import run_spec
    except ImportError as err:
        return {"missing": f"kvtier.bench.spec is not in this checkout ({err})"}
    return run_spec()


def run(spec: AgentsSpec, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    machine = describe()
    setup = {
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine,
        "kv_bytes_per_token": kv_bytes_per_token(),
        **asdict(spec),
    }
    result: dict[str, Any] = {"format": FORMAT, "setup": setup, **run_sessions(spec, progress)}
    if spec.spec:
        if progress is not None:
            progress("spec")
        result["spec"] = run_spec_half()
    if spec.warm:
        result["warm"] = run_warm(WarmSpec(), time.sleep, progress)  # the pause is the tool's run, simulated
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What ``--json`` prints: the figures, without per-turn samples."""
    out = {k: v for k, v in result.items() if k not in ("lru", "sessions")}
    for name in ("lru", "sessions"):
        out[name] = {k: v for k, v in result[name].items() if k != "turns"}
    out["isa"] = result["setup"]["machine"].get("isa")
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"kvtier bench agents, {result['setup']['date']} ({', '.join(result['setup']['machine']['isa'])})"]
    for name in ("lru", "sessions"):
        r = result[name]
        lines.append(
            f"  {name:9s} total TTFT {r['total_ttft_s']:.2f} s, median {r['median_ttft_s']:.3f} s, "
            f"cached {r['cached_share']:.0%} of prompt tokens"
        )
    lines.append(f"  sessions_speedup {result['sessions_speedup']:.2f}x (target 1.5x)")
    spec = result.get("spec")
    if spec is not None:
        lines.append(f"  spec: {json.dumps({k: v for k, v in spec.items() if not isinstance(v, list)})}")
    warm = result.get("warm")
    if warm is not None:
        later, ratio = warm["later_turn_ttft_s"], warm["concurrent_ttft_ratio"]
        lines.append(
            f"  warm: later turns {later['plain']:.3f} s -> {later['warm']:.3f} s, {warm['warm_speedup']:.2f}x "
            f"(target 2x); arrival during a warm {'n/a' if ratio is None else f'{ratio:.3f}x'} (target <= 1.1); "
            f"same output {warm['same_output']}"
        )
    return "\n".join(lines)


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    path = results.write(result, out_dir, "agents")
    plt = results.pyplot()
    if plt is None:
        return path, None
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, color in (("lru", "#888"), ("sessions", "#2a7")):
        later = [t["ttft_s"] for t in result[name]["turns"] if t["turn"] > 0]
        ax.plot(range(1, len(later) + 1), later, marker="o", ms=3, color=color, label=name)
    ax.set_xlabel("turn (after each agent's first), in the order sent")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(
        f"{result['setup']['agents']} agents, host holds {result['setup']['host_agents']}: "
        f"sessions + prefetch {result['sessions_speedup']:.2f}x"
    )
    ax.legend()
    fig.tight_layout()
    png = path.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    (out_dir / "agents-latest.png").write_bytes(png.read_bytes())
    return path, png
