"""Forwarding a request to the ranked backends: the first that answers gets it, and its answer is relayed as is.

"Answers" means its first output arrived, and is an answer
(:mod:`kvtier.route.answer`): a refused connection, a 5xx, a body that is
not of the route's shape, an event stream that ends before output, or a
backend that misses ``route.first_byte_timeout_s`` is tried on the next
backend in the ranking (up to ``route.retries`` more), since nothing has
reached the client yet. In an event stream the first byte that counts is
the first event with output: the opening a stream sends before prefill (a
chat stream's role chunk, a Messages stream's ``message_start``) is held
back until then. After it the answer is committed: its
chunks go to the client as they arrive, unchanged (the router never
re-encodes an SSE stream), and the router holds no more of it than the
chunk in hand. An answer that is not a stream is held whole, to be checked.

While a request waits for its first output it counts in its backend's load
twice: one open request, and the tokens it is predicted to prefill there
(:meth:`~kvtier.route.backends.Fleet.prefill`), which the ``kvtier`` policy
weighs; the tokens leave the queue with the first output.

A refused or reset connection, or a missed bound, takes the backend out at
once (:meth:`~kvtier.route.backends.Fleet.take_out`): the next requests do
not wait for the health loop to notice. A broken answer or a 5xx leaves it
in. When every candidate failed, the last one's failure names the answer:
503 (none answered), 502 (a broken answer) or 504 (none in time), in the
route's own error shape (:class:`~kvtier.route.answer.Dialect`).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import http
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import httpx2 as httpx
from starlette.responses import Response, StreamingResponse

from kvtier.route.answer import (
    Bounds,
    Broken,
    Dialect,
    Refusal,
    Shape,
    Stalled,
    deadline,
    of_shape,
    opening,
    relayed,
    whole,
)
from kvtier.route.backends import Backend, Fleet
from kvtier.route.prompt import RoutedPrompt

# The caller's credentials go with the question (the backends' tenants decide): a bearer token, or the Messages
# API's x-api-key, with the version headers its clients send.
PASSED_HEADERS = (
    "authorization",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "content-type",
    "x-session-id",
    "x-request-id",
)
RELAYED_HEADERS = ("content-type", "cache-control")
BACKEND_HEADER = "X-Kvtier-Backend"
PREDICTED_HEADER = "X-Kvtier-Predicted-Cached-Tokens"  # on answers from the first choice: what it was chosen to skip
# Reads are bounded by route.first_byte_timeout_s and route.idle_timeout_s (kvtier.route.answer), not here.
TIMEOUT = httpx.Timeout(connect=2.0, read=None, write=30.0, pool=30.0)


@dataclass
class Counts:
    requests: int = 0
    retried: int = 0  # attempts moved to another backend before the first byte
    failed: int = 0  # requests no backend answered
    broken: int = 0  # answers that were not of the route's shape, retried or answered 502
    timed_out: int = 0  # backends that missed route.first_byte_timeout_s (or idle_timeout_s) before the first output
    cut: int = 0  # relayed streams ended because their backend fell silent past route.idle_timeout_s


@dataclass
class Proxy:
    """What forwarding needs, one per router: the fleet, the client to the backends, the bounds, the counts."""

    fleet: Fleet
    client: httpx.AsyncClient
    bounds: Bounds
    retries: int
    counts: Counts


@dataclass(frozen=True)
class Outgoing:
    """A request as sent to each backend tried, and the shape its answer must have."""

    method: http.HTTPMethod
    path: str
    body: bytes
    headers: Mapping[str, str]
    shape: Shape


def passed_headers(incoming: Mapping[str, str]) -> dict[str, str]:
    passed = {k: v for k, v in incoming.items() if k.lower() in PASSED_HEADERS}
    return {**passed, "accept-encoding": "identity"}  # what is checked and relayed is what the backend wrote


def refused(refusal: Refusal, message: str, dialect: Dialect) -> Response:
    return Response(refusal.body(message, dialect), status_code=refusal.status, media_type="application/json")


def unavailable(message: str, dialect: Dialect) -> Response:
    return refused(Refusal.NO_BACKEND, message, dialect)


class Failed(enum.Enum):
    """How an attempt failed before a byte reached the client; each is retried on the next backend."""

    UNREACHABLE = "unreachable"  # no connection, or it broke before the first output: the backend is taken out
    REFUSED = "refused"  # a 5xx (shutting down, full): the backend stays in
    BROKEN = "broken"  # an answer that is none (cut off, HTML, another shape): the backend stays in
    STALLED = "stalled"  # no first output within route.first_byte_timeout_s: the backend is taken out


LAST_WORD = {
    Failed.UNREACHABLE: (Refusal.NO_BACKEND, "no backend answered this request"),
    Failed.REFUSED: (Refusal.NO_BACKEND, "no backend answered this request"),
    Failed.BROKEN: (Refusal.BAD_ANSWER, "no backend answered this request with a complete answer"),
    Failed.STALLED: (Refusal.TIMED_OUT, "no backend answered this request within route.first_byte_timeout_s"),
}


@dataclass
class Answer:
    response: httpx.Response
    first: bytes  # the whole body of an answer that is no stream; an event stream's chunks up to its first output
    rest: AsyncIterator[bytes] | None  # an event stream's later chunks; None when ``first`` is all


async def _read(response: httpx.Response, shape: Shape, by: float, bounds: Bounds) -> Answer:
    """The answer up to what must be checked before it is relayed; raises :class:`Broken` or :class:`Stalled`."""
    chunks = response.aiter_raw()
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return Answer(response, await opening(chunks, by), chunks)
    body = await whole(chunks, by, bounds.idle_s)
    await response.aclose()
    if response.is_success and not of_shape(body, shape):
        raise Broken(f"a {response.status_code} answer that is not a JSON object with {shape.value!r}")
    return Answer(response, body, None)


async def _headers(proxy: Proxy, backend: Backend, request: Outgoing, by: float) -> httpx.Response | Failed:
    """The backend's status and headers, ``by`` then; its body is still to read."""
    url = backend.url + request.path
    sent = proxy.client.build_request(
        request.method, url, content=request.body, headers=request.headers, timeout=TIMEOUT
    )
    try:
        async with asyncio.timeout_at(by):
            response = await proxy.client.send(sent, stream=True)
    except TimeoutError:
        return Failed.STALLED
    except httpx.TransportError:
        return Failed.UNREACHABLE
    if response.status_code >= 500:
        await response.aclose()
        return Failed.REFUSED
    return response


async def _attempt(proxy: Proxy, backend: Backend, request: Outgoing) -> Answer | Failed:
    """Send to ``backend``; its answer, read as far as :func:`_read` goes, or how it failed before a byte."""
    by = deadline(proxy.bounds.first_byte_s)
    response = await _headers(proxy, backend, request, by)
    if isinstance(response, Failed):
        return response
    try:
        return await _read(response, request.shape, by, proxy.bounds)
    except Stalled:
        failed = Failed.STALLED
    except Broken:
        failed = Failed.BROKEN
    except httpx.TransportError:
        failed = Failed.UNREACHABLE
    await response.aclose()
    return failed


async def _sent(proxy: Proxy, backend: Backend, prompt: RoutedPrompt, request: Outgoing) -> Answer | Failed:
    """:func:`_attempt`, counted in the backend's load: one more open request, and its prefill queued there
    from sending until its first output (or its failure), when the prefill is over."""
    prefill = proxy.fleet.prefill(backend, prompt)
    backend.open_requests += 1
    backend.queued_tokens += prefill
    try:
        return await _attempt(proxy, backend, request)
    except asyncio.CancelledError:  # the client went away first: nothing will relay, so nothing else closes it
        backend.open_requests -= 1
        raise
    finally:
        backend.queued_tokens -= prefill


def _failed(proxy: Proxy, backend: Backend, failed: Failed) -> None:
    backend.open_requests -= 1
    backend.failures += 1
    if failed is Failed.BROKEN:
        proxy.counts.broken += 1
    elif failed is Failed.STALLED:
        proxy.counts.timed_out += 1
        proxy.fleet.take_out(backend, "no output within route.first_byte_timeout_s")
    elif failed is Failed.UNREACHABLE:
        proxy.fleet.take_out(backend, "failed before the first byte of an answer")


def _silent(proxy: Proxy, backend: Backend) -> None:
    """A relayed stream's backend fell silent past the idle bound: counted, and out as if its health failed."""
    proxy.counts.cut += 1
    backend.failures += 1
    proxy.fleet.take_out(backend, "silent past route.idle_timeout_s in the middle of an answer")


async def _relay(proxy: Proxy, backend: Backend, answer: Answer, dialect: Dialect) -> AsyncIterator[bytes]:
    assert answer.rest is not None
    silent = functools.partial(_silent, proxy, backend)
    try:
        async for chunk in relayed(answer.first, answer.rest, proxy.bounds.idle_s, silent, dialect):
            yield chunk
    finally:
        await answer.response.aclose()
        backend.open_requests -= 1


def _response(proxy: Proxy, backend: Backend, answer: Answer, dialect: Dialect, predicted: int | None) -> Response:
    headers = {k: v for k, v in answer.response.headers.items() if k.lower() in RELAYED_HEADERS}
    headers[BACKEND_HEADER] = backend.url
    if predicted is not None:
        headers[PREDICTED_HEADER] = str(predicted)
    status = answer.response.status_code
    if answer.rest is None:
        backend.open_requests -= 1
        return Response(answer.first, status_code=status, headers=headers)
    return StreamingResponse(_relay(proxy, backend, answer, dialect), status_code=status, headers=headers)


async def forward(
    proxy: Proxy, order: Sequence[str], prompt: RoutedPrompt, request: Outgoing, predicted: int | None = None
) -> Response:
    """Try the first ``1 + route.retries`` backends of ``order`` in turn; the first answer is relayed.

    ``predicted``: the cached tokens the first backend was chosen for, said in a header when it answers.
    """
    counts = proxy.counts
    counts.requests += 1
    last = Failed.UNREACHABLE
    for i, url in enumerate(order[: 1 + proxy.retries]):
        backend = proxy.fleet.backends[url]
        if i:
            counts.retried += 1
        got = await _sent(proxy, backend, prompt, request)
        if isinstance(got, Failed):
            _failed(proxy, backend, got)
            last = got
            continue
        backend.requests += 1
        proxy.fleet.routed(backend, prompt)
        return _response(proxy, backend, got, request.shape.dialect, predicted if i == 0 else None)
    counts.failed += 1
    return refused(*LAST_WORD[last], request.shape.dialect)
