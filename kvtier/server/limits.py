"""The request body limit: a pure ASGI middleware, so an oversize body is refused before anyone buffers it.

A declared ``Content-Length`` over the limit is answered 413 at once. A
body sent without one (chunked) is counted as it arrives; the moment it
passes the limit the client gets 413 and the app is told the client left,
so it stops reading and whatever it might still send is dropped.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
