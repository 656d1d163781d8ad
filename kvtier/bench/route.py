"""`kvtier bench route`: one request stream of interleaved agent sessions through ``kvtier route``, per policy.

Three ``kvtier serve`` backends, eight agent sessions of twelve turns (the demo's
transcript, each session starting at another turn and tagged with its own
name, so no two share a block), replayed turn by turn: every turn resends
the whole transcript so far. A few clients send the stream's requests in
order, a session's turn never before its previous one ended. The same
stream goes through a router with each policy in turn (``round_robin``,
``least_loaded``, ``kvtier``), every backend's tiers emptied in between.

Measured at the client: time to first token (request sent → first
server-sent event), and the backends' own ``cached_tokens`` over prompt
tokens (the hit rate). The ideal hit rate is every turn served where its
previous turn was: the full blocks each prompt shares with that turn.

Then the faults and the guard, with the ``kvtier`` policy:

* ``restarted``: the stream again, with one backend restarted (SIGTERM, then
  started at the same address) after its first third: the backends publish
  their KV events in vLLM's format (``kv_events``) and the router follows
  them over ZMQ, so ``restart`` says how many requests were routed by the
  old process's index after it went (``stale_routes``) and how long the
  router's resync took (``resync_s``);
* ``killed``: the stream again, with one backend killed (SIGKILL) a third
  of the way in: how many requests failed (the target is none);
* ``skewed``: one hot session (a long shared prefix, many requests at
  once, as sub-agents of one agent) interleaved with the others, with the
  load term (queued prefill tokens) and the guard, and without either (the
  prefix alone decides: ``route.queue_weight: 0``, ``route.load_tokens: 0``,
  ``route.max_imbalance`` huge): the share of the busiest backend and the TTFTs.

Each backend caches in its engine pool and host memory, with room for its
share of the sessions but not for all of them (``--disk`` puts a disk tier
under each, ``--host-bytes`` sizes host memory): see :class:`RouteSpec`.

Beside the hit rates, the prefill tokens each policy left the backends
(prompt less cached tokens) and the ideal's: with three clients and the
cores the bottleneck, mean TTFT follows the prefill work, so round robin's
prefill over the ideal's bounds what any routing can gain on this stream.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx2 as httpx

from kvtier.bench import fleet as processes
from kvtier.bench.results import write
from kvtier.demo.session import load_session, user_message
from kvtier.model import default_gguf_path, load_chat_template, load_tokenizer, read_gguf_metadata
from kvtier.model.chat import chat_ids
from kvtier.route.proxy import BACKEND_HEADER, PREDICTED_HEADER

ADMIN = "bench-route-admin-token-0123456789"
POLICIES = ("round_robin", "least_loaded", "kvtier")
BLOCK = 16
NO_GUARD = 1_000_000
SEED = 16
REPLY = "Noted; reading on."  # every assistant turn: the stream is the same whichever backend answered


@dataclass(frozen=True)
class RouteSpec:
    backends: int = 3
    sessions: int = 8
    turns: int = 12
    tool_chars: int = 300  # each turn's tool result cut to this: short turns keep the bench to minutes on 2 cores
    max_tokens: int = 2
    clients: int = 3  # requests in flight at once
    hot_requests: int = 12
    hot_clients: int = 8  # requests in flight at once in the skewed stream: enough to pile up on one backend
    threads: int = 1  # OMP_NUM_THREADS of each backend: three backends share the machine's cores
    # Each backend caches in its pool and host memory, no disk: room for its share of the sessions (about
    # three transcripts at their longest), not for every session. That is a GPU fleet's shape (HBM + host),
    # and the one where routing matters: round robin copies every session onto every backend, dividing the
    # fleet's cache by the number of backends; with an unbounded disk under each, those copies cost little.
    host_bytes: str = "384MiB"
    disk: bool = False

    @property
    def tiers(self) -> dict[str, Any]:
        return {
            "engine": {"pool_bytes": "256MiB"},
            "host": {"capacity_bytes": self.host_bytes},
            "disk": {"enabled": self.disk},
        }


@dataclass(frozen=True)
class Request:
    session: str
    turn: int
    messages: list[dict[str, str]]


def session_turns(spec: RouteSpec, s: int) -> list[Request]:
    """Session ``s``: its name, the demo's system prompt and one whole file as context, then the demo's turns
    from turn ``s + 1`` on (wrapping), each tool result cut short.

    The long opening stands for what agents open with (instructions, tool
    schemas, the task's files); each turn then adds a little: the shape where
    a turn on the wrong backend recomputes everything.
    """
    demo = load_session()
    turns = demo["turns"]
    context = turns[s % len(turns)]["tool"]
    system = f"[agent session {s}] {demo['system']}\n\nContext, {context['path']}:\n{context['content']}"
    messages = [{"role": "system", "content": system}]
    out = []
    for k in range(spec.turns):
        turn = turns[(s + 1 + k) % len(turns)]
        tool = {**turn["tool"], "content": turn["tool"]["content"][: spec.tool_chars]}
        messages = [*messages, {"role": "user", "content": user_message({**turn, "tool": tool})}]
        out.append(Request(f"session-{s}", k, messages))
        messages = [*messages, {"role": "assistant", "content": REPLY}]
    return out


def interleaved(spec: RouteSpec) -> list[Request]:
    """Turn by turn across sessions, each round in another (seeded) order, as agents never keep step.

    A fixed order would hand round robin every session's turns on one
    backend whenever the backends divide the sessions evenly.
    """
    sessions = [session_turns(spec, s) for s in range(spec.sessions)]
    rng = random.Random(SEED)
    stream = []
    for k in range(spec.turns):
        order = list(range(spec.sessions))
        rng.shuffle(order)
        stream += [sessions[s][k] for s in order]
    return stream


def skewed(spec: RouteSpec) -> list[Request]:
    """One hot session among the interleaved ones: its long transcript once, then many requests on it at once.

    The hot requests are one session's (sub-agents of one agent: same ``user``)
    and each waits for the first, so its prefix is announced before they
    come: session affinity and the cache both point at one backend, and only
    the load term and the balance guard can spread them.
    """
    prefix = session_turns(spec, spec.sessions)[-1].messages
    last = prefix[-1]
    hot = [
        Request("hot", 1, [*prefix[:-1], {**last, "content": f"{last['content']} ({i})"}])
        for i in range(spec.hot_requests)
    ]
    out = [Request("hot", 0, prefix)]
    for i, request in enumerate(interleaved(spec)[: spec.sessions * 2]):
        out.append(request)
        if i % 2 == 0 and hot:
            out.append(hot.pop())
    return out + hot


@dataclass(frozen=True)
class Ideal:
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def ideal(stream: list[Request]) -> Ideal:
    """Cached and prompt tokens if every turn ran where its previous turn did: the full blocks the two share."""
    meta = read_gguf_metadata(default_gguf_path())
    tok, chat = load_tokenizer(meta), load_chat_template(meta)
    previous: dict[str, list[int]] = {}
    cached = total = 0
    for request in stream:
        ids = chat_ids(tok, chat, request.messages)
        before = previous.get(request.session, [])
        shared = next(
            (i for i, (a, b) in enumerate(zip(ids, before, strict=False)) if a != b), min(len(ids), len(before))
        )
        cached += shared // BLOCK * BLOCK
        total += len(ids)
        previous[request.session] = ids
    return Ideal(total, cached)


# -- the client ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    ttft_s: float | None  # None: failed
    cut: bool = False  # a stream broken after its output began (its backend died): no router can retry that
    prompt_tokens: int = 0
    cached_tokens: int = 0
    backend: str | None = None
    predicted: int | None = None  # the cached tokens the router chose its backend for (its first choice only)
    sent: float = 0.0  # monotonic


def _carries_token(chunk: dict[str, Any]) -> bool:
    """A chunk with generated text (or the end of it): the chat stream's first chunk only names the role."""
    return any(c.get("delta", {}).get("content") or c.get("finish_reason") for c in chunk.get("choices", []))


async def ask(client: httpx.AsyncClient, url: str, request: Request, spec: RouteSpec) -> Outcome:
    body = {
        "messages": request.messages,
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": request.session,
    }
    sent = time.monotonic()
    started = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Outcome(None)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                if first is None and _carries_token(chunk):
                    first = time.perf_counter() - started
            backend = response.headers.get(BACKEND_HEADER)
            predicted = response.headers.get(PREDICTED_HEADER)
    except httpx.HTTPError:
        return Outcome(None, cut=first is not None)
    if first is None or not usage:
        return Outcome(None)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return Outcome(
        first,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=cached,
        backend=backend,
        predicted=None if predicted is None else int(predicted),
        sent=sent,
    )


async def replay(
    url: str, stream: list[Request], spec: RouteSpec, clients: int, midway: Callable[[], None] | None = None
) -> list[Outcome]:
    """``clients`` workers send ``stream`` in order; a session's turn waits for its previous turn's answer."""
    done: dict[tuple[str, int], asyncio.Event] = {(r.session, r.turn): asyncio.Event() for r in stream}
    outcomes: list[Outcome | None] = [None] * len(stream)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(stream)):
        queue.put_nowait(i)
    finished = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal finished
        while not queue.empty():
            i = queue.get_nowait()
            request = stream[i]
            before = done.get((request.session, request.turn - 1))
            if before is not None:
                await before.wait()
            outcomes[i] = await ask(client, url, request, spec)
            done[(request.session, request.turn)].set()
            finished += 1
            if midway is not None and finished == len(stream) // 3:
                await asyncio.to_thread(midway)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return [o for o in outcomes if o is not None]


def summary(outcomes: list[Outcome], urls: list[str]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ttft_s is not None]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    per = Counter(o.backend for o in ok)
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "p95_ttft_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))] if ttfts else None,
        "hit_rate": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "prefill_tokens": prompt - sum(o.cached_tokens for o in ok),
        "failed": sum(o.ttft_s is None and not o.cut for o in outcomes),  # no output at all
        "cut": sum(o.cut for o in outcomes),
        "requests": len(outcomes),
        "requests_per_backend": [per.get(u, 0) for u in urls],
    }


# -- the runs ---------------------------------------------------------------------------------------
def _through(
    tmp: Path,
    fleet: processes.Backends,
    spec: RouteSpec,
    route: dict[str, Any],
    stream: list[Request],
    clients: int,
    midway: Callable[[], None] | None = None,
) -> dict[str, Any]:
    fleet.clear()
    name = f"router-{route['policy']}-{int(time.monotonic() * 1000)}"
    with processes.router(tmp / name, fleet, spec.tiers.get("engine", {}), route) as router:
        outcomes = asyncio.run(replay(router.url, stream, spec, clients, midway))
        result = summary(outcomes, fleet.urls)
        result["router"] = router.get("/stats").json()
    return result


def _restarted(tmp: Path, fleet: processes.Backends, spec: RouteSpec, stream: list[Request]) -> dict[str, Any]:
    """The first third of the stream, the backend that served most of it restarted (SIGTERM, then started at
    the same address), and once the router has it back, the rest.

    A stale route is a request of the rest answered by the restarted
    backend as the router's first choice that skipped fewer tokens than the
    router chose it for: routed by what the old process held. A router that
    kept the old index would send the restarted backend's sessions back to
    it; one that follows the new state sends them where their prefix is, or
    by load, so ``routed_there_after`` may well be small.
    ``mispredicted_elsewhere`` counts the same on the other backends (the
    index is exact only up to blocks in flight). ``resync_s`` is the
    router's own figure for the restarted backend, the round trip from
    asking its new incarnation for a snapshot to the snapshot in the index.
    """
    fleet.clear()
    cut = len(stream) // 3
    with processes.router(tmp / f"router-restart-{int(time.monotonic() * 1000)}", fleet, spec.tiers["engine"], {}) as r:
        outcomes = asyncio.run(replay(r.url, stream[:cut], spec, spec.clients))
        busiest, _ = Counter(o.backend for o in outcomes if o.backend is not None).most_common(1)[0]
        victim = fleet.restart(fleet.urls.index(busiest)).url
        processes.wait_until(r, processes.all_live(len(fleet.urls)))
        rest = asyncio.run(replay(r.url, stream[cut:], spec, spec.clients))
        result = summary(outcomes + rest, fleet.urls)
        result["router"] = r.get("/stats").json()
    (seen,) = [b for b in result["router"]["backends"] if b["url"] == victim]
    chosen = [o for o in rest if o.predicted is not None]
    short = [o for o in chosen if o.cached_tokens < o.predicted]  # type: ignore[operator]
    result["restart"] = {
        "stale_routes": sum(o.backend == victim for o in short),
        "routed_there_after": sum(o.backend == victim for o in chosen),
        "mispredicted_elsewhere": sum(o.backend != victim for o in short),
        "resync_s": seen["event_resync_s"],
        "resyncs": seen["event_resyncs"],
    }
    return result


def _warm(fleet: processes.Backends, spec: RouteSpec) -> None:
    """One request per backend before timing: first forward, allocator, threads."""
    warm = session_turns(spec, 99)[0]
    for url in fleet.urls:
        asyncio.run(replay(url, [warm], spec, 1))


def run(spec: RouteSpec, progress: Callable[[str], None] = print) -> dict[str, Any]:
    stream = interleaved(spec)
    env = {"OMP_NUM_THREADS": str(spec.threads)}
    with tempfile.TemporaryDirectory(prefix="kvtier-route-") as tmp_name:
        tmp = Path(tmp_name)
        progress(f"starting {spec.backends} backends")
        with processes.backends(tmp, spec.backends, spec.tiers, ADMIN, env, events=True) as fleet:
            _warm(fleet, spec)
            policies = {}
            for policy in POLICIES:
                progress(f"policy {policy}: {len(stream)} requests")
                policies[policy] = _through(tmp, fleet, spec, {"policy": policy}, stream, spec.clients)
            hot = skewed(spec)
            progress(f"skewed stream: {len(hot)} requests, with and without the balance guard")
            guard = _through(tmp, fleet, spec, {"policy": "kvtier"}, hot, spec.hot_clients)
            no_guard = _through(
                tmp,
                fleet,
                spec,
                {"policy": "kvtier", "max_imbalance": NO_GUARD, "load_tokens": 0, "queue_weight": 0},
                hot,
                spec.hot_clients,
            )
            progress("restarted: a backend restarted after a third of the stream (its ZMQ events resync the router)")
            restarted = _restarted(tmp, fleet, spec, stream)
            progress("killed: one backend killed a third of the way in")
            victim = fleet.procs[-1]
            killed = _through(
                tmp, fleet, spec, {"policy": "kvtier"}, stream, spec.clients, lambda: victim.process.kill()
            )
    best = ideal(stream)
    return {
        "setup": {
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "backends": spec.backends,
            "sessions": spec.sessions,
            "turns": spec.turns,
            "tool_chars": spec.tool_chars,
            "max_tokens": spec.max_tokens,
            "clients": spec.clients,
            "backend_threads": spec.threads,
            "tiers": spec.tiers,
        },
        "policies": policies,
        "ideal_hit_rate": best.hit_rate,
        "ideal_prefill_tokens": best.prefill_tokens,
        "skewed": {"guard": guard, "no_guard": no_guard},
        "killed": killed,
        "restarted": {k: v for k, v in restarted.items() if k != "restart"},
        "restart": restarted["restart"],
    }


def checks(result: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """(what, measured, target, met) for the issue's targets."""
    p = result["policies"]
    kv, rr, ll = p["kvtier"], p["round_robin"], p["least_loaded"]
    speedup = rr["mean_ttft_s"] / kv["mean_ttft_s"] if kv["mean_ttft_s"] else 0.0
    of_ideal = kv["hit_rate"] / result["ideal_hit_rate"] if result["ideal_hit_rate"] else 0.0
    return [
        ("mean TTFT round_robin / kvtier", speedup, 3.0, speedup >= 3.0),
        (
            "p95 TTFT kvtier / least_loaded",
            kv["p95_ttft_s"] / ll["p95_ttft_s"],
            1.0,
            kv["p95_ttft_s"] <= ll["p95_ttft_s"],
        ),
        ("kvtier hit rate / ideal", of_ideal, 0.9, of_ideal >= 0.9),
        ("failed with a backend killed", result["killed"]["failed"], 0, result["killed"]["failed"] == 0),
        ("stale routes after a restart", result["restart"]["stale_routes"], 0, result["restart"]["stale_routes"] == 0),
    ]


def table(result: dict[str, Any]) -> str:
    lines = [f"{'policy':<16}{'mean TTFT':>11}{'p95 TTFT':>11}{'hit rate':>10}{'failed':>8}{'cut':>5}  per backend"]
    rows = [*result["policies"].items(), ("skewed guard", result["skewed"]["guard"])]
    rows += [("skewed no guard", result["skewed"]["no_guard"]), ("restarted", result["restarted"])]
    rows += [("killed", result["killed"])]
    for name, r in rows:
        lines.append(
            f"{name:<16}{r['mean_ttft_s']:>10.3f}s{r['p95_ttft_s']:>10.3f}s{r['hit_rate']:>10.1%}{r['failed']:>8}"
            f"{r.get('cut', 0):>5}"
            f"  {r['requests_per_backend']}"
        )
    lines.append(f"ideal hit rate {result['ideal_hit_rate']:.1%}, prefill {result['ideal_prefill_tokens']} tokens")
    rr = result["policies"]["round_robin"]["prefill_tokens"]
    bound = rr / result["ideal_prefill_tokens"]
    lines.append(f"  round_robin's prefill over the ideal's (the most routing can gain): {bound:.2f}x")
    for what, got, target, met in checks(result):
        lines.append(f"  {'ok ' if met else 'MISS'} {what}: {got:.2f} (target {target})")
    return "\n".join(lines)


def save(result: dict[str, Any], out_dir: Path) -> Path:
    return write(result, out_dir, "route")
