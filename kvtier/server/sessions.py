"""The server's side of agent sessions and of explain: request -> session, turns, prefetch, the why-miss answer.

A request names its session by an ``X-Session-ID`` header or the OpenAI
``user`` field (the header wins: a proxy can set it without touching the
body). Sessions are keyed by the caller's namespace, so a tenant only ever
reaches its own.

Session ids may be sensitive (people put user names and e-mail addresses
in ``user``). ``GET /v1/sessions`` shows the caller its own sessions with
their ids as given (it sent them); ``/stats`` (every reader's, and anyone's
with no token configured) shows every session under a keyed hash of
(namespace, id), with a key that never leaves the process: an operator
can follow one session from scrape to scrape, and nobody can confirm a
guessed id. Neither ever shows token text.

With the tiers in a node's cache service (``service.connect``) the host
tier a session's protection steers, the lower tiers prefetch promotes from
and the eviction log explain reads are all the service's: each turn is
forwarded there (:meth:`kvtier.cache.Cache.session_turn` says so, by
returning no keys for this process to protect), and prefetch and explain
are answered there. This process still keeps the transcripts (for
the divergence window and ``/v1/sessions``) and warms its own engine pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets

import numpy as np
from fastapi import Request

from kvtier.engine.warm import warm
from kvtier.explain import ExplainReason, Explanation, divergence
from kvtier.keys import KeyedTokens
from kvtier.server.errors import APIError, ErrorType
from kvtier.server.inference import chat_ids, prompt_ids
from kvtier.server.schemas import (
    DivergenceReport,
    EvictionReport,
    ExplainRequest,
    ExplainResponse,
    SessionCountsReport,
    SessionPrefetchResponse,
    SessionsReport,
)
from kvtier.server.state import ServerState
from kvtier.sessions import Session, SessionCounts, SessionRegistry
from kvtier.web.auth import Tenant

HEADER = "X-Session-ID"
MAX_ID = 256
WINDOW_TOKENS = 8
"""Tokens decoded on each side of a divergence: enough to read a timestamp, too few to leak a transcript."""

_STATS_KEY = secrets.token_bytes(16)


def session_of(request: Request, user: str | None) -> str | None:
    """The session a request names: the header, else the body's; None for an anonymous request.

    A body names it by ``prompt_cache_key`` or ``user`` (OpenAI), or ``metadata.user_id`` (the Messages API).
    """
    given = request.headers.get(HEADER) or user
    if given is not None and not 0 < len(given) <= MAX_ID:
        raise APIError(400, f"a session id has 1 to {MAX_ID} characters", param=HEADER)
    return given


def registry(state: ServerState) -> SessionRegistry:
    if state.sessions is None:
        raise APIError(404, "sessions are off (session.enabled: false)", type=ErrorType.NOT_FOUND)
    return state.sessions


async def begin_turn(state: ServerState, session: str | None, prompt: KeyedTokens) -> None:
    """Make the session live with this transcript before the engine stores it, so its blocks land protected."""
    if session is None or state.sessions is None:
        return
    keys = await asyncio.to_thread(state.cache.session_turn, prompt, session)
    state.sessions.turn(prompt.namespace, session, prompt.tokens, keys)


async def prefetch(state: ServerState, tenant: Tenant, session_id: str) -> SessionPrefetchResponse:
    """Promote a live session's transcript to host memory (the agent's tool call is about to return)."""
    session = registry(state).touch(tenant.namespace, session_id)  # first, so its promoted blocks land protected
    if session is None:
        raise APIError(404, "no live session by that id", type=ErrorType.NOT_FOUND, param="session_id")
    transcript = await asyncio.to_thread(state.cache.keyed, session.tokens, tenant.namespace)
    done = await asyncio.to_thread(state.cache.prefetch, transcript, session_id=session.session_id)
    pool = await asyncio.wrap_future(state.loop.call(lambda engine: warm(engine, transcript)))
    return SessionPrefetchResponse(
        session=session_id,
        transcript_tokens=len(session.tokens),
        promoted_tokens=done.promoted,
        host_tokens=done.host_blocks * state.cache.layout.block_size,
        device_tokens=pool,
    )


def _counts(c: SessionCounts) -> SessionCountsReport:
    return SessionCountsReport(**vars(c))


def _hashed(s: Session) -> str:
    return hashlib.blake2b(f"{s.namespace}\0{s.session_id}".encode(), key=_STATS_KEY, digest_size=8).hexdigest()


def report(registry: SessionRegistry, namespace: str | None) -> SessionsReport:
    """/stats (``namespace`` None: every tenant, ids hashed) or GET /v1/sessions (one tenant, ids as given)."""
    name = _hashed if namespace is None else (lambda s: s.session_id)
    listed = [_counts(c) for c in registry.counts(namespace, name)]
    return SessionsReport(
        live=len(listed) if namespace is not None else len(registry),
        expired=registry.expired,
        protected_blocks=registry.protected_blocks,
        sessions=listed,
    )


async def explain(state: ServerState, tenant: Tenant, body: ExplainRequest, session: str | None) -> ExplainResponse:
    """Where this request's cached run would stop and why; a probe (no eviction order or stats change)."""
    known = registry(state)
    if body.messages is not None:
        ids = await chat_ids(state, body.messages)
    else:
        assert body.prompt is not None
        ids = await prompt_ids(state, body.prompt)
    earlier = known.get(tenant.namespace, session) if session is not None else None
    reference, at = _diverged(earlier, ids)
    prompt = await asyncio.to_thread(state.cache.keyed, ids, tenant.namespace)
    why = await asyncio.to_thread(state.cache.explain, prompt, diverged_at=at)
    if why is None:
        raise APIError(503, "the node's cache service did not answer", type=ErrorType.UNAVAILABLE)
    if body.model is not None and body.model != state.model_name:  # keys bind the model: none of its KV is here
        why = Explanation(why.result, ExplainReason.OTHER_MODEL, 0)
    text = None if reference is None or at is None else await asyncio.to_thread(_window, state, reference, ids, at)
    return _response(why, text)


def _diverged(session: Session | None, ids: list[int]) -> tuple[np.ndarray | None, int | None]:
    """The session transcript this request leaves, and where; or the last turn's own divergence from the one before.

    Asked before the next turn, the request is compared with the last turn;
    asked after it was sent (the request extends the last turn), the last
    turn is compared with the turn before, which is where its miss came from.
    """
    if session is None:
        return None, None
    at = divergence(session.tokens, ids)
    if at is not None or session.previous is None:
        return session.tokens, at
    return session.previous, divergence(session.previous, session.tokens)


def _window(state: ServerState, reference: np.ndarray, ids: list[int], at: int) -> DivergenceReport:
    decode = state.loaded.tokenizer.decode
    lo = max(0, at - WINDOW_TOKENS)
    before = reference[lo : at + WINDOW_TOKENS].tolist()
    return DivergenceReport(position=at, before=decode(before), now=decode(ids[lo : at + WINDOW_TOKENS]))


def _response(why: Explanation, text: DivergenceReport | None) -> ExplainResponse:
    eviction = None
    if why.eviction is not None:
        ago = why.eviction_age_s or 0.0
        eviction = EvictionReport(tier=why.eviction.tier, policy=why.eviction.policy.value, seconds_ago=ago)
    return ExplainResponse(
        prompt_tokens=why.result.num_tokens,
        cached_tokens=why.result.cached_tokens,
        tiers=why.result.tokens_by_tier(),
        reason=why.reason,
        first_miss_token=why.first_miss_token,
        eviction=eviction,
        other_namespace=why.other_namespace is not None,
        divergence=text,
    )
