"""`kvtier bench chaos`: kill -9 a real cache at random points, restart it, and check what it promised.

The promise checked (:mod:`kvtier.tiers.disk`): a block is acknowledged once
its disk record is committed, and from then on it survives any crash until
kvtier itself evicts it; nothing read back is ever another block's bytes. So
the driver keeps, from the worker's reports (:mod:`kvtier.bench.chaos_worker`):

* every key's one possible content digest (reported before the store);
* the *durable* set: keys whose disk commit was reported, minus keys the disk
  policy handed out as victims (announced before their removal commits: an
  evicted block is not a lost one).

At every open the worker reads back all that the index names. A durable key
missing there, or failing its read, is a **lost acknowledged block**; a
digest that differs from the key's content, there or in any block a fetch
served, is a **wrong block served** (counted in bytes). The open's time is
``restart_s``. The kill schedule (after how many reports each worker dies,
and each worker's operations, write mode and fsync mode) is drawn from one
seeded RNG: the same seed gives the same schedule; where exactly in the code
a kill lands depends on timing, which is the point.

Workers on the remote surface also write to and promote from one real
``redis-server`` that the driver keeps for the whole loop, and in a quarter
of their lives the driver SIGKILLs that server too, at a random report, and
starts it again (empty, as a cache's Redis runs) after the worker's kill:
a worker that meets a dead remote must answer every operation regardless
(an exception is a worker failure), and whatever the remote serves is
checked like any other block.

Then every fault registered in :mod:`kvtier.bench.faults` (each
``kvtier.bench.faults_*`` module registers its own on import) runs in a
directory of its own; a fault that raises is reported as not held, with its
error, and the run goes on.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pkgutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec
import numpy as np
from tqdm import tqdm

from kvtier.bench import chaos_worker as w
from kvtier.bench import results
from kvtier.bench.faults import FAULTS, Fault, FaultOutcome, FaultSkipped
from kvtier.bench.redis_server import RedisServer
from kvtier.config import FsyncMode, WriteMode

DEFAULT_KILLS = 200
MAX_EVENTS = 40  # a worker is killed after 1..MAX_EVENTS reports; 1 lands in its open and recovery
REDIS_KILL_SHARE = 0.25  # of remote lives, those that kill the redis-server too (it restarts empty)


@dataclass
class Ledger:
    """What the driver knows the cache promised, and how often it kept its word."""

    contents: dict[str, str] = field(default_factory=dict)  # key -> the only digest it may carry
    durable: set[str] = field(default_factory=set)
    acknowledged_blocks_checked: int = 0
    served_blocks_checked: int = 0
    served_from_remote: int = 0
    redis_kills: int = 0
    wrong_blocks: int = 0
    lost: int = 0
    restarts: list[float] = field(default_factory=list)
    slabs_left: int = 0  # shared-memory slabs of killed cache services still on disk at the end
    failures: list[str] = field(default_factory=list)
    present: dict[str, str | None] = field(default_factory=dict)  # this open's read-back, until Ready
    kill_points: Counter[str] = field(default_factory=Counter)  # the report each kill followed: where it landed

    def hear(self, report: w.Report) -> None:
        """Fold one report into the ledger."""
        if isinstance(report, w.Intent):
            self.contents.update(report.blocks)
        elif isinstance(report, w.Durable):
            self.durable.update(report.keys)
        elif isinstance(report, w.Evicting):
            self.durable.difference_update(report.keys)
        elif isinstance(report, w.ServedBlocks):
            self.served_blocks_checked += len(report.blocks)
            self.served_from_remote += report.from_remote
            self.wrong_blocks += sum(self.contents.get(k) != d for k, d in report.blocks)
        elif isinstance(report, w.Present):
            self.present.update(report.blocks)
        elif isinstance(report, w.Ready):
            self.reopened(report)
        elif isinstance(report, w.Failed):
            self.failures.append(report.error)

    def reopened(self, ready: w.Ready) -> None:
        """Check an open's read-back against the durable set, then start again from what is on disk."""
        good = {k for k, d in self.present.items() if d is not None}
        self.wrong_blocks += sum(d is not None and self.contents.get(k) != d for k, d in self.present.items())
        self.lost += len(self.durable - good)
        self.acknowledged_blocks_checked += len(self.durable)
        self.durable = good
        self.present = {}
        self.restarts.append(ready.restart_s)


class Zygote:
    """The forking worker process (``python -m kvtier.bench.chaos_worker``), spoken to over its pipes."""

    def __init__(self, data_dir: Path, log: IO[bytes]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.bench.chaos_worker", str(data_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )

    def send(self, command: w.Command) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(w.ENCODER.encode(command) + b"\n")
        self.proc.stdin.flush()

    def reports(self) -> Iterator[w.Report]:
        """Reports in order; a line cut short by a kill (never expected: lines fit one write) is skipped."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                yield w.REPORTS.decode(line)
            except msgspec.DecodeError:
                continue
        raise RuntimeError(f"the chaos zygote exited ({self.proc.wait()})")

    def close(self) -> None:
        self.send(w.Quit())
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


@dataclass(frozen=True)
class Incarnation:
    """One worker's life, drawn from the run's RNG: its operations' seed, modes, and when it dies."""

    start: w.Start
    kill_after: int | None  # reports before the kill; None: killed once it has opened and been checked
    redis_kill_after: int | None = None  # reports before the remote's redis-server is killed too; None: it lives


def schedule(
    seed: int, kills: int, remote_url: str, surfaces: Sequence[w.Surface] = tuple(w.Surface)
) -> list[Incarnation]:
    rng = np.random.default_rng(seed)
    lives = []
    for _ in range(kills):
        surface = surfaces[int(rng.integers(len(surfaces)))]
        mode = [WriteMode.WRITE_THROUGH, WriteMode.WRITE_BACK][int(rng.integers(2))]
        fsync = [FsyncMode.BATCH, FsyncMode.ALWAYS, FsyncMode.NEVER][int(rng.integers(3))]
        url = remote_url if surface is w.Surface.REMOTE else None
        start = w.Start(int(rng.integers(2**31)), surface, mode, fsync, url)
        kill_after = int(rng.integers(1, MAX_EVENTS + 1))
        redis_kill_after = int(rng.integers(1, kill_after + 1)) if url and rng.random() < REDIS_KILL_SHARE else None
        lives.append(Incarnation(start, kill_after, redis_kill_after))
    lives.append(
        Incarnation(w.Start(0, w.Surface.EMBEDDED, WriteMode.WRITE_THROUGH, FsyncMode.BATCH), None)
    )  # the final check
    return lives


def live(zygote: Zygote, life: Incarnation, ledger: Ledger, stream: Iterator[w.Report], redis: RedisServer) -> None:
    """Start one worker, kill it by pid after its ``kill_after``-th report, and fold in all it said.

    If the life kills the remote too, its redis-server dies at that report
    and is started again only after the worker is gone.
    """
    zygote.send(life.start)
    forked = next(stream)
    assert isinstance(forked, w.Forked), forked
    killed = False
    for heard, report in enumerate(stream, start=1):
        if isinstance(report, w.Exited):
            if life.redis_kill_after is not None:
                redis.restart()
            return
        ledger.hear(report)
        if heard == life.redis_kill_after:
            redis.kill()
            ledger.redis_kills += 1
        due = heard == life.kill_after or (life.kill_after is None and isinstance(report, w.Ready))
        if not killed and (due or isinstance(report, w.Failed)):
            os.kill(forked.pid, signal.SIGKILL)  # reaped only after this, so the pid is still the worker's
            zygote.send(w.Reap(forked.pid))
            killed = True
            if due and life.kill_after is not None:
                ledger.kill_points[report.__struct_config__.tag] += 1


def kill_loop(workdir: Path, kills: int, seed: int, progress: bool, surfaces: Sequence[w.Surface]) -> Ledger:
    ledger = Ledger()
    with open(workdir / "worker.log", "wb") as log, RedisServer.start(workdir=workdir / "redis") as redis:
        zygote = Zygote(workdir / "data", log)
        stream = zygote.reports()
        try:
            for life in tqdm(
                schedule(seed, kills, redis.url, surfaces), desc="chaos kills", disable=not progress, unit="kill"
            ):
                live(zygote, life, ledger, stream, redis)
        finally:
            zygote.close()
    ledger.slabs_left = len(list(w.slab_dir(workdir / "data").glob("*.slab")))
    return ledger


# -- the faults --------------------------------------------------------------------------------------------------
def load_faults() -> None:
    """Import every ``kvtier.bench.faults_*`` module: each registers its faults in :data:`FAULTS`."""
    import kvtier.bench as bench

    for info in pkgutil.iter_modules(bench.__path__):
        if info.name.startswith("faults_"):
            importlib.import_module(f"kvtier.bench.{info.name}")


def run_fault(kind: Fault, workdir: Path) -> dict[str, Any]:
    """One fault in its own directory; whatever it raises becomes a not-held entry, never the run's end."""
    where = workdir / kind.value
    where.mkdir()
    try:
        outcome = FAULTS[kind](where)
    except FaultSkipped as why:
        return {"fault": kind.value, "skipped": str(why), "held": None}
    except Exception as err:
        last = traceback.format_exception(err)[-2:]
        return {"fault": kind.value, "held": False, "error": f"{type(err).__name__}: {err}", "where": "".join(last)}
    return outcome_json(outcome)


def outcome_json(outcome: FaultOutcome) -> dict[str, Any]:
    out = asdict(outcome)
    out["fault"] = outcome.fault.value
    return out


def run_faults(workdir: Path, progress: bool) -> list[dict[str, Any]]:
    load_faults()
    kinds = [k for k in Fault if k in FAULTS]
    return [run_fault(k, workdir) for k in tqdm(kinds, desc="chaos faults", disable=not progress, unit="fault")]


# -- the run --------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summary(ledger: Ledger, kills: int) -> dict[str, Any]:
    return {
        "kills": kills,
        "acknowledged_blocks_checked": ledger.acknowledged_blocks_checked,
        "served_blocks_checked": ledger.served_blocks_checked,
        "served_from_remote": ledger.served_from_remote,
        "redis_kills": ledger.redis_kills,
        "wrong_bytes_served": ledger.wrong_blocks * w.LAYOUT.block_bytes,
        "lost_acknowledged_blocks": ledger.lost,
        "restart_s": {
            "p50": percentile(ledger.restarts, 50),
            "p99": percentile(ledger.restarts, 99),
            "opens": len(ledger.restarts),
        },
        "kills_after": dict(sorted(ledger.kill_points.items())),
        "service_slabs_left": ledger.slabs_left,
        "worker_failures": ledger.failures,
    }


def setup(kills: int, seed: int) -> dict[str, Any]:
    from kvtier.bench.peer.machine import describe

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": describe(),
        "kills": kills,
        "seed": seed,
        "layout": w.LAYOUT.descriptor,
        "host_blocks": w.HOST_BLOCKS,
        "disk_blocks": w.DISK_BLOCKS,
        "distinct_blocks": w.CONVERSATIONS * w.TURN_BLOCKS,
        "kill_after_reports": [1, MAX_EVENTS],
        "modes": "embedded manager, cache service + client, or embedded manager + remote tier on a redis-server "
        "(killed too in a quarter of those lives); write-through or write-back; fsync batch, always or never; "
        "drawn per worker",
    }


def run(
    kills: int = DEFAULT_KILLS,
    seed: int = 0,
    *,
    faults: bool = True,
    progress: bool = False,
    workdir: Path | None = None,
    surfaces: Sequence[w.Surface] = tuple(w.Surface),
) -> dict[str, Any]:
    """The kill loop, then every registered fault; one JSON-ready dict."""
    with tempfile.TemporaryDirectory(prefix="kvtier-chaos-") as tmp:
        started = time.perf_counter()
        ledger = kill_loop(Path(tmp), kills, seed, progress, surfaces)
        loop_s = time.perf_counter() - started
        entries = run_faults(Path(tmp), progress) if faults else []
    result = {"setup": setup(kills, seed), **summary(ledger, kills), "kill_loop_s": loop_s, "faults": entries}
    return {**result, "restarts": ledger.restarts}


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    path = results.write(result, out_dir, "chaos")
    return path, plot(result, path.with_suffix(".png"))


def plot(result: dict[str, Any], png: Path) -> Path | None:
    plt = results.pyplot()
    if plt is None or not result["restarts"]:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.hist([s * 1000 for s in result["restarts"]], bins=40)
    ax.set_xlabel("open + recovery, after a kill or a clean restart (ms)")
    ax.set_ylabel("opens")
    held = sum(f.get("held") is True for f in result["faults"])
    ax.set_title(
        f"kvtier bench chaos: {result['kills']} kills, {result['wrong_bytes_served']} wrong bytes, "
        f"{result['lost_acknowledged_blocks']} lost; faults held {held}/{len(result['faults'])}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return png


def table(result: dict[str, Any]) -> str:
    r = result["restart_s"]
    lines = [
        f"kills {result['kills']}: acknowledged blocks checked {result['acknowledged_blocks_checked']}, "
        f"served blocks checked {result['served_blocks_checked']} ({result['served_from_remote']} from Redis, "
        f"which was killed {result['redis_kills']} times)",
        f"  wrong bytes served {result['wrong_bytes_served']}, lost acknowledged blocks "
        f"{result['lost_acknowledged_blocks']}, restart p50 {r['p50'] * 1000:.1f} ms p99 {r['p99'] * 1000:.1f} ms",
    ]
    for f in result["faults"]:
        state = "skipped" if f["held"] is None else ("held" if f["held"] else "NOT HELD")
        lines.append(f"  {f['fault']}: {state}: {f.get('outcome') or f.get('error') or f.get('skipped')}")
    return "\n".join(lines)
