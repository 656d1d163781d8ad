"""Process faults: two servers on one data directory, and clients that leave in the middle of a stream.

Both run the real ``kvtier serve`` (the embedded model, the real HTTP
server) as a subprocess on a free loopback port. The promises: a second
server on a data directory already served refuses to start, in one line
naming the first one's pid (two caches on one disk tier would overwrite
each other's blocks), and the first goes on serving; dozens of clients that
disconnect mid-stream have their requests aborted, their pool blocks and
pins released, and the server keeps answering.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.bench import fleet
from kvtier.bench.faults import Fault, FaultOutcome, fault
from kvtier.bench.fleet import Proc

READY = "kvtier serving on"  # logged once the model is loaded and the cache is open, just before serving
START_S = 300.0  # hang guards, never speed assertions
REQUEST_S = 120.0
BLOCK_BYTES = 46080 * 16  # one float32 block of the embedded model
SIZES: dict[str, Any] = {
    "engine": {"pool_bytes": 400 * BLOCK_BYTES, "dtype": "float32"},
    "host": {"capacity_bytes": "64MiB"},
    "disk": {"capacity_bytes": "128MiB"},
}


def launch(workdir: Path, where: str = "server") -> Proc:
    """``kvtier -v serve`` on ``workdir``'s data directory and a free port, its output read through a pipe."""
    tree = {"data_dir": str(workdir / "data"), **SIZES}
    return fleet.start(workdir / where, tree, ["-v", "serve"], watch=True)


@contextmanager
def serving(workdir: Path) -> Iterator[Proc]:
    """``kvtier serve``, yielded once it logs that it serves; SIGTERM (then SIGKILL) at the end.

    Readiness is the server's own log line, read as it is written: no polling, no sleep.
    """
    served = launch(workdir)
    try:
        served.wait_for_line(READY)
        yield served
    finally:
        served.stop()


def _complete(served: Proc, prompt: str, max_tokens: int) -> int:
    """A whole completion; how many tokens came back (0 when it failed)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = served.post("/v1/completions", json=body)
    return reply.json()["usage"]["completion_tokens"] if reply.status_code == 200 else 0


# -- two servers -------------------------------------------------------------------------------------------------------
@fault(Fault.TWO_SERVERS)
def two_servers(workdir: Path) -> FaultOutcome:
    """A second ``kvtier serve`` started on the data directory a first one serves from."""
    with serving(workdir) as first:
        second = launch(workdir, "second").process
        out, _ = second.communicate(timeout=START_S)
        said = [line for line in out.splitlines() if "in use by pid" in line]
        first_answers = _complete(first, "The lighthouse keeper", 4)
        health = first.get("/health").status_code
    names_first = len(said) == 1 and f"in use by pid {first.process.pid}" in said[0]
    figures = {
        "second_exit_code": second.returncode,
        "refusal_lines": len(said),
        "refusal_names_first_pid": int(names_first),
        "tracebacks": out.count("Traceback"),
        "first_completion_tokens": first_answers,
        "first_health": health,
    }
    held = second.returncode == 2 and names_first and "Traceback" not in out and first_answers == 4 and health == 200
    return FaultOutcome(
        Fault.TWO_SERVERS,
        injected="a second kvtier serve on the data directory (and so the disk tier) a running one uses",
        outcome=(
            "the second exited 2 with one line naming the first's pid and how to share one cache; "
            "the first kept serving"
        ),
        held=held,
        figures=figures,
    )


# -- clients that leave mid-stream -------------------------------------------------------------------------------------
LEAVERS = 32
CHUNKS_BEFORE_LEAVING = 3


def stream_then_leave(port: int, n: int) -> int:
    """Open a long streaming completion, read a few chunks, then drop the connection; chunks read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_S)
    body = {"prompt": f"Story {n}: a very long tale of a lighthouse.", "max_tokens": 900, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    chunks = 0
    while response.status == 200 and chunks < CHUNKS_BEFORE_LEAVING:
        line = response.fp.readline()
        if not line:
            break
        chunks += line.startswith(b"data: ")
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return chunks


def settled(served: Proc, aborted: int) -> dict[str, Any]:
    """/stats once ``aborted`` requests are counted and none is in flight (each poll is one request: the server
    is the clock; the guard only stops a hang)."""
    deadline = time.monotonic() + REQUEST_S
    while True:
        stats = served.stats()
        engine = stats["engine"]
        if (engine["requests"]["abort"] >= aborted and engine["in_flight"] == 0) or time.monotonic() > deadline:
            return stats


@fault(Fault.DISCONNECTS)
def disconnects(workdir: Path) -> FaultOutcome:
    """32 clients stream at once and each hangs up after three chunks; then one more asks a whole question."""
    with serving(workdir) as served:
        chunks = [0] * LEAVERS

        def leave(n: int) -> None:
            chunks[n] = stream_then_leave(served.port, n)

        threads = [threading.Thread(target=leave, args=(n,)) for n in range(LEAVERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_S)
        stats = settled(served, LEAVERS)
        after = _complete(served, "Hello", 2)
        engine, device = stats["engine"], stats["tiers"]["device"]
        orphans = device["used_bytes"] - device["blocks"] * device["capacity_bytes"] // device["capacity_blocks"]
        tracebacks = sum("Traceback" in line for line in served.lines)
    figures = {
        "clients_left": sum(c == CHUNKS_BEFORE_LEAVING for c in chunks),
        "aborted": engine["requests"]["abort"],
        "ran_to_length": engine["requests"]["length"],
        "in_flight_after": engine["in_flight"],
        "pinned_blocks_after": stats["pinned_blocks"],
        "pool_bytes_unaccounted": orphans,
        "completion_tokens_after": after,
        "tracebacks": tracebacks,
    }
    held = (
        figures["clients_left"] == figures["aborted"] == LEAVERS
        and figures["ran_to_length"] == 0
        and figures["in_flight_after"] == figures["pinned_blocks_after"] == orphans == 0
        and after == 2
        and tracebacks == 0
    )
    return FaultOutcome(
        Fault.DISCONNECTS,
        injected=f"{LEAVERS} streaming clients at once, each hanging up after {CHUNKS_BEFORE_LEAVING} chunks",
        outcome=(
            "every one aborted (none ran on to max_tokens), nothing in flight, no pins, every used pool block a "
            "resident cached one; the next request was served"
        ),
        held=held,
        figures=figures,
    )


__all__ = ["disconnects", "serving", "stream_then_leave", "two_servers"]
