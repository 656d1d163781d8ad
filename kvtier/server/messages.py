"""``POST /v1/messages``: the Messages API's body -> a job for the engine -> its JSON or its event stream.

The request is rendered with the model's own chat template (tools and
system first, as the API orders a prompt), checked like an OpenAI one, and
run by the same engine loop. What is this API's own:

* **Breakpoints.** Each ``cache_control`` block names a prefix of the
  prompt; its tokens are the rendered prompt's tokens shared with the
  conversation cut just after that block. Every request that carries a
  breakpoint pins the prefix's full blocks in host memory for the mark's TTL
  (5 minutes or an hour), so a hit refreshes the promise.
* **Usage**, counted exactly: ``cache_read_input_tokens`` were served from
  the KV cache; ``cache_creation_input_tokens`` were computed now and are
  kept by a mark (whole blocks up to the last breakpoint, less what was
  read); ``input_tokens`` is the rest. The three sum to the prompt's tokens.
* **Its event stream**: ``message_start``, one text content block
  (``content_block_start`` / ``_delta`` / ``_stop``), ``message_delta`` with
  the stop reason and the usage, ``message_stop``; a failure after the 200
  is an ``error`` event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.engine.sampling import SamplingParams
from kvtier.server.errors import APIError
from kvtier.server.inference import Job, PromptField, check_model, check_prompt, ending, failure_error, template_ids
from kvtier.server.loop import Outcome, Stream
from kvtier.server.schemas import CacheCreation, MessageResponse, MessagesUsage, StopReason, TextContent
from kvtier.server.state import ServerState
from kvtier.web.auth import Tenant
from kvtier.web.messages import MAX_BREAKPOINTS, Breakpoint, CacheTTL, MessagesRequest, rendered
from kvtier.web.requests import GREEDY_BELOW, MIN_TOP_P


def _shared(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share (vectorised: a transcript runs to 100k tokens)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


async def breakpoint_tokens(state: ServerState, ids: list[int], marks: list[Breakpoint]) -> list[int]:
    """Each mark's prefix length in ``ids``: the tokens the prompt shares with its conversation cut at the mark.

    The cut conversation renders its last message closed, so the shared run
    ends at the marked block's end (or, where a byte pair straddles it, a
    token before).
    """
    return [_shared(ids, await template_ids(state, m.upto, add_generation_prompt=False)) for m in marks]


# -- from a body to a job ---------------------------------------------------------------------
@dataclass(frozen=True)
class MessagesJob:
    """A job and the prompt's breakpoints: ``(tokens, ttl seconds)``, fewest tokens first."""

    job: Job
    breakpoints: list[tuple[int, float]]

    def kept(self) -> list[tuple[int, float]]:
        """Whole blocks up to each breakpoint, with the longest TTL of the marks at or after it (a block's own)."""
        size, longest, out = self.job.prompt.hasher.block_size, 0.0, []
        for tokens, ttl_s in reversed(self.breakpoints):
            longest = max(longest, ttl_s)
            out.append((tokens // size * size, longest))
        return out[::-1]

    def usage(self, read: int, output_tokens: int) -> MessagesUsage:
        """The prompt's tokens read (``read``: served from the cache), created (by TTL) and the rest.

        Created: computed now and kept by a mark, so not read.
        """
        prompt_tokens = len(self.job.prompt)
        created = {CacheTTL.FIVE_MINUTES: 0, CacheTTL.ONE_HOUR: 0}
        start = read
        for end, ttl_s in self.kept():
            end = min(end, prompt_tokens)
            if end > start:
                created[CacheTTL.ONE_HOUR if ttl_s >= CacheTTL.ONE_HOUR.seconds else CacheTTL.FIVE_MINUTES] += (
                    end - start
                )
                start = end
        made = sum(created.values())
        return MessagesUsage(
            input_tokens=prompt_tokens - read - made,
            output_tokens=output_tokens,
            cache_creation_input_tokens=made,
            cache_read_input_tokens=read,
            cache_creation=CacheCreation(
                ephemeral_5m_input_tokens=created[CacheTTL.FIVE_MINUTES],
                ephemeral_1h_input_tokens=created[CacheTTL.ONE_HOUR],
            ),
        )


async def messages_job(state: ServerState, body: MessagesRequest, tenant: Tenant) -> MessagesJob:
    check_model(state, body.model)
    conversation, marks = rendered(body)
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(
            400, f"{len(marks)} blocks carry cache_control; at most {MAX_BREAKPOINTS} may", param="cache_control"
        )
    ids = await template_ids(state, conversation)
    check_prompt(state, ids, body.max_tokens, PromptField.MESSAGES)
    cuts = await breakpoint_tokens(state, ids, marks)
    temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
    top_p = 1.0 if body.top_p is None else max(body.top_p, MIN_TOP_P)
    stop = tuple(body.stop_sequences or ())
    params = SamplingParams(max_tokens=body.max_tokens, temperature=temperature, top_p=top_p, stop=stop)
    prompt = state.cache.keyed(ids, tenant.namespace)
    job = Job(f"msg_{secrets.token_hex(12)}", prompt, params, tenant, include_usage=True, conversation=conversation)
    return MessagesJob(job, sorted((n, m.ttl.seconds) for n, m in zip(cuts, marks, strict=True)))


async def retain(state: ServerState, mj: MessagesJob) -> MessagesJob:
    """Keep each breakpoint's prefix for its TTL from now, within the tenant's quota; the job with those kept.

    The prefixes are pinned whether cached yet or not (the pins wait for the
    blocks); a block under several marks keeps the longest TTL over it; a
    mark whose prefix alone exceeds the quota is not kept, and its tokens are
    then not counted as created.
    """
    if not mj.breakpoints:
        return mj
    ends = mj.kept()
    marks = [(mj.job.prompt.prefix(tokens), ttl_s) for tokens, ttl_s in ends]
    taken = await asyncio.to_thread(state.retention.keep, mj.job.tenant.name, marks)
    kept = [b for b, (end, _), ok in zip(mj.breakpoints, ends, taken, strict=True) if ok and end > 0]
    return dataclasses.replace(mj, breakpoints=kept)


# -- answers ----------------------------------------------------------------------------------------
def response(state: ServerState, mj: MessagesJob, outcome: Outcome) -> MessageResponse:
    return MessageResponse(
        id=mj.job.request_id,
        content=[TextContent(text=outcome.text)] if outcome.text else [],
        model=state.model_name,
        stop_reason=StopReason.of(outcome.finish_reason, outcome.stop_sequence),
        stop_sequence=outcome.stop_sequence,
        usage=mj.usage(outcome.cached_tokens, outcome.completion_tokens),
    )


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, ensure_ascii=False)}\n\n"


def sse(state: ServerState, mj: MessagesJob, stream: Stream, gone: asyncio.Future[None]) -> AsyncIterator[str]:
    """The Messages API's event stream of one request; a client that leaves mid-stream aborts it.

    ``message_start`` waits for the engine's first word on the request (its
    first token, which carries how much of the prompt the cache served), so
    its usage splits the prompt exactly as the final ``message_delta`` does.
    """
    return ending(state, mj.job, gone, _events(state, mj, stream, gone))


def _opening(state: ServerState, mj: MessagesJob, read: int, output_tokens: int) -> str:
    usage = mj.usage(read, output_tokens)
    message = MessageResponse(id=mj.job.request_id, content=[], model=state.model_name, stop_reason=None, usage=usage)
    return _event("message_start", {"message": message.model_dump(mode="json")}) + _event(
        "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
    )


async def _events(
    state: ServerState, mj: MessagesJob, stream: Stream, gone: asyncio.Future[None]
) -> AsyncIterator[str]:
    job, opened = mj.job, False
    async for event in stream.events(gone):
        if not isinstance(event, Outcome):
            if not opened:
                yield _opening(state, mj, event.cached_tokens or 0, event.num_tokens)
                opened = True
            if event.text:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": event.text}})
            continue
        if event.failure is not None:
            error = failure_error(event)
            yield _event("error", {"error": {"type": "api_error", "message": error.message}})
            return
        if not opened:  # it ended at its first step: the outcome's counts are the opening's
            yield _opening(state, mj, event.cached_tokens, 0)
        state.note_outcome(job, event)
        yield _event("content_block_stop", {"index": 0})
        reason = StopReason.of(event.finish_reason, event.stop_sequence)
        delta = {"stop_reason": reason.value, "stop_sequence": event.stop_sequence}
        usage = mj.usage(event.cached_tokens, event.completion_tokens)
        yield _event("message_delta", {"delta": delta, "usage": usage.model_dump(mode="json")})
        yield _event("message_stop", {})


__all__ = ["MessagesJob", "breakpoint_tokens", "messages_job", "response", "retain", "sse"]
