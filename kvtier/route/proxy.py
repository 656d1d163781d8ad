"""Forwarding a request to the ranked backends: the first that answers gets it, and its answer is relayed as is.

"Answers" means its first byte arrived: a refused connection, a 5xx, or a
stream that ends before its first chunk is retried on the next backend in
the ranking (up to ``route.retries`` more), since nothing has reached the
client yet. After the first byte the answer is committed: its chunks go to
the client as they arrive, unchanged (the router never re-encodes an SSE
stream), and the router holds no more of it than the chunk in hand.

A refused or reset connection takes the backend out at once
(:meth:`~kvtier.route.backends.Fleet.take_out`): the next requests do not
wait for the health loop to notice.
"""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx2 as httpx
from starlette.responses import Response, StreamingResponse

from kvtier.route.backends import Backend, Fleet
from kvtier.route.choice import Ranking
from kvtier.route.prompt import RoutedPrompt

PASSED_HEADERS = ("authorization", "content-type", "x-session-id", "x-request-id")
BACKEND_HEADER = "X-Kvtier-Backend"
TIMEOUT = httpx.Timeout(connect=2.0, read=600.0, write=30.0, pool=30.0)


@dataclass
class Counts:
    requests: int = 0
    retried: int = 0  # attempts moved to another backend before the first byte
    failed: int = 0  # requests no backend answered


def _headers(incoming: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in incoming.items() if k.lower() in PASSED_HEADERS}


def unavailable(message: str) -> Response:
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": "no_backend"}}
    return Response(json.dumps(body), status_code=503, media_type="application/json")


class Failed(enum.Enum):
    UNREACHABLE = "unreachable"  # no connection, or it broke before the first byte: the backend is taken out
    REFUSED = "refused"  # a 5xx (shutting down, full): tried elsewhere, the backend stays in


async def _first_byte(stream: AsyncIterator[bytes]) -> bytes:
    """The answer's first chunk (b"" for an empty body); raises if the backend fails before it."""
    async for chunk in stream:
        if chunk:
            return chunk
    return b""


async def _relay(
    first: bytes, rest: AsyncIterator[bytes], response: httpx.Response, backend: Backend
) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        await response.aclose()
        backend.open_requests -= 1


async def _attempt(
    client: httpx.AsyncClient, backend: Backend, path: str, body: bytes, headers: dict[str, str]
) -> tuple[httpx.Response, AsyncIterator[bytes], bytes] | Failed:
    """Send to ``backend``; the response, its chunk stream and first chunk, or how it failed before a byte."""
    request = client.build_request("POST", backend.url + path, content=body, headers=headers, timeout=TIMEOUT)
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError:
        return Failed.UNREACHABLE
    if response.status_code >= 500:
        await response.aclose()
        return Failed.REFUSED
    chunks = response.aiter_raw()
    try:
        first = await _first_byte(chunks)
    except httpx.TransportError:
        await response.aclose()
        return Failed.UNREACHABLE
    return response, chunks, first


async def forward(
    fleet: Fleet,
    client: httpx.AsyncClient,
    ranking: Ranking,
    prompt: RoutedPrompt,
    request: tuple[str, bytes, Mapping[str, str]],
    retries: int,
    counts: Counts,
) -> Response:
    """``request`` is (path, body, headers); tries the ranking's first ``1 + retries`` backends in order."""
    path, body, incoming = request
    headers = _headers(incoming)
    counts.requests += 1
    for i, url in enumerate(ranking.order[: 1 + retries]):
        backend = fleet.backends[url]
        if i:
            counts.retried += 1
        backend.open_requests += 1
        got = await _attempt(client, backend, path, body, headers)
        if isinstance(got, Failed):
            backend.open_requests -= 1
            backend.failures += 1
            if got is Failed.UNREACHABLE:
                fleet.take_out(backend, "failed before the first byte of an answer")
            continue
        response, chunks, first = got
        backend.requests += 1
        fleet.routed(backend, prompt)
        out = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "cache-control")}
        out[BACKEND_HEADER] = url
        return StreamingResponse(
            _relay(first, chunks, response, backend), status_code=response.status_code, headers=out
        )
    counts.failed += 1
    return unavailable("no backend answered this request")
