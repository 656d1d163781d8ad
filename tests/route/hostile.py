"""Small hostile backends on 127.0.0.1 and the real router app in front of them, on one event loop.

A :class:`Peer` speaks just enough HTTP/1.1 over asyncio streams to misbehave
at will: hang before its headers or after them, trickle keep-alive comments,
answer 200 with HTML, send a line that never ends. Each handler is the peer's
behaviour on one path; every request's arrival is queued, so a test waits on
what the router did (its next request) instead of sleeping.

:func:`router` serves :func:`kvtier.route.app.create_app` with uvicorn on a
socket bound before it starts (a request waits in the backlog until the app
is up). The router reads no tokens here (:class:`Unkeyed`) and tries the
backends in the order the test gives (:class:`InOrder`), so which backend is
tried first is the test's to say.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx2 as httpx
import uvicorn

from kvtier.route.app import RouterState, create_app
from kvtier.route.backends import Backend, Fleet
from kvtier.route.choice import Ask, Candidate, Chooser, Ranking, Reason
from kvtier.route.prompt import Endpoint, RoutedPrompt
from kvtier.route.proxy import Counts
from tests.helpers import make_config

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
QUESTIONS: dict[str, dict[str, Any]] = {  # the smallest body each inference route takes
    CHAT: {"messages": [{"role": "user", "content": "Hello"}]},
    MESSAGES: {"max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]},
}
ROOT = "ab" * 16  # the key chain's root the router agrees on (a backend's event stream opens with it)
BOUND_S = 10.0  # how long a test waits for an event; only a router that never acts reaches it
JSON = "application/json"
SSE = "text/event-stream"


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Handler = Callable[[Request, asyncio.StreamWriter], Awaitable[None]]
T = TypeVar("T")


async def within(awaitable: Awaitable[T]) -> T:
    """``awaitable``, or a failed test when the router never brings it about."""
    return await asyncio.wait_for(awaitable, BOUND_S)


def head(status: int, content_type: str, length: int | None = None) -> bytes:
    """A status line and headers; without ``length`` the body runs until the peer closes."""
    framing = f"Content-Length: {length}" if length is not None else "Connection: close"
    return f"HTTP/1.1 {status} Whatever\r\nContent-Type: {content_type}\r\n{framing}\r\n\r\n".encode()


def reply(status: int, body: bytes | dict | list, content_type: str = JSON) -> Handler:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def handle(_: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(status, content_type, len(data)) + data)
        await writer.drain()

    return handle


async def hang(_: Request, __: asyncio.StreamWriter) -> None:
    """Reads the request and never answers."""
    await asyncio.Event().wait()


def then_hang(sent: bytes, content_type: str = SSE) -> Handler:
    """Headers, then ``sent``, then silence with the connection open."""

    async def handle(_: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, content_type) + sent)
        await writer.drain()
        await asyncio.Event().wait()

    return handle


def trickle(sent: bytes = b"", every_s: float = 0.05) -> Handler:
    """Headers, then ``sent``, then a keep-alive comment every ``every_s``, for ever."""

    async def handle(_: Request, writer: asyncio.StreamWriter) -> None:
        writer.write(head(200, SSE) + sent)
        while True:
            await writer.drain()
            await asyncio.sleep(every_s)  # the peer's own pace, not a test waiting
            writer.write(b": keep-alive\n\n")

    return handle


def chat_answer(text: str = "hi") -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": message}]}


def chat_event(text: str) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def message_answer(text: str = "hi") -> dict[str, Any]:
    """A whole Messages API answer, as ``kvtier serve`` writes one."""
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "toy",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    }


def message_event(kind: str, **payload: Any) -> bytes:
    """One event of a Messages stream: its name on an ``event:`` line, then its data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()


def text_event(text: str) -> bytes:
    return message_event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})


MESSAGES_OPENING = message_event(
    "message_start", message={**message_answer(), "content": [], "stop_reason": None}
) + message_event("content_block_start", index=0, content_block={"type": "text", "text": ""})
"""What a Messages stream sends before its prompt is prefilled."""
MESSAGES_ENDING = (
    message_event("content_block_stop", index=0)
    + message_event("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None}, usage={})
    + message_event("message_stop")
)


STATS = {"engine": {"in_flight": 0}}


class Peer:
    """One fake backend: ``routes`` maps a path to its behaviour; ``arrived[path]`` queues each request."""

    def __init__(self, routes: dict[str, Handler] | None = None) -> None:
        self.routes: dict[str, Handler] = {
            "/health": reply(200, {"status": "ok"}),
            "/stats": reply(200, STATS),
            "/v1/kv-events": hang,
            **(routes or {}),
        }
        self.arrived: defaultdict[str, asyncio.Queue[Request]] = defaultdict(asyncio.Queue)
        self.url = ""
        self._connections: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def next(self, path: str) -> Request:
        """The next request the router sends to ``path``."""
        return await within(self.arrived[path].get())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while (request := await _read_request(reader)) is not None:
                self.arrived[request.path].put_nowait(request)
                await self.routes.get(request.path, reply(404, {"detail": "Not Found"}))(request, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the router hung up: what a hostile peer expects
        except asyncio.CancelledError:
            pass  # stop() ends a connection so; a task that ended cancelled would be logged by asyncio's streams
        finally:
            writer.close()
            self._connections.discard(task)


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    first, *lines = raw.decode("latin-1").split("\r\n")
    method, target, _ = first.split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, target.split("?")[0], headers, body)


class Unkeyed:
    """The prompt reader of these tests: no tokenizer, no keys; a request is routed by the policy alone."""

    block_size = 16

    def read(self, endpoint: Endpoint, body: Any, key: str | None, session: str | None) -> RoutedPrompt:
        return RoutedPrompt(0, [], session, False)

    def agrees(self, root: str, block_size: int) -> bool:
        return root == ROOT and block_size == self.block_size


class InOrder(Chooser):
    """The live backends in the order the test listed them."""

    def __init__(self, order: Sequence[str]) -> None:
        super().__init__()
        self.order = list(order)

    def rank(self, ask: Ask, candidates: Sequence[Candidate]) -> Ranking:
        live = {c.name for c in candidates}
        return Ranking([url for url in self.order if url in live], Reason.ROTATION, 0)


@dataclass
class Router:
    url: str
    state: RouterState
    client: httpx.AsyncClient

    def backend(self, peer: Peer) -> Backend:
        return self.state.fleet.backends[peer.url]

    async def stats(self) -> dict[str, Any]:
        return (await self.client.get(self.url + "/stats")).json()

    async def chat(self, **body: Any) -> httpx.Response:
        """The router's whole answer to a chat request (a trickle that never ends fails the test at the bound)."""
        return await self.ask(CHAT, **body)

    async def ask(self, path: str, **body: Any) -> httpx.Response:
        """The router's whole answer to a request on the inference route ``path``, ``body`` over its smallest."""
        return await within(self.client.post(self.url + path, json={**QUESTIONS[path], **body}))


@contextlib.asynccontextmanager
async def peers(*routes: dict[str, Handler]) -> AsyncIterator[list[Peer]]:
    started = [Peer(r) for r in routes]
    try:
        for peer in started:
            await peer.start()
        yield started
    finally:
        for peer in started:
            await peer.stop()


@contextlib.asynccontextmanager
async def router(tmp: Path, backends: Sequence[Peer | str], up: bool = True, **route: Any) -> AsyncIterator[Router]:
    """The router app over ``backends`` (tried in that order), ``up`` from the start or once checked."""
    config = make_config(tmp, route={"health_interval_s": 3600.0, **route})
    urls = [b if isinstance(b, str) else b.url for b in backends]
    fleet = Fleet({url: Backend(url, up=up) for url in urls}, InOrder(urls), Unkeyed.block_size)
    state = RouterState(config, Unkeyed(), fleet, Counts())  # type: ignore[arg-type]  # no tokenizer needed
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    # A router that holds a request on a hung backend would hold its own shutdown too: it is cut off after the bound.
    app = uvicorn.Config(create_app(state), log_config=None, lifespan="on", timeout_graceful_shutdown=BOUND_S)
    server = uvicorn.Server(app)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(timeout=BOUND_S) as client:
            yield Router(f"http://127.0.0.1:{sock.getsockname()[1]}", state, client)
    finally:
        server.should_exit = True
        await serving
        sock.close()
