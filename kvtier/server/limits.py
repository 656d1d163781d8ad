"""What one client may hold of the server: a body's size, and how long a request may take to arrive.

:class:`BodyLimit` is a pure ASGI middleware, so an oversize body is
refused before anyone buffers it. A declared ``Content-Length`` over the
limit is answered 413 at once. A body sent without one (chunked) is counted
as it arrives; the moment it passes the limit the client gets 413 and the
app is told the client left, so it stops reading and whatever it might
still send is dropped.

:func:`read_timeout_protocol` bounds the time from a request's first byte
(or a connection's opening) to its last: uvicorn has no such timeout, so a
client that sends half a request and stops would hold its connection, and
its slot under ``server.max_connections``, forever.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvtier.server.errors import APIError, ErrorCode


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code=ErrorCode.REQUEST_TOO_LARGE)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await APIError(400, "invalid Content-Length").response()(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await _too_large(self.max_bytes).response()(scope, receive, send)
                return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        received, refused, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        await _too_large(self.max_bytes).response()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def app_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the client got its 413 (or is being cut off); the app's answer is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited_receive, app_send)


class _ReadTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request does not arrive whole in time."""

    read_timeout_s: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the request is whole (or the connection is done): the app has it

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.logger.info("closing a connection whose request did not arrive within %ss", self.read_timeout_s)
            self.transport.close()  # an app waiting for the body gets http.disconnect


def read_timeout_protocol(read_timeout_s: float) -> type[Any]:
    """The HTTP protocol class for ``uvicorn.Config(http=...)`` with this read timeout."""
    return type("ReadTimeoutH11", (_ReadTimeoutH11,), {"read_timeout_s": read_timeout_s})
