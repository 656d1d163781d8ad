"""What an Anthropic Messages API client sends (``POST /v1/messages``), and the prompt it stands for.

Agent clients written against the Messages API (Claude Code's SDKs, the
``anthropic`` package) mark what they want cached with ``cache_control`` on
a block: the prompt up to and including that block is a prefix to keep. The
models here take the request in that shape: ``system`` as a string or text
blocks, ``messages`` whose content is a string or ``text``, ``tool_use`` and
``tool_result`` blocks, ``tools``, sampling and stopping. Fields this server
does not act on are ignored (clients send many); a block type it cannot
render (an image, a document) is refused by validation, never dropped.

:func:`rendered` turns a request into the conversation the chat template
renders, in the order the API caches it (tools, then system, then
messages), and notes where each breakpoint's block ends, so the server can
find the breakpoint's token count in the rendered prompt.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field

from kvtier.web.requests import MAX_MESSAGES, MAX_STOP, MAX_TOKENS_CAP, RequestBody, SessionId, StopString, Text

MAX_BREAKPOINTS = 4  # cache_control blocks per request, as the API allows


class CacheTTL(enum.StrEnum):
    """How long a marked prefix is kept from its last use."""

    FIVE_MINUTES = "5m"
    ONE_HOUR = "1h"

    @property
    def seconds(self) -> float:
        return 300.0 if self is CacheTTL.FIVE_MINUTES else 3600.0


class CacheControl(RequestBody):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: CacheTTL = CacheTTL.FIVE_MINUTES


class _Block(RequestBody):
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: Text


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: Text | list[TextBlock] = ""
    is_error: bool = False


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageRole(enum.StrEnum):
    USER = "user"
    ASSISTANT = "assistant"


class MessageParam(RequestBody):
    role: MessageRole
    content: Text | list[Block]


class Tool(RequestBody):
    name: str = Field(min_length=1, max_length=256)
    description: str = ""
    input_schema: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class Metadata(RequestBody):
    user_id: SessionId | None = Field(None, description="The agent session (X-Session-ID wins); scoped by tenant.")


class MessagesRequest(RequestBody):
    model: str | None = Field(None, description="Must name the served model (GET /v1/models) when given.")
    max_tokens: int = Field(ge=1, le=MAX_TOKENS_CAP)
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_MESSAGES)
    temperature: float = Field(1.0, ge=0.0, le=1.0, description="0: greedy (the API's default is 1).")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = Field(None, description="A mark on the request's last block.")


# -- the conversation the template renders ----------------------------------------------------------
@dataclass(frozen=True)
class Breakpoint:
    """A ``cache_control`` mark: the rendered conversation cut just after its block, and the prefix's TTL.

    ``upto`` is the conversation (template messages) ending with the marked
    block's text: the rendered prompt of ``upto``, without its closing, is
    the prefix the client asked to keep.
    """

    upto: list[dict[str, str]]
    ttl: CacheTTL


def _tool_text(tool: Tool) -> str:
    spec = {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema}
    return json.dumps(spec, sort_keys=True, ensure_ascii=False)


def _block_text(block: TextBlock | ToolUseBlock | ToolResultBlock) -> str:
    """A block as the model reads it: text as it is, tool calls and results in tags it can learn to follow."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ToolUseBlock):
        call = json.dumps(block.input, sort_keys=True, ensure_ascii=False)
        return f'<tool_use id="{block.id}" name="{block.name}">{call}</tool_use>'
    content = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
    error = ' is_error="true"' if block.is_error else ""
    return f'<tool_result tool_use_id="{block.tool_use_id}"{error}>{content}</tool_result>'


def _marks(block: TextBlock | ToolUseBlock | ToolResultBlock) -> list[CacheControl]:
    inner = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else []
    return [c for c in (block.cache_control, *(b.cache_control for b in inner)) if c is not None]


def rendered(body: MessagesRequest) -> tuple[list[dict[str, str]], list[Breakpoint]]:
    """The template's conversation for ``body`` and its breakpoints, in the prompt's order.

    Tools come first (one JSON line each, under a heading), then the system
    text, as one system message; each message's blocks are joined in order.
    A breakpoint on a block of a tool result's content marks the whole
    result (its text is not cut inside the tags).
    """
    parts: list[tuple[str, list[CacheControl]]] = []  # the system message's pieces
    if body.tools:
        parts.append(("Tools you may call, one JSON object each:\n", []))
        parts += [(_tool_text(t) + "\n", [t.cache_control] if t.cache_control else []) for t in body.tools]
    if isinstance(body.system, str):
        parts.append((body.system, []))
    elif body.system:
        parts += [(b.text, [b.cache_control] if b.cache_control else []) for b in body.system]
    conversation: list[dict[str, str]] = []
    marks: list[Breakpoint] = []
    if parts:
        text = ""
        for piece, controls in parts:
            text += piece
            marks += [Breakpoint([{"role": "system", "content": text}], c.ttl) for c in controls]
        conversation.append({"role": "system", "content": text})
    for message in body.messages:
        role = message.role.value
        if isinstance(message.content, str):
            conversation.append({"role": role, "content": message.content})
            continue
        text = ""
        for block in message.content:
            text += _block_text(block)
            marks += [Breakpoint([*conversation, {"role": role, "content": text}], c.ttl) for c in _marks(block)]
        conversation.append({"role": role, "content": text})
    if body.cache_control is not None:  # the request's own mark: on its last block, the end of its last message
        marks.append(Breakpoint(list(conversation), body.cache_control.ttl))
    return conversation, marks


__all__ = [
    "MAX_BREAKPOINTS",
    "Breakpoint",
    "CacheControl",
    "CacheTTL",
    "MessageParam",
    "MessagesRequest",
    "TextBlock",
    "Tool",
    "ToolResultBlock",
    "ToolUseBlock",
    "rendered",
]
