"""The two OpenAI endpoints' work: request body -> token ids and sampling -> the engine -> JSON or SSE.

Everything that can be wrong with a request is checked here, before the
engine sees it, and answered with a 4xx naming the problem: an unknown
model, an empty prompt, a token id outside the vocabulary, a prompt that
does not fit the context, a max_tokens above the server's limit, a request
larger than the engine's KV pool. The engine thread then only ever gets
requests it can run, so nothing one client sends can fail a step that
other clients' requests share.

Tokenizing and rendering the chat template run on a worker thread (a 1 MiB
prompt takes a while), never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import jinja2
from starlette.types import Message

from kvtier.engine.sampling import SamplingParams
from kvtier.keys import KeyedTokens
from kvtier.server.errors import APIError, ErrorCode, ErrorType
from kvtier.server.loop import Arrival, ClientGone, EngineUnavailable, Failure, Outcome, Stream, Submission
from kvtier.server.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    Finish,
    PromptTokensDetails,
    Usage,
)
from kvtier.server.state import ServerState
from kvtier.web.auth import Tenant
from kvtier.web.requests import (
    GREEDY_BELOW,
    MIN_TOP_P,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PromptCacheRetention,
    as_template_messages,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: KeyedTokens  # keyed once here, for the session, the engine, its lookup, fetch and stores
    params: SamplingParams
    tenant: Tenant
    include_usage: bool
    session: str | None = None  # the agent session it is a turn of (kvtier.server.sessions)
    conversation: list[dict[str, str]] | None = None  # a chat's messages as the template reads them: its next turn


# -- from a body to a job ---------------------------------------------------------------------
def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves '{state.model_name}'.",
            type=ErrorType.NOT_FOUND,
            code=ErrorCode.MODEL_NOT_FOUND,
            param="model",
        )


async def prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return list(prompt)
    return await asyncio.to_thread(state.loaded.tokenizer.encode_text, prompt)  # text, never control tokens


async def chat_ids(state: ServerState, messages: list[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
    """A conversation's ids; without ``add_generation_prompt``, the prefix any continuation of it starts with."""
    return await template_ids(state, as_template_messages(messages), add_generation_prompt=add_generation_prompt)


async def template_ids(
    state: ServerState, conversation: list[dict[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """The chat template's ids for plain role/content messages, on a worker thread; its refusal is a 400."""
    try:
        return await asyncio.to_thread(state.loaded.chat_ids, conversation, add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as err:  # the template's own checks (e.g. roles must alternate)
        raise APIError(400, f"the chat template rejected the messages: {err}", param="messages") from None


class PromptField(enum.StrEnum):
    """The field a request's prompt came from: what a 400 about its length names, as OpenAI's do."""

    PROMPT = "prompt"
    MESSAGES = "messages"


def check_prompt(state: ServerState, ids: list[int], max_tokens: int, source: PromptField = PromptField.PROMPT) -> None:
    """Refuse, with a clear 400, every request the engine could not run."""
    limits = state.loop.limits
    if not ids:
        raise APIError(400, "the prompt is empty", code=ErrorCode.INVALID_PROMPT, param=source)
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})",
            code=ErrorCode.INVALID_PROMPT,
            param="prompt",
        )
    if len(ids) >= limits.context_length:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.context_length} tokens; "
            f"you sent {len(ids)} tokens in the {source}. Shorten the {source}.",
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param=source,
        )
    limit = state.config.server.max_tokens_limit
    if max_tokens > limit:
        raise APIError(
            400,
            f"max_tokens is {max_tokens}; this server allows at most {limit}",
            code=ErrorCode.MAX_TOKENS_TOO_LARGE,
            param="max_tokens",
        )
    if len(ids) + max_tokens > limits.context_length:
        raise APIError(
            400,
            f"This model's maximum context length is {limits.context_length} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the {source}, {max_tokens} in the completion). "
            f"Shorten the {source} or lower max_tokens.",
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param="max_tokens",
        )
    need = limits.blocks_needed(len(ids), max_tokens)
    if need > limits.pool_blocks:
        raise APIError(
            400,
            f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) needs {need} KV blocks; "
            f"this server's KV pool holds {limits.pool_blocks}. Shorten the prompt or lower max_tokens.",
            code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            param="max_tokens",
        )


def _job(
    state: ServerState,
    prefix: str,
    ids: list[int],
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    tenant: Tenant,
) -> Job:
    source = PromptField.MESSAGES if isinstance(body, ChatCompletionRequest) else PromptField.PROMPT
    check_prompt(state, ids, max_tokens, source)
    temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=max(body.top_p, MIN_TOP_P),
        seed=body.seed,
        stop=body.stop_strings(),
    )
    prompt = state.cache.keyed(ids, tenant.namespace)
    return Job(f"{prefix}-{secrets.token_hex(12)}", prompt, params, tenant, body.include_usage)


async def completion_job(state: ServerState, body: CompletionRequest, tenant: Tenant) -> Job:
    check_model(state, body.model)
    ids = await prompt_ids(state, body.prompt)
    # A default is the server's to keep within its own limits: a client that sent none is never refused for it.
    room = state.loop.limits.context_length - len(ids)
    default = max(1, min(COMPLETION_DEFAULT_MAX_TOKENS, state.config.server.max_tokens_limit, room))
    max_tokens = body.max_tokens if body.max_tokens is not None else default
    return _job(state, "cmpl", ids, body, max_tokens, tenant)


async def chat_job(state: ServerState, body: ChatCompletionRequest, tenant: Tenant) -> Job:
    check_model(state, body.model)
    conversation = as_template_messages(body.messages)
    ids = await template_ids(state, conversation)
    requested = body.requested_max_tokens()
    max_tokens = requested if requested is not None else default_chat_max_tokens(state, len(ids))
    job = _job(state, "chatcmpl", ids, body, max_tokens, tenant)
    return dataclasses.replace(job, conversation=conversation)


def default_chat_max_tokens(state: ServerState, prompt_tokens: int) -> int:
    """OpenAI's chat default is "until the context ends": here, as far as the limit, the context and the pool allow."""
    limits = state.loop.limits
    room = min(limits.context_length, limits.pool_blocks * limits.block_size) - prompt_tokens
    return max(1, min(state.config.server.max_tokens_limit, room))


async def retain(state: ServerState, job: Job, retention: PromptCacheRetention | None) -> bool:
    """``prompt_cache_retention: "24h"``: keep the prompt's full blocks for a day from now; whether they are kept.

    On disk, within the tenant's disk quota (``retain_disk_bytes``), where
    the cache runs a disk tier; a node without one keeps them in host
    memory within the host quota (``retain_bytes``) instead
    (:meth:`~kvtier.server.retention.Retention.lasting_tier`). Pinned before
    the run, as a ``cache_control`` mark is: the blocks the run stores are
    written to disk as they are stored, those cached already at once. A
    prompt larger than the quota is not kept; the request is served all
    the same. ``"in_memory"`` promises nothing.
    """
    if retention is None or not retention.seconds:
        return False
    r = state.retention
    (kept,) = await asyncio.to_thread(r.keep, job.tenant.name, [(job.prompt, retention.seconds)], r.lasting_tier())
    return kept


async def renew(state: ServerState, job: Job) -> None:
    """A prompt that starts with prefixes its tenant was promised renews those promises (see Retention.used)."""
    if state.retention.holds(job.tenant.name):
        await asyncio.to_thread(state.retention.used, job.tenant.name, job.prompt)


# -- running it ------------------------------------------------------------------------------------
def submit(state: ServerState, job: Job, arrival: Arrival | None = None) -> Stream:
    stream = Stream()
    try:
        session = None if job.session is None else (job.tenant.namespace, job.session)
        state.loop.submit(Submission(job.request_id, job.prompt, job.params, stream, session), arrival)
    except EngineUnavailable as err:
        raise APIError(503, str(err), type=ErrorType.UNAVAILABLE, code=ErrorCode.SHUTTING_DOWN) from None
    return stream


def failure_error(outcome: Outcome) -> APIError:
    if outcome.failure is Failure.REJECTED:
        return APIError(400, outcome.message, code=ErrorCode.INVALID_PROMPT)
    if outcome.failure is Failure.SHUTDOWN:
        return APIError(503, outcome.message, type=ErrorType.UNAVAILABLE, code=ErrorCode.SHUTTING_DOWN)
    return APIError(500, outcome.message, type=ErrorType.SERVER, code=ErrorCode.INTERNAL)


async def disconnected(receive: Callable[[], Awaitable[Message]]) -> None:
    """Returns when the client closes the connection.

    Call it once the request body has been read: the server's next message
    is then ``http.disconnect``, sent the moment the connection drops (or
    when the response is complete, by which time nobody awaits this).
    """
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_to_end(state: ServerState, job: Job, stream: Stream, gone: asyncio.Future[None]) -> Outcome | None:
    """The request's outcome; None when the client left first (the request is then aborted in the engine)."""
    try:
        async for event in stream.events(gone):
            if isinstance(event, Outcome):
                if event.failure is not None:
                    raise failure_error(event)
                state.note_outcome(job, event)
                return event
    except ClientGone:
        state.loop.abort(job.request_id)
        return None
    raise AssertionError("a stream always ends with an Outcome")


def usage(outcome: Outcome) -> Usage:
    return Usage(
        prompt_tokens=outcome.prompt_tokens,
        completion_tokens=outcome.completion_tokens,
        total_tokens=outcome.prompt_tokens + outcome.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=outcome.cached_tokens),
    )


def completion_response(state: ServerState, job: Job, outcome: Outcome) -> CompletionResponse:
    choice = CompletionChoice(text=outcome.text, finish_reason=Finish.of(outcome.finish_reason))
    return CompletionResponse(
        id=job.request_id, created=int(time.time()), model=state.model_name, choices=[choice], usage=usage(outcome)
    )


def chat_response(state: ServerState, job: Job, outcome: Outcome) -> ChatCompletionResponse:
    choice = ChatChoice(message=AssistantMessage(content=outcome.text), finish_reason=Finish.of(outcome.finish_reason))
    return ChatCompletionResponse(
        id=job.request_id, created=int(time.time()), model=state.model_name, choices=[choice], usage=usage(outcome)
    )


# -- server-sent events ---------------------------------------------------------------------------
def _event(payload: str) -> str:
    return f"data: {payload}\n\n"


class _Chunks:
    """The SSE chunks of one streamed response: one ``id`` and ``created`` for all of them, as OpenAI does."""

    def __init__(self, state: ServerState, job: Job, chat: bool) -> None:
        self.id, self.model, self.chat = job.request_id, state.model_name, chat
        self.created = int(time.time())

    def opening(self) -> str | None:
        return self._chat(ChatDelta(role="assistant", content=""), None) if self.chat else None

    def text(self, text: str) -> str:
        return self._chat(ChatDelta(content=text), None) if self.chat else self._completion(text, None)

    def finish(self, reason: Finish) -> str:
        return self._chat(ChatDelta(), reason) if self.chat else self._completion("", reason)

    def usage(self, u: Usage) -> str:
        if self.chat:
            chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=u)
            return _event(chunk.model_dump_json())
        done = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=u)
        return _event(done.model_dump_json())

    def _chat(self, delta: ChatDelta, reason: Finish | None) -> str:
        choice = ChatChunkChoice(delta=delta, finish_reason=reason)
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])
        return _event(chunk.model_dump_json(exclude_none=True))

    def _completion(self, text: str, reason: Finish | None) -> str:
        choice = CompletionChoice(text=text, finish_reason=reason)
        chunk = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])
        return _event(chunk.model_dump_json())


async def ending(
    state: ServerState, job: Job, gone: asyncio.Future[None], body: AsyncIterator[str]
) -> AsyncIterator[str]:
    """A streamed response's ``body``, relayed; a client that leaves before its end aborts the request.

    A client gone is noticed by ``gone`` (the body's events end with
    :class:`ClientGone`) or by a write to its closed connection closing this
    generator; either way the engine drops the request within a step. An
    abort of a request that already ended is a no-op.
    """
    finished = False
    try:
        async with contextlib.aclosing(body):
            async for chunk in body:
                yield chunk
        finished = True
    except ClientGone:
        pass
    finally:
        gone.cancel()
        if not finished:
            state.loop.abort(job.request_id)


def sse(state: ServerState, job: Job, stream: Stream, gone: asyncio.Future[None], *, chat: bool) -> AsyncIterator[str]:
    """The response body of a streamed request; a failure after the 200 is sent is an ``error`` event."""
    return ending(state, job, gone, _chunks_of(state, job, stream, gone, chat))


async def _chunks_of(
    state: ServerState, job: Job, stream: Stream, gone: asyncio.Future[None], chat: bool
) -> AsyncIterator[str]:
    chunks = _Chunks(state, job, chat)
    opening = chunks.opening()
    if opening is not None:
        yield opening
    async for event in stream.events(gone):
        if not isinstance(event, Outcome):
            if event.text:
                yield chunks.text(event.text)
            continue
        if event.failure is not None:
            yield _event(json.dumps(failure_error(event).body()))
        else:
            state.note_outcome(job, event)
            yield chunks.finish(Finish.of(event.finish_reason))
            if job.include_usage:
                yield chunks.usage(usage(event))
    yield DONE
