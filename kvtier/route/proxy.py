"""Forwarding a request to the ranked backends: the first that answers gets it, and its answer is relayed as is.

"Answers" means its first byte arrived: a refused connection, a 5xx, or a
stream that ends before its first chunk is retried on the next backend in
the ranking (up to ``route.retries`` more), since nothing has reached the
client yet. In an event stream the first byte that counts is the first
event with output: the opening chunk a chat stream sends before prefill is
held back until then (:func:`_carries_output`). After the first byte the answer is committed: its chunks go to
the client as they arrive, unchanged (the router never re-encodes an SSE
stream), and the router holds no more of it than the chunk in hand.

While a request waits for its first output it counts in its backend's load
twice: one open request, and the tokens it is predicted to prefill there
(:meth:`~kvtier.route.backends.Fleet.prefill`), which the ``kvtier`` policy
weighs; the tokens leave the queue with the first output.

A refused or reset connection takes the backend out at once
(:meth:`~kvtier.route.backends.Fleet.take_out`): the next requests do not
wait for the health loop to notice.
"""

from __future__ import annotations

import asyncio
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


def _carries_output(events: bytes) -> bool:
    """Whether these server-sent events hold generated text, an end, or an error: more than the opening.

    A chat stream opens with a chunk that only names the role, sent before
    the prompt is even prefilled; a backend that dies during its prefill
    has sent that much and no more. Holding such openings back keeps the
    request retryable until the backend has really answered.
    """
    for event in events.split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        data = event[len(b"data: ") :]
        if data.strip() == b"[DONE]":
            return True
        try:
            chunk = json.loads(data)
        except ValueError:
            return True  # not JSON: not an opening kvtier knows, so it is the answer
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not choices:
            return True  # an error event, or usage alone
        for c in choices:
            if c.get("text") or c.get("finish_reason") or (c.get("delta") or {}).get("content"):
                return True
    return False


async def _first_bytes(response: httpx.Response, stream: AsyncIterator[bytes]) -> bytes:
    """The answer's first chunks, up to one with output for an event stream (b"" for an empty body).

    Raises if the backend fails before them; until then nothing reached the client.
    """
    sse = response.headers.get("content-type", "").startswith("text/event-stream")
    held = b""
    async for chunk in stream:
        held += chunk
        if held and (not sse or _carries_output(held)):
            break
    return held


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
        first = await _first_bytes(response, chunks)
    except httpx.TransportError:
        await response.aclose()
        return Failed.UNREACHABLE
    return response, chunks, first


async def _sent(
    fleet: Fleet, client: httpx.AsyncClient, backend: Backend, prompt: RoutedPrompt, request: tuple[str, bytes, dict]
) -> tuple[httpx.Response, AsyncIterator[bytes], bytes] | Failed:
    """:func:`_attempt`, counted in the backend's load: one more open request, and its prefill queued there
    from sending until its first output (or its failure), when the prefill is over."""
    prefill = fleet.prefill(backend, prompt)
    backend.open_requests += 1
    backend.queued_tokens += prefill
    try:
        return await _attempt(client, backend, *request)
    except asyncio.CancelledError:  # the client went away first: nothing will relay, so nothing else closes it
        backend.open_requests -= 1
        raise
    finally:
        backend.queued_tokens -= prefill


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
        got = await _sent(fleet, client, backend, prompt, (path, body, headers))
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
