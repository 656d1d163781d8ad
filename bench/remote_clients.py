"""Which Python client the remote tier uses: redis-py (hiredis parser) against valkey-glide (sync), same bytes.

Starts its own redis-server on a free loopback port in a temporary directory,
writes ``--blocks`` values of one SmolLM2 float32 block each (737,280 B) and
reads them back, in batches of ``--batch``, with each client's batched form
(redis-py: a pipeline of GET / SET and MGET; glide: MGET / MSET and a
``Batch``), median of ``--reps`` passes. valkey-glide is no kvtier
dependency: ``pip install valkey-glide-sync`` to run its half.

    .venv/bin/python bench/remote_clients.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

from kvtier.bench.redis_server import RedisServer

BLOCK = 737_280


def timed(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def redis_py(port: int, keys: list[bytes], value: bytes, batch: int, reps: int) -> dict[str, float]:
    import redis
    from redis.utils import HIREDIS_AVAILABLE

    assert HIREDIS_AVAILABLE
    r = redis.Redis(port=port)
    total = len(keys) * len(value)

    def put() -> None:
        for at in range(0, len(keys), batch):
            p = r.pipeline(transaction=False)
            for k in keys[at : at + batch]:
                p.set(k, value, px=600_000)
            p.execute()

    def get_pipe() -> None:
        for at in range(0, len(keys), batch):
            p = r.pipeline(transaction=False)
            for k in keys[at : at + batch]:
                p.get(k)
            assert all(v is not None for v in p.execute())

    def get_mget() -> None:
        for at in range(0, len(keys), batch):
            assert all(v is not None for v in r.mget(keys[at : at + batch]))

    out = {"put_gbps": total / timed(put, reps) / 1e9}
    out["get_pipeline_gbps"] = total / timed(get_pipe, reps) / 1e9
    out["get_mget_gbps"] = total / timed(get_mget, reps) / 1e9
    r.close()
    return out


def glide(port: int, keys: list[bytes], value: bytes, batch: int, reps: int) -> dict[str, float]:
    from glide_sync import Batch, GlideClient, GlideClientConfiguration, NodeAddress

    c = GlideClient.create(GlideClientConfiguration([NodeAddress("127.0.0.1", port)], request_timeout=5000))
    total = len(keys) * len(value)

    def put() -> None:
        for at in range(0, len(keys), batch):
            b = Batch(is_atomic=False)
            for k in keys[at : at + batch]:
                b.set(k, value)
            c.exec(b, raise_on_error=True)

    def get_batch() -> None:
        for at in range(0, len(keys), batch):
            b = Batch(is_atomic=False)
            for k in keys[at : at + batch]:
                b.get(k)
            assert all(v is not None for v in c.exec(b, raise_on_error=True) or [])

    def get_mget() -> None:
        for at in range(0, len(keys), batch):
            assert all(v is not None for v in c.mget(keys[at : at + batch]))

    out = {"put_gbps": total / timed(put, reps) / 1e9}
    out["get_pipeline_gbps"] = total / timed(get_batch, reps) / 1e9
    out["get_mget_gbps"] = total / timed(get_mget, reps) / 1e9
    c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    value = os.urandom(BLOCK)
    keys = [b"kvbench:%d" % i for i in range(args.blocks)]
    result: dict[str, object] = {"block_bytes": BLOCK, "blocks": args.blocks, "batch": args.batch}
    with RedisServer.start() as server:
        result["redis_py_hiredis"] = redis_py(server.port, keys, value, args.batch, args.reps)
        try:
            result["valkey_glide_sync"] = glide(server.port, keys, value, args.batch, args.reps)
        except ImportError:
            result["valkey_glide_sync"] = None
    print(json.dumps(result, indent=2) if args.json else result)


if __name__ == "__main__":
    main()
