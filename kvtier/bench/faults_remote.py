"""The remote tier's fault: the shared Redis killed (SIGKILL) while a node is loading from it.

The promise: a remote that goes away costs misses, never an error and
never a stall. Every lookup in flight or after is answered (local hits
still hit; what only the remote held is recomputed), no byte served is
wrong, and after a few failed calls the node's circuit breaker opens and
stops calling the dead server at all: the calls it made after the kill
are bounded by the breaker's threshold (plus the readers in flight), not by
the load.

Two real managers (two nodes: separate data directories, one shared secret
file) and a real ``redis-server`` on loopback, stopped by its PID.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kvtier.bench.faultkit import GUARD_S, Threads, kv, serve, tokens, toy_cache, toy_config
from kvtier.bench.faults import Fault, FaultOutcome, FaultSkipped, fault
from kvtier.bench.redis_server import RedisServer, RedisStartError
from kvtier.config import Config
from kvtier.manager import CacheManager

PROMPTS = 16
BLOCKS = 2
READERS = 2
PASSES_AFTER_KILL = 2
BREAKER_FAILURES = 2


def node_config(workdir: Path, name: str, url: str) -> Config:
    """A node: host memory for half the prompts (so the rest must come from the remote), no disk tier."""
    cfg = toy_config(workdir / name, host_blocks=PROMPTS * BLOCKS // 2)
    tree = cfg.model_dump()
    tree["cache"]["secret_file"] = workdir / "deployment.secret"  # one key space for both nodes
    tree["remote"].update(
        enabled=True, urls=[url], timeout_ms=500, breaker_failures=BREAKER_FAILURES, breaker_retry_s=600
    )
    return Config.model_validate(tree)


def _remote_calls(cache: CacheManager) -> int:
    """Calls the node let go out to the remote and saw fail (errors), the ones it skipped are not calls."""
    assert cache.remote is not None
    return int(cache.remote.stats.errors)


@fault(Fault.REMOTE_DOWN)
def remote_down(workdir: Path) -> FaultOutcome:
    """Node A stores 16 prompts in Redis; node B's readers load them in passes; Redis is killed after one pass."""
    try:
        redis = RedisServer.start()
    except RedisStartError as err:
        raise FaultSkipped(str(err)) from None
    with redis:
        with toy_cache(node_config(workdir, "a", redis.url)) as a:
            for p in range(PROMPTS):
                a.store(a.keyed(tokens(p, BLOCKS)), kv(p, BLOCKS))
            assert a.remote is not None and a.remote.flush()
        with toy_cache(node_config(workdir, "b", redis.url)) as b:
            warmed = [threading.Event() for _ in range(READERS)]  # each reader's first pass done
            killed = threading.Event()
            before = [[0, 0] for _ in range(READERS)]  # [blocks served, wrong] per reader, before / after the kill
            after = [[0, 0, 0] for _ in range(READERS)]  # ... and lookups answered after

            def reader(r: int) -> None:
                for p in range(r, PROMPTS, READERS):
                    got = serve(b, p, BLOCKS)
                    before[r][0] += got.blocks
                    before[r][1] += got.wrong
                warmed[r].set()
                killed.wait()
                for _ in range(PASSES_AFTER_KILL):
                    for p in range(r, PROMPTS, READERS):
                        got = serve(b, p, BLOCKS)
                        after[r][0] += got.blocks
                        after[r][1] += got.wrong
                        after[r][2] += 1

            readers = Threads([lambda r=r: reader(r) for r in range(READERS)]).start()
            try:
                for first_pass in warmed:
                    first_pass.wait(GUARD_S)
                errors_at_kill = _remote_calls(b)
                redis.kill()
            finally:
                killed.set()
                readers.join()
            assert b.remote is not None
            snap = b.remote.snapshot()
            errors_after = _remote_calls(b) - errors_at_kill
            local = sum(b.lookup(b.keyed(tokens(p, BLOCKS))).cached_blocks > 0 for p in range(PROMPTS))
    answered = sum(a[2] for a in after)
    wrong = sum(x[1] for x in before) + sum(x[1] for x in after)
    figures = {
        "served_before_kill": sum(x[0] for x in before),
        "lookups_after_kill": answered,
        "served_after_kill": sum(x[0] for x in after),
        "remote_errors_after_kill": errors_after,
        "remote_calls_skipped": int(snap.skipped),
        "breaker_opens": int(snap.breaker_opens),
        "prompts_still_local": local,
    }
    held = (
        figures["served_before_kill"] == PROMPTS * BLOCKS
        and answered == PASSES_AFTER_KILL * PROMPTS
        and figures["breaker_opens"] == 1
        and 1 <= errors_after <= BREAKER_FAILURES + READERS
        and wrong == 0
    )
    return FaultOutcome(
        Fault.REMOTE_DOWN,
        injected=f"redis-server SIGKILLed while {READERS} reader threads of a second node loaded {PROMPTS} prompts",
        outcome=(
            f"every lookup answered ({figures['served_after_kill']} blocks from host memory after the kill, the "
            f"rest recomputed); {errors_after} failed calls opened the breaker, then "
            f"{figures['remote_calls_skipped']} calls were skipped instead of made"
        ),
        held=held,
        wrong_bytes_served=wrong,
        figures=figures,
    )


__all__ = ["remote_down"]
