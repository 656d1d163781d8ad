"""The router's HTTP surface: the backends' OpenAI routes and Messages API, forwarded; ``/health``, ``/stats``,
``/metrics``; and the fleet control API, ``/fleet/*``, behind ``route.admin_token`` (:mod:`kvtier.route.control`).

Each inference request is read (tokens, block keys, session) on a worker
thread, ranked by the policy on the event loop, and forwarded
(:mod:`kvtier.route.proxy`). ``GET /v1/models`` is any up backend's answer:
they all serve the router's model, or their keys would not agree with its.
Everything else the router knows lives in one :class:`RouterState`,
touched only on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx2 as httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.config import Config
from kvtier.route.answer import Bounds, Shape
from kvtier.route.backends import Backend, Fleet, health_loop
from kvtier.route.choice import make_chooser
from kvtier.route.control import Control, routes
from kvtier.route.index import RoutedPrefixes
from kvtier.route.prompt import SESSION_HEADER, Endpoint, Prompts, RoutedPrompt, caller_key
from kvtier.route.proxy import Counts, Outgoing, Proxy, forward, passed_headers, unavailable
from kvtier.route.subscribe import follow, follow_zmq
from kvtier.web.listen import listen_sockets


@dataclass
class RouterState:
    config: Config
    prompts: Prompts
    fleet: Fleet
    counts: Counts
    proxy: Proxy | None = None  # while the app runs: it holds the client to the backends
    control: Control = dataclasses.field(init=False)  # the fleet control API: its pins, the client while it runs

    def __post_init__(self) -> None:
        self.control = Control(self.fleet, self.config.route)


NO_PROMPT = RoutedPrompt(0, [], None, False)  # a request that is no prompt (the model list): nothing to prefill
ANSWERS = {Endpoint.CHAT: Shape.CHOICES, Endpoint.COMPLETIONS: Shape.CHOICES, Endpoint.MESSAGES: Shape.CONTENT}
"""The shape of each inference route's complete answer, and so the dialect of the router's errors there."""


def build_state(config: Config, backends: list[str]) -> RouterState:
    prompts = Prompts(config)
    fleet = Fleet(
        {url: Backend(url) for url in backends},
        make_chooser(config.route, prompts.block_size),
        prompts.block_size,
        guesses=RoutedPrefixes(config.route.approx_blocks),
    )
    return RouterState(config, prompts, fleet, Counts())


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None  # forwarded as is: the backend answers it with its own 4xx


async def _infer(state: RouterState, request: Request, endpoint: Endpoint) -> Response:
    raw = await request.body()
    headers = request.headers
    key, session = caller_key(endpoint, headers), headers.get(SESSION_HEADER)
    prompt = await asyncio.to_thread(state.prompts.read, endpoint, _body(raw), key, session)
    ranking = state.fleet.rank(prompt)
    outgoing = Outgoing(http.HTTPMethod.POST, endpoint.value, raw, passed_headers(headers), ANSWERS[endpoint])
    if ranking is None:
        return await _forward(state, [], prompt, outgoing)
    return await _forward(state, ranking.order, prompt, outgoing, ranking.predicted_cached_tokens)


async def _models(state: RouterState, request: Request) -> Response:
    """The model list of the least loaded up backend (the next if it fails)."""
    order = [b.url for b in sorted(state.fleet.up(), key=lambda b: b.load)]
    outgoing = Outgoing(http.HTTPMethod.GET, "/v1/models", b"", passed_headers(request.headers), Shape.DATA)
    return await _forward(state, order, NO_PROMPT, outgoing)


async def _forward(
    state: RouterState, order: list[str], prompt: RoutedPrompt, outgoing: Outgoing, predicted: int | None = None
) -> Response:
    if not order:
        state.counts.requests += 1
        state.counts.failed += 1
        return unavailable("no backend is up", outgoing.shape.dialect)
    assert state.proxy is not None
    return await forward(state.proxy, order, prompt, outgoing, predicted)


def stats(state: RouterState) -> dict[str, Any]:
    fleet = state.fleet
    return {
        "policy": state.config.route.policy.value,
        "requests": state.counts.requests,
        "retried": state.counts.retried,
        "failed": state.counts.failed,
        "broken": state.counts.broken,
        "timed_out": state.counts.timed_out,
        "cut": state.counts.cut,
        "reasons": dict(fleet.reasons),
        "backends": [
            {
                "url": b.url,
                "up": b.up,
                "events_live": b.events_live,
                "load": b.load,
                "open_requests": b.open_requests,
                "others": b.others,
                "queued_tokens": b.queued_tokens,
                "requests": b.requests,
                "failures": b.failures,
                "bad_stats": b.bad_stats,
                "check_errors": b.check_errors,
                "event_overflows": b.event_overflows,
                "event_resyncs": b.event_resyncs,
                "event_resync_s": b.event_resync_s,
                "indexed_blocks": fleet.index.blocks(b.url),
                "indexed_by_tier": fleet.index.counts(b.url),
            }
            for b in fleet.backends.values()
        ],
    }


ROUTER_COUNTERS = {  # metric -> (help, field of /stats)
    "kvtier_route_requests": ("Requests received.", "requests"),
    "kvtier_route_retried": ("Attempts moved to another backend.", "retried"),
    "kvtier_route_failed": ("Requests no backend answered.", "failed"),
    "kvtier_route_broken": ("Backend answers that were none (cut off, HTML, another shape).", "broken"),
    "kvtier_route_timed_out": ("Backends that gave no output within route.first_byte_timeout_s.", "timed_out"),
    "kvtier_route_cut": ("Relayed streams ended: their backend fell silent past route.idle_timeout_s.", "cut"),
}
BACKEND_GAUGES = {
    "kvtier_route_backend_up": ("1 while the backend answers its health checks.", "up"),
    "kvtier_route_backend_events_live": ("1 while its block events keep the index.", "events_live"),
    "kvtier_route_backend_load": ("Requests running or queued there.", "load"),
    "kvtier_route_backend_queued_tokens": ("Prefill tokens sent there, no first token yet.", "queued_tokens"),
    "kvtier_route_backend_indexed_blocks": ("Block keys the index holds for it.", "indexed_blocks"),
}
BACKEND_COUNTERS = {
    "kvtier_route_backend_requests": ("Requests sent to the backend.", "requests"),
    "kvtier_route_backend_bad_stats": ("Its /stats replies that could not be read, so ignored.", "bad_stats"),
    "kvtier_route_backend_check_errors": ("Its health checks that raised an unforeseen error.", "check_errors"),
    "kvtier_route_backend_event_resyncs": ("Snapshots or replays asked of its ZMQ KV events.", "event_resyncs"),
    "kvtier_route_backend_event_overflows": ("Its event streams dropped for too long a line.", "event_overflows"),
}


class RouterCollector(Collector):
    """``/metrics``: the figures of ``/stats``, one metric each."""

    def __init__(self, state: RouterState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        s = stats(self._state)
        for name, (doc, field) in ROUTER_COUNTERS.items():
            yield CounterMetricFamily(name, doc, s[field])
        for family, table in ((GaugeMetricFamily, BACKEND_GAUGES), (CounterMetricFamily, BACKEND_COUNTERS)):
            for name, (doc, field) in table.items():
                metric = family(name, doc, labels=["backend"])
                for b in s["backends"]:
                    metric.add_metric([b["url"]], float(b[field]))
                yield metric


async def _follow(state: RouterState, backend: Backend, client: httpx.AsyncClient, token: str | None) -> None:
    """A backend's block events: over ZMQ in vLLM's format where ``route.kv_events`` names a publisher, else HTTP."""
    source = state.config.route.event_source(backend.url)
    if source is not None:
        await follow_zmq(state.fleet, backend, state.prompts, source)
    else:
        limit = state.config.route.max_event_line_bytes
        await follow(state.fleet, backend, state.prompts, client, token, limit)


def create_app(state: RouterState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), limits=limits) as client:
            route = state.config.route
            state.proxy = Proxy(state.fleet, client, Bounds.of(route), route.retries, state.counts)
            state.control.client = client
            token = state.config.route.backend_token
            secret = token.get_secret_value() if token is not None else None
            interval = state.config.route.health_interval_s
            tasks = [asyncio.create_task(health_loop(state.fleet, client, interval, secret))]
            tasks += [asyncio.create_task(_follow(state, b, client, secret)) for b in state.fleet.backends.values()]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    app = FastAPI(title="kvtier route", version="0.1.0", lifespan=lifespan, description=__doc__)
    registry = CollectorRegistry()
    registry.register(RouterCollector(state))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _infer(state, request, Endpoint.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _infer(state, request, Endpoint.COMPLETIONS)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _infer(state, request, Endpoint.MESSAGES)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _models(state, request)

    @app.get("/health")
    async def health() -> Response:
        up = len(state.fleet.up())
        return JSONResponse({"status": "ok" if up else "no_backend", "backends_up": up}, status_code=200 if up else 503)

    @app.get("/stats")
    async def get_stats() -> dict[str, Any]:
        return stats(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(routes(state.control))

    return app


def serve(config: Config, backends: list[str]) -> int:
    """``kvtier route``: bind first (a taken port is a one-line error), then read the model's tokenizer, then serve."""
    route = config.route
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(s) for s in listen_sockets(route.host, route.port)]
        state = build_state(config, backends)
        uv = uvicorn.Config(create_app(state), host=route.host, port=route.port, log_level="info", server_header=False)
        server = uvicorn.Server(uv)
        for sock in sockets:
            host, port = sock.getsockname()[:2]
            print(f"kvtier route on http://{host}:{port} over {len(backends)} backends ({route.policy})", flush=True)
        server.run(sockets=sockets)
    return 0 if server.started else 1
