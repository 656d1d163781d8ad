"""A backend's answer, read under the router's bounds: checked before any of it is relayed, watched after.

Until a byte reaches the client, a backend that hangs, trickles or sends
something other than an answer costs only a retry elsewhere
(:mod:`kvtier.route.proxy`); so the router reads that far itself:

* an answer that is not an event stream is read whole (up to
  ``MAX_ANSWER_BYTES``), and a 2xx one must be a JSON object holding the
  route's list (:class:`Shape`): a cut-off body, an HTML page or another
  object is :class:`Broken`;
* an event stream is held up to its first event with output (a chat stream
  opens with a chunk naming the role, a Messages stream with
  ``message_start`` and ``content_block_start``, before the prompt is
  prefilled), up to ``MAX_OPENING_BYTES``; one that ends before is
  :class:`Broken`.

Time is bounded twice: ``route.first_byte_timeout_s`` from sending the
request to that first output (an unstreamed answer's first byte), then
``route.idle_timeout_s`` between data events. A keep-alive comment (a line
starting with ``:``) is no data event, so a backend that only trickles
those misses its bound like a silent one (:class:`Stalled`). Once a
stream is relayed, a backend that falls silent past the idle bound has its
stream ended for the client with an error event. The router's own errors
speak the route's API (:class:`Dialect`): OpenAI's shape on its routes,
Anthropic's on ``/v1/messages``, whose clients raise by that shape.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from kvtier.config import RouteConfig

MAX_ANSWER_BYTES = 64 * 1024**2  # an unstreamed answer held whole to be checked: a flood must not hold more
MAX_OPENING_BYTES = 1024**2  # an event stream held before its first output: openings and comments are small


class Dialect(enum.Enum):
    """The API a route speaks, which the router's own errors must speak too: its clients parse that shape."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


class Shape(enum.StrEnum):
    """The list a complete answer of a route holds (``choices`` of a completion, ``data`` of a model list,
    ``content`` of a Messages API message, whose ``type`` must also be ``"message"``)."""

    CHOICES = "choices"
    DATA = "data"
    CONTENT = "content"

    @property
    def dialect(self) -> Dialect:
        """The API whose answer this is, so the one the router's own errors on the route speak."""
        return Dialect.ANTHROPIC if self is Shape.CONTENT else Dialect.OPENAI


class _Choices(msgspec.Struct):
    choices: list[msgspec.Raw]  # the items are the client's to read: only the shape is checked


class _Data(msgspec.Struct):
    data: list[msgspec.Raw]


class _Message(msgspec.Struct):
    type: Literal["message"]  # an error object has a ``type`` too ("error"): a message must say it is one
    content: list[msgspec.Raw]


_SHAPES = {
    Shape.CHOICES: msgspec.json.Decoder(_Choices),
    Shape.DATA: msgspec.json.Decoder(_Data),
    Shape.CONTENT: msgspec.json.Decoder(_Message),
}


class Refusal(enum.Enum):
    """The router's own error answers: (HTTP status, OpenAI error type, OpenAI code, Anthropic error type).

    Anthropic's types are the API's own for these statuses (its SDK names
    ``overloaded_error`` and ``timeout_error``; a bad gateway is an ``api_error``).
    """

    NO_BACKEND = (503, "service_unavailable", "no_backend", "overloaded_error")
    BAD_ANSWER = (502, "bad_gateway", "bad_backend_answer", "api_error")
    TIMED_OUT = (504, "gateway_timeout", "backend_timeout", "timeout_error")

    @property
    def status(self) -> int:
        return self.value[0]

    def body(self, message: str, dialect: Dialect) -> bytes:
        _, kind, code, anthropic = self.value
        if dialect is Dialect.ANTHROPIC:
            return json.dumps({"type": "error", "error": {"type": anthropic, "message": message}}).encode()
        return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()

    def event(self, message: str, dialect: Dialect) -> bytes:
        """The error as the events that end a stream: OpenAI's data event and ``[DONE]``; Anthropic's ``error``."""
        if dialect is Dialect.ANTHROPIC:
            return b"event: error\ndata: " + self.body(message, dialect) + b"\n\n"
        return b"data: " + self.body(message, dialect) + b"\n\n" + b"data: [DONE]\n\n"


class Stalled(Exception):
    """The backend missed a bound: no first output in time, or too long without a data event."""


class Broken(Exception):
    """The backend's answer is not one: not of the route's shape, too large, or a stream that ended unanswered."""


@dataclass(frozen=True)
class Bounds:
    first_byte_s: float
    idle_s: float

    @classmethod
    def of(cls, route: RouteConfig) -> Bounds:
        return cls(route.first_byte_timeout_s, route.idle_timeout_s)


def deadline(after_s: float) -> float:
    """A moment ``after_s`` from now on the event loop's clock, which the bounds are kept on."""
    return asyncio.get_running_loop().time() + after_s


async def _next(chunks: AsyncIterator[bytes], by: float) -> bytes | None:
    """The next chunk, None at the end; :class:`Stalled` if it has not come ``by`` then."""
    try:
        async with asyncio.timeout_at(by):
            return await anext(chunks)
    except StopAsyncIteration:
        return None
    except TimeoutError as err:
        raise Stalled("no data in time") from err


def of_shape(body: bytes, shape: Shape) -> bool:
    """Whether ``body`` is a complete JSON object holding the list ``shape`` names (and, for a message, saying so)."""
    try:
        _SHAPES[shape].decode(body)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


async def whole(chunks: AsyncIterator[bytes], by: float, idle_s: float) -> bytes:
    """An unstreamed answer's body: its first byte ``by`` then, each next chunk within ``idle_s``."""
    body = bytearray()
    while (chunk := await _next(chunks, by)) is not None:
        body += chunk
        if len(body) > MAX_ANSWER_BYTES:
            raise Broken(f"an answer over {MAX_ANSWER_BYTES} bytes")
        by = deadline(idle_s)
    return bytes(body)


OPENINGS = frozenset({b"message_start", b"content_block_start", b"ping"})
"""Named events that hold no output: a Messages stream's opening, and the API's keep-alive."""


def carries_output(events: bytes) -> bool:
    """Whether these server-sent events hold generated text, an end, or an error: more than the opening.

    A chat stream opens with a chunk that only names the role, and a
    Messages stream with ``message_start`` and ``content_block_start``,
    sent before the prompt is even prefilled; a backend that dies during
    its prefill has sent that much and no more. Holding such openings back
    keeps the request retryable until the backend has really answered.
    A named event (``event:`` line) is judged by its name, any name but an
    opening's being output; an unnamed one by its data, as a chat chunk.
    """
    for event in events.split(b"\n\n"):
        name, data = _fields(event)
        if name is not None:
            if name not in OPENINGS:
                return True
        elif data is not None and _data_has_output(data):
            return True
    return False


def _fields(event: bytes) -> tuple[bytes | None, bytes | None]:
    """An event's name and data (its data lines joined, as the SSE spec joins them); comments skipped."""
    name, data = None, []
    for line in event.split(b"\n"):
        field, _, value = line.partition(b":")
        value = value.removeprefix(b" ")
        if field == b"event":
            name = value.strip()
        elif field == b"data":
            data.append(value)
    return name, b"\n".join(data) if data else None


def _data_has_output(data: bytes) -> bool:
    if data.strip() == b"[DONE]":
        return True
    try:
        chunk = json.loads(data)
    except (ValueError, RecursionError):
        return True  # not JSON: not an opening kvtier knows, so it is the answer
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or not choices:
        return True  # an error event, or usage alone
    return any(not isinstance(c, dict) or _has_output(c) for c in choices)


def _has_output(choice: dict) -> bool:
    delta = choice.get("delta")
    return bool(choice.get("text") or choice.get("finish_reason") or (isinstance(delta, dict) and delta.get("content")))


async def opening(chunks: AsyncIterator[bytes], by: float) -> bytes:
    """An event stream's chunks up to the first event with output, which must come ``by`` then.

    Only events not yet looked at are parsed, so a trickle of comments costs
    each byte once.
    """
    held, looked = bytearray(), 0  # events before ``looked`` were parsed, and held no output
    while (chunk := await _next(chunks, by)) is not None:
        new = max(len(held) - 1, looked)  # a blank line may straddle two chunks
        held += chunk
        end = held.rfind(b"\n\n", new)
        if end >= looked:
            if carries_output(bytes(held[looked:end])):
                return bytes(held)
            looked = end + 2
        if len(held) > MAX_OPENING_BYTES:
            raise Broken(f"{MAX_OPENING_BYTES} bytes of an event stream without output")
    if carries_output(bytes(held[looked:])):
        return bytes(held)  # its last event, the blank line after it missing
    raise Broken("an event stream that ended before any output")


class Lines:
    """Where an event stream stands, chunk by chunk: whether a field line (no comment) ended; where an event ends.

    Only the first byte of the line under way is kept, whatever its length.
    """

    def __init__(self) -> None:
        self._head: bytes | None = None  # first byte of the line under way; None at the start of a line
        self._open = False  # a field line ended and no blank line yet: the event is not dispatched

    def feed(self, chunk: bytes) -> bool:
        """Whether ``chunk`` ended a line that was a field (``data:``, ``event:``...), not a comment or blank."""
        *ended, rest = chunk.split(b"\n")
        fields = False
        for i, line in enumerate(ended):
            head = self._head if i == 0 and self._head is not None else line[:1]
            if head in (b"", b"\r"):
                self._open = False
            elif head != b":":
                fields = self._open = True
        if ended or self._head is None:
            self._head = rest[:1] or None
        return fields

    def closing(self) -> bytes:
        """What ends the event under way, so that an event of the router's own can follow."""
        if self._head is not None:
            return b"\n\n"
        return b"\n" if self._open else b""


SILENCE = "the backend sent nothing for longer than route.idle_timeout_s; the answer is cut short"


async def relayed(
    first: bytes, rest: AsyncIterator[bytes], idle_s: float, on_silence: Callable[[], None], dialect: Dialect
) -> AsyncIterator[bytes]:
    """An event stream as it arrives, unchanged; past ``idle_s`` without a data event, an error event in
    ``dialect`` and the end.

    ``on_silence`` is called then, before the error event is sent.
    """
    lines = Lines()
    lines.feed(first)
    yield first
    by = deadline(idle_s)
    while True:
        try:
            chunk = await _next(rest, by)
        except Stalled:
            on_silence()
            yield lines.closing() + Refusal.TIMED_OUT.event(SILENCE, dialect)
            return
        if chunk is None:
            return
        if lines.feed(chunk):
            by = deadline(idle_s)
        yield chunk
