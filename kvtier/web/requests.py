"""What a client sends: OpenAI-compatible request bodies, read alike by ``kvtier serve`` and ``kvtier route``.

The router parses a request to find its prompt's blocks before it picks a
backend; the server parses it to serve it. One definition keeps the two
from disagreeing about what a prompt is. Request models ignore fields they
do not know (OpenAI clients send many optional ones), but declare, with
bounds, every field that changes the answer, so the OpenAPI schema tells a
client (and a fuzzer) what is accepted. Fields that would silently change
the meaning if ignored (``n``) are declared with the one value served. No
request model has a namespace field: the server derives it from the
caller's API key.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# The schema's bound for max_tokens; the served schema shows server.max_tokens_limit instead (see app.py).
MAX_TOKENS_CAP = 8192
MAX_STOP = 4
MAX_MESSAGES = 1024

# Below this a temperature is served as greedy: logits divided by a vanishing one overflow (as vLLM does).
GREEDY_BELOW = 1e-5
# top_p is compared in float32, where a tiny one is 0 and would drop every token: served as this instead
# (which keeps only the most likely token, as any top_p that small does).
MIN_TOP_P = 1e-6


def _unicode(text: str) -> str:
    """JSON can carry lone surrogates (``"\ud800"``); no tokenizer can encode them, so they are a 422 here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (no lone surrogates)") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
# The bounds come before the validator, so they apply to the string itself: a too-long
# stop reads "String should have at most 256 characters", not a length of "items".
StopString = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore")


SessionId = Annotated[str, Field(min_length=1, max_length=256)]


class Role(enum.StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


class TextPart(RequestBody):
    type: Literal["text"] = "text"
    text: Text


class ChatMessage(RequestBody):
    role: Role
    content: Text | list[TextPart] = ""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


def as_template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """What the chat template sees: plain role/content strings, nothing else the client sent."""
    return [{"role": m.role.value, "content": m.text()} for m in messages]


class PromptCacheRetention(enum.StrEnum):
    """OpenAI's ``prompt_cache_retention``: how long the prompt is promised to stay cached."""

    IN_MEMORY = "in_memory"  # no promise: the cache keeps what its policies keep
    DAY = "24h"  # the whole prompt's full blocks, kept for a day from this request

    @property
    def seconds(self) -> float:
        """The promise's TTL; 0: none."""
        return 86400.0 if self is PromptCacheRetention.DAY else 0.0


class StreamOptions(RequestBody):
    include_usage: bool = False


class _Generation(RequestBody):
    """What both OpenAI endpoints share: the model, sampling, stopping and streaming."""

    model: str | None = Field(None, description="Must name the served model (GET /v1/models) when given.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(1.0, ge=0.0, le=2.0, description=f"0 (or below {GREEDY_BELOW}): greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description=f"Below {MIN_TOP_P}: served as {MIN_TOP_P}.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is served.")
    user: SessionId | None = Field(None, description="The agent session (X-Session-ID wins); scoped by tenant.")
    prompt_cache_key: SessionId | None = Field(
        None, description="OpenAI's cache key: requests that share it are one session (before user; the header wins)."
    )
    prompt_cache_retention: PromptCacheRetention | None = Field(
        None,
        description=(
            '"24h": the prompt\'s full blocks are kept for a day from this request, on disk (in host memory where '
            'the server has no disk tier), within the tenant\'s quota. "in_memory" (or none): no promise.'
        ),
    )

    @property
    def session_name(self) -> str | None:
        """The session the body names: its ``prompt_cache_key``, else its ``user``."""
        return self.prompt_cache_key or self.user

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generation):
    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] = Field(
        description="Text, or token ids (each below the model's vocabulary size)."
    )


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_CAP, description="Wins over max_tokens.")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
