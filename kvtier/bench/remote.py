"""`kvtier bench remote`: the remote tier against raw Redis commands of the same bytes, and a cross-node hit.

Against its own throwaway redis-server on loopback unless given ``--url``.
Payload: SmolLM2-135M's float32 KV blocks (737,280 B each), ``blocks`` of
them per repetition, medians over ``reps`` with the cases interleaved:

* ``get_gbps``: :meth:`RemoteTier.get_many` in batches of the manager's
  promotion size, each value checked end to end (MAC, layout, tokens,
  the payload's tag) and landed in its host buffer; ``raw_get_gbps``:
  pipelined plain ``GET`` of the same keys with the same client (redis-py's
  own reply parser, no checks), the faster of two pipeline sizes (the
  promotion batch, and 4: redis-py reads a pipeline of large replies
  faster in small pieces), with freed memory kept in the heap
  (:func:`steady_heap`) so that it does not page-fault its values in.
  ``probe_ms``: the lookup-time header reads of the same blocks, apart.
* ``put_gbps``: :meth:`RemoteTier.put_many` until the writer thread has
  written everything (copy, framing, MAC, ``SET .. PX``); ``raw_put_gbps``:
  pipelined plain ``SET`` of the same framed bytes.
* ``cross_node``: two in-process instances with their own data dirs and one
  secret file: the first prefills a ``tokens``-token prompt (its blocks go to
  Redis), the second's time to first token with that prompt hit from Redis
  (``hit_s``) against its own full recompute (``recompute_s``), and whether
  their greedy continuations are the same.
* ``remote_down``: the same prompts (``down_requests`` of ``down_tokens``
  tokens, no shared prefix) sent in turn to two instances with the same
  host tier, one without a remote and one whose Redis hangs (a throwaway
  ``redis-server`` stopped with SIGSTOP: it accepts connections and never
  answers, the worst way for a remote to fail), and each request's TTFT
  over the first's (``extra_s``): what a dead remote costs a request, to be
  read against ``remote.timeout_ms`` (paid once, then the breaker skips it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import secrets
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from kvtier.bench import results
from kvtier.bench.peer.machine import describe
from kvtier.bench.redis_server import RedisServer, redis_or_url
from kvtier.config import Config, RemoteConfig
from kvtier.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from kvtier.engine.runtime import LoadedModel
from kvtier.hardware import compute_dtype
from kvtier.keys import SECRET_BYTES, BlockDigest, BlockKey, Secret
from kvtier.layout import KVLayout
from kvtier.promote import PROMOTE_BATCH
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.remote import RemoteTier

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
RAW_SMALL_BATCH = 4  # raw GETs are also timed in pipelines this small (redis-py reads huge pipelines slower)
SMOLLM2_F32 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)


@dataclass(frozen=True)
class RemoteSpec:
    url: str | None = None
    blocks: int = 64
    reps: int = 5
    tokens: int = 4096
    cross_node: bool = True
    down_requests: int = 6
    down_tokens: int = 512
    down_timeout_ms: int = 250


def _median_gbps(nbytes: int, times: list[float]) -> float:
    return round(nbytes / statistics.median(times) / 1e9, 3)


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def steady_heap() -> bool:
    """Keep freed memory in this process's heap (glibc), so that raw GET is measured at its best, every run.

    redis-py hands each value back as a new ``bytes``. Whether freeing them
    returns their pages to the OS, so that the next pipeline page-faults
    every 4 KiB again, depended on glibc's heap trimming and on which case
    ran just before: the raw baseline's time swung between runs with no
    change on either side. The tier reads into buffers it already has, so
    this helps only the baseline. False where the C library has no
    ``mallopt`` (not glibc): the baseline is then measured as it comes.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def tier_vs_raw(url: str, spec: RemoteSpec) -> dict[str, Any]:
    """Get and put through the tier against raw pipelined GET/SET of the same bytes, interleaved."""
    layout = SMOLLM2_F32
    cfg = RemoteConfig(enabled=True, urls=[url], timeout_ms=5000, write_queue_blocks=spec.blocks)
    tier = RemoteTier.open(cfg, layout, Secret(secrets.token_bytes(SECRET_BYTES)), "bench-remote")
    keys = [BlockKey(secrets.token_bytes(16)) for _ in range(spec.blocks)]
    records = [BlockRecord(BlockDigest(secrets.token_bytes(32)), None) for _ in keys]
    payloads = [torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8) for _ in keys]
    outs = [torch.empty(layout.block_bytes, dtype=torch.uint8) for _ in keys]
    names = [tier.name(k) for k in keys]
    client = tier._nodes.all[0].client  # the same redis-py client (and connection pool) the tier uses
    batches = [range(at, min(at + PROMOTE_BATCH, len(keys))) for at in range(0, len(keys), PROMOTE_BATCH)]

    def tier_put() -> None:
        tier.put_many(keys, payloads, records)
        assert tier.flush(60)

    def forget() -> None:
        """Untimed: the tier skips blocks a probe just saw there; forget them so every block is written again."""
        for key in keys:
            tier._remember(key, None)

    values: list[bytes] = []

    def raw_put() -> None:
        for batch in batches:
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.set(names[i], values[i], px=3_600_000)
            pipe.execute()

    def tier_get() -> None:
        for batch in batches:
            assert all(tier.get_many([keys[i] for i in batch], [outs[i] for i in batch]))

    def raw_get(size: int) -> None:
        for at in range(0, len(names), size):
            pipe = client.pipeline(transaction=False)
            for name in names[at : at + size]:
                pipe.get(name)
            assert all(v is not None for v in pipe.execute())

    try:
        forget()
        tier_put()
        values.extend(client.mget(names))  # the framed values, for raw SET of the very same bytes
        tier.probe(keys)
        times: dict[str, list[float]] = {n: [] for n in ("put", "raw_put", "get", "raw_get", "raw_get_4", "probe")}
        with tqdm(total=spec.reps + 1, desc="bench remote", unit="rep", leave=False) as bar:
            for rep in range(spec.reps + 1):  # round 0 warms up and is dropped
                forget()
                round_times = {
                    "raw_put": _timed(raw_put),
                    "put": _timed(tier_put),
                    "probe": _timed(lambda: tier.probe(keys)),
                    "raw_get": _timed(lambda: raw_get(PROMOTE_BATCH)),
                    "raw_get_4": _timed(lambda: raw_get(RAW_SMALL_BATCH)),
                    "get": _timed(tier_get),
                }
                assert tier.flush(60)  # untimed: the hits' TTL refreshes go out now, not inside the next case
                for name, seconds in round_times.items():
                    if rep:
                        times[name].append(seconds)
                bar.update(1)
        assert all(torch.equal(o, p) for o, p in zip(outs, payloads, strict=True))
        nbytes = spec.blocks * layout.block_bytes
        out = {
            "blocks": spec.blocks,
            "block_bytes": layout.block_bytes,
            "batch": PROMOTE_BATCH,
            "get_gbps": _median_gbps(nbytes, times["get"]),
            "raw_get_gbps": max(_median_gbps(nbytes, times["raw_get"]), _median_gbps(nbytes, times["raw_get_4"])),
            "raw_get_gbps_by_batch": {
                PROMOTE_BATCH: _median_gbps(nbytes, times["raw_get"]),
                RAW_SMALL_BATCH: _median_gbps(nbytes, times["raw_get_4"]),
            },
            "put_gbps": _median_gbps(nbytes, times["put"]),
            "raw_put_gbps": _median_gbps(nbytes, times["raw_put"]),
            "probe_ms": round(statistics.median(times["probe"]) * 1e3, 3),
        }
        out["get_vs_raw"] = round(out["get_gbps"] / out["raw_get_gbps"], 3)
        out["put_vs_raw"] = round(out["put_gbps"] / out["raw_put_gbps"], 3)
        return out
    finally:
        tier.remove_many(keys)
        tier.close()


def cross_node(url: str, config: Config, spec: RemoteSpec, loaded: LoadedModel) -> dict[str, Any]:
    """A second instance's TTFT at ``tokens`` with its hit served from Redis, against its own recompute."""
    from kvtier.bench.ttft import text_tokens
    from kvtier.engine.runtime import make_engine, open_cache

    ids = text_tokens(loaded, spec.tokens)
    first_token = SamplingParams(max_tokens=1, ignore_eos=True)
    continuation = SamplingParams(max_tokens=8, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:

        def node(name: str, remote: bool) -> Config:
            tree = config.model_dump()
            tree["data_dir"] = str(Path(tmp) / name)
            tree["disk"] = {**tree["disk"], "enabled": False}
            tree["cache"] = {**tree["cache"], "secret_file": str(Path(tmp) / "deployment.secret")}
            tree["remote"] = {**tree["remote"], "enabled": remote, "urls": [url], "timeout_ms": 5000}
            return Config.model_validate(tree)

        with open_cache(loaded, node("a", True)) as a_cache:
            a = make_engine(loaded, node("a", True), cache=a_cache, keep_resident=False)
            a.generate([ids], first_token)
            a.drain_stores()
            assert a_cache.remote is not None and a_cache.remote.flush(120)
        with open_cache(loaded, node("b", True)) as b_cache:
            b = make_engine(loaded, node("b", True), cache=b_cache, keep_resident=False)
            (hit,) = b.generate([ids], continuation)
            prefetch = dataclasses.asdict(b.prefetch_counters)
        recompute = make_engine(loaded, node("c", False), cache=None, keep_resident=False)
        (cold,) = recompute.generate([ids], continuation)
    return {
        "tokens": spec.tokens,
        "hit_s": round(hit.ttft_s, 4),
        "recompute_s": round(cold.ttft_s, 4),
        "speedup_x": round(cold.ttft_s / hit.ttft_s, 1),
        "cached_tokens": hit.cached_tokens,  # of the prompt, served from Redis (the rest was prefilled)
        "prefetch": prefetch,  # what the break-even model planned on arrival, and what landed in time
        "same_output": hit.token_ids == cold.token_ids,
        "dtype": compute_dtype(config).value,
    }


def remote_down(config: Config, spec: RemoteSpec, loaded: LoadedModel) -> dict[str, Any]:
    """Per-request TTFT of an instance whose Redis hangs against the same instance with no remote."""
    from kvtier.bench.ttft import text_tokens
    from kvtier.engine.runtime import make_engine, open_cache

    text = text_tokens(loaded, spec.down_tokens * (spec.down_requests + 1))
    warmup, *prompts = [text[i * spec.down_tokens : (i + 1) * spec.down_tokens] for i in range(spec.down_requests + 1)]
    first_token = SamplingParams(max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory(prefix="bench-remote-down-") as tmp, RedisServer.start() as hung:

        def node(name: str, remote: bool) -> Config:
            tree = config.model_dump()
            tree["data_dir"] = str(Path(tmp) / name)
            tree["disk"] = {**tree["disk"], "enabled": False}
            tree["remote"] = {
                **tree["remote"],
                "enabled": remote,
                "urls": [hung.url],
                "timeout_ms": spec.down_timeout_ms,
            }
            return Config.model_validate(tree)

        with (
            open_cache(loaded, node("none", False)) as none_cache,
            open_cache(loaded, node("down", True)) as down_cache,
        ):
            none = make_engine(loaded, node("none", False), cache=none_cache, keep_resident=False)
            down = make_engine(loaded, node("down", True), cache=down_cache, keep_resident=False)
            remote = down_cache.remote
            assert remote is not None
            for engine in (none, down):  # first requests warm the engines up, while Redis still answers
                engine.generate([warmup], first_token)
                engine.drain_stores()
            remote.flush(120)
            os.kill(hung.proc.pid, signal.SIGSTOP)
            try:
                none_s, down_s = [], []
                for i, ids in enumerate(prompts):  # interleaved, each first in turn: both see the same machine
                    if i % 2:
                        down_s.append(down.generate([ids], first_token)[0].ttft_s)
                    none_s.append(none.generate([ids], first_token)[0].ttft_s)
                    if not i % 2:
                        down_s.append(down.generate([ids], first_token)[0].ttft_s)
                snap = remote.snapshot()
            finally:
                os.kill(hung.proc.pid, signal.SIGCONT)
    extra = [d - n for d, n in zip(down_s, none_s, strict=True)]
    return {
        "timeout_ms": spec.down_timeout_ms,
        "tokens": spec.down_tokens,
        "no_remote_s": [round(t, 4) for t in none_s],
        "down_s": [round(t, 4) for t in down_s],
        "extra_s": [round(t, 4) for t in extra],
        "remote_timeouts": snap.timeouts,
        "remote_skipped": snap.skipped,
        "breaker_opens": snap.breaker_opens,
    }


def run(config: Config, spec: RemoteSpec) -> dict[str, Any]:
    with redis_or_url(spec.url) as url:
        result: dict[str, Any] = {
            "setup": {
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": describe(),
                "redis": "given --url" if spec.url else "own redis-server on loopback",
                "reps": spec.reps,
                "steady_heap": steady_heap(),
            },
            **tier_vs_raw(url, spec),
        }
        if spec.cross_node:
            from kvtier.engine.runtime import load_model

            loaded = load_model(config)  # once, for both instances' cases
            result["cross_node"] = cross_node(url, config, spec, loaded)
            result["remote_down"] = remote_down(config, spec, loaded)
    return result


def save(result: dict[str, Any], out_dir: Path) -> Path:
    return results.write(result, out_dir, "remote")


def table(result: dict[str, Any]) -> str:
    lines = [
        f"remote get   {result['get_gbps']:.3f} GB/s   raw GET {result['raw_get_gbps']:.3f} GB/s   "
        f"ratio {result['get_vs_raw']:.2f}   (probe of {result['blocks']} headers {result['probe_ms']:.2f} ms)",
        f"remote put   {result['put_gbps']:.3f} GB/s   raw SET {result['raw_put_gbps']:.3f} GB/s   "
        f"ratio {result['put_vs_raw']:.2f}",
    ]
    cross = result.get("cross_node")
    if cross:
        lines.append(
            f"cross-node TTFT at {cross['tokens']} tokens: hit from Redis {cross['hit_s']:.3f} s, "
            f"recompute {cross['recompute_s']:.3f} s ({cross['speedup_x']}x), same output: {cross['same_output']}"
        )
    down = result.get("remote_down")
    if down:
        lines.append(
            f"Redis hung ({down['timeout_ms']} ms timeout), TTFT over no remote per request: "
            + ", ".join(f"{x * 1000:+.0f} ms" for x in down["extra_s"])
            + f"; breaker opened {down['breaker_opens']}x"
        )
    return "\n".join(lines)
