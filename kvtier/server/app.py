"""The HTTP surface: the FastAPI app factory and its routes, each a thin call into the module that does the work.

* ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``: OpenAI-
  compatible inference (:mod:`kvtier.server.inference`), behind the
  caller's API key when keys are configured (:mod:`kvtier.web.auth`).
* ``/health``: open, so a load balancer needs no secret.
* ``/stats`` (JSON), ``/metrics`` (Prometheus), aggregate only
  (:mod:`kvtier.server.metrics`); ``/dashboard``, a static page
  (``static/dashboard.html``, no build step) that polls ``/stats``; the
  schema pages ``/docs``, ``/redoc``, ``/openapi.json``: for readers
  (:class:`~kvtier.web.auth.Readers`), the admin or the read-only token,
  or anyone when neither is configured (the server then binds loopback only).
* ``/admin/clear``, ``/admin/pin``, ``/admin/prefetch``, ``/lookup``, ``/v1/kv-events``: behind
  the admin token. ``/lookup`` is admin-only because "is this prompt
  cached?" is a timing oracle on other people's prompts.

Routes run on the event loop and never do model work there: tokenizing,
cache probes and stats snapshots go to worker threads, generation to the
engine thread (:mod:`kvtier.server.loop`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Path, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtier.config import ServerConfig
from kvtier.engine.engine import Engine
from kvtier.keys import BlockKey, KeyedTokens
from kvtier.server import inference, messages, sessions
from kvtier.server.errors import MESSAGES_PATH, APIError, ErrorCode, ErrorType, install_error_handlers, unauthorized
from kvtier.server.limits import BodyLimit
from kvtier.server.loop import Arrival, EngineUnavailable, Outcome, Stream
from kvtier.server.metrics import StatsCollector, build_report, hardware_report
from kvtier.server.schemas import (
    ChatCompletionResponse,
    ClearRequest,
    ClearResponse,
    CompletionResponse,
    ErrorResponse,
    ExplainRequest,
    ExplainResponse,
    Health,
    KVEventsReport,
    LookupRequest,
    LookupResponse,
    MessageResponse,
    MessagesErrorResponse,
    ModelCard,
    ModelList,
    PinRequest,
    PinResponse,
    PrefetchRequest,
    PrefetchResponse,
    RetainedReport,
    SessionPrefetchResponse,
    SessionsReport,
    StatsReport,
    WarmingReport,
)
from kvtier.server.state import ServerState
from kvtier.tiers.base import TierKind
from kvtier.web.auth import Tenant
from kvtier.web.messages import MessagesRequest
from kvtier.web.requests import (
    ChatCompletionRequest,
    CompletionRequest,
)

_api_key = HTTPBearer(auto_error=False, scheme_name="APIKey", description="Needed when server.api_keys is set.")
_admin_key = HTTPBearer(auto_error=False, scheme_name="AdminToken", description="server.admin_token.")
_read_key = HTTPBearer(
    auto_error=False, scheme_name="ReadToken", description="server.read_token or server.admin_token, when set."
)
TOKEN_COOKIE = "kvtier_token"  # set by GET /dashboard?token=, for a browser, which sends no bearer header on load

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 422, 500, 503)
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _state(request: Request) -> ServerState:
    return request.app.state.kvtier


State = Annotated[ServerState, Depends(_state)]


async def _caller(state: State, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_api_key)]) -> Tenant:
    tenant = state.tenants.from_key(creds.credentials if creds else None)
    if tenant is None:
        raise unauthorized("a valid API key is required: Authorization: Bearer <key>")
    return tenant


async def _admin(state: State, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_key)]) -> None:
    if not state.admin.allows(creds.credentials if creds else None):
        raise unauthorized("the admin token is required: Authorization: Bearer <server.admin_token>")


ReadCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_read_key)]


async def _reader(state: State, request: Request, creds: ReadCredentials) -> None:
    """The readers' routes take the bearer header, or the cookie that ``/dashboard?token=`` set.

    The cookie counts here only: these are GET routes that change nothing, so
    a forged cross-site request that carries it gains nothing (and
    SameSite=Strict keeps the browser from sending it anyway).
    """
    if state.readers.open:
        return
    if not state.readers.allows(creds.credentials if creds else None, request.cookies.get(TOKEN_COOKIE)):
        raise unauthorized("a token is required: Authorization: Bearer <server.read_token or server.admin_token>")


_x_api_key = APIKeyHeader(
    name="x-api-key", auto_error=False, scheme_name="XAPIKey", description="The Messages API's key header."
)


async def _messages_caller(
    state: State,
    key: Annotated[str | None, Depends(_x_api_key)],
    creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_api_key)],
) -> Tenant:
    """The Messages API's clients send their key as ``x-api-key`` (or, with a token, as a bearer header)."""
    tenant = state.tenants.from_key(key if key is not None else creds.credentials if creds else None)
    if tenant is None:
        raise unauthorized("a valid API key is required: x-api-key: <key>")
    return tenant


Caller = Annotated[Tenant, Depends(_caller)]
MessagesCaller = Annotated[Tenant, Depends(_messages_caller)]
Admin = Depends(_admin)
Reader = Depends(_reader)

router = APIRouter()


# -- inference -----------------------------------------------------------------------------------
@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def list_models(state: State, _: Caller) -> ModelList:
    card = ModelCard(id=state.model_name, created=state.created, context_length=state.loop.limits.context_length)
    return ModelList(data=[card])


CLIENT_GONE = 499  # nginx's "client closed request": logged, never seen by the client that left


def _arrival(state: State) -> Iterator[Arrival]:
    """An inference request from its first line: idle work in the engine holds still until it is submitted."""
    arrival = state.loop.expect()
    try:
        yield arrival
    finally:
        arrival.done()  # a request refused before it reached the engine


Arriving = Annotated[Arrival, Depends(_arrival)]


async def _run(
    request: Request,
    state: ServerState,
    job: inference.Job,
    arrival: Arrival,
    stream: Callable[[Stream, asyncio.Future[None]], AsyncIterator[str]] | None,
    respond: Callable[[Outcome], Any],
) -> Any:
    """Run ``job``: its event stream (``stream``), or ``respond(outcome)``; a client that leaves first aborts it."""
    gone = asyncio.ensure_future(inference.disconnected(request.receive))
    events = inference.submit(state, job, arrival)
    if stream is not None:
        return StreamingResponse(stream(events, gone), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        outcome = await inference.run_to_end(state, job, events, gone)
    finally:
        gone.cancel()
    return Response(status_code=CLIENT_GONE) if outcome is None else respond(outcome)


async def _answer(
    request: Request, state: ServerState, job: inference.Job, arrival: Arrival, *, stream: bool, chat: bool
) -> Response | CompletionResponse | ChatCompletionResponse:
    """An OpenAI route's answer: chunks ending ``data: [DONE]``, or one completion."""
    sse = functools.partial(inference.sse, state, job, chat=chat) if stream else None
    respond = inference.chat_response if chat else inference.completion_response
    return await _run(request, state, job, arrival, sse, functools.partial(respond, state, job))


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def completions(
    body: CompletionRequest, state: State, tenant: Caller, request: Request, arrival: Arriving
) -> Response | CompletionResponse:
    job = await _turn(state, tenant, request, body.session_name, await inference.completion_job(state, body, tenant))
    await inference.renew(state, job)
    await inference.retain(state, job, body.prompt_cache_retention)
    return await _answer(request, state, job, arrival, stream=body.stream, chat=False)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def chat_completions(
    body: ChatCompletionRequest, state: State, tenant: Caller, request: Request, arrival: Arriving
) -> Response | ChatCompletionResponse:
    job = await _turn(state, tenant, request, body.session_name, await inference.chat_job(state, body, tenant))
    await inference.renew(state, job)
    await inference.retain(state, job, body.prompt_cache_retention)
    return await _answer(request, state, job, arrival, stream=body.stream, chat=True)


@router.post(
    MESSAGES_PATH,
    response_model=MessageResponse,
    responses={code: {"model": MessagesErrorResponse} for code in (400, 401, 404, 413, 500, 503)},
)
async def create_message(
    body: MessagesRequest, state: State, tenant: MessagesCaller, request: Request, arrival: Arriving
) -> Response | MessageResponse:
    """Anthropic's Messages API; ``cache_control`` marks keep their prefix for the mark's TTL (see messages.py)."""
    mj = await messages.messages_job(state, body, tenant)
    user = body.metadata.user_id if body.metadata else None
    mj = dataclasses.replace(mj, job=await _turn(state, tenant, request, user, mj.job))
    await inference.renew(state, mj.job)
    mj = await messages.retain(state, mj)
    sse = functools.partial(messages.sse, state, mj) if body.stream else None
    return await _run(request, state, mj.job, arrival, sse, functools.partial(messages.response, state, mj))


async def _turn(
    state: ServerState, tenant: Tenant, request: Request, user: str | None, job: inference.Job
) -> inference.Job:
    """A request that names a session is that session's next turn (see :mod:`kvtier.server.sessions`)."""
    session = sessions.session_of(request, user)
    await sessions.begin_turn(state, session, job.prompt)
    return dataclasses.replace(job, session=session)


# -- agent sessions ------------------------------------------------------------------------------
@router.post("/v1/sessions/{session_id:path}/prefetch", response_model=SessionPrefetchResponse, responses=ERRORS)
async def prefetch_session(
    session_id: Annotated[str, Path(min_length=1, max_length=sessions.MAX_ID)], state: State, tenant: Caller
) -> SessionPrefetchResponse:
    """Move a live session's transcript up to host memory while its agent waits on a tool call.

    The id is the rest of the path up to ``/prefetch``, slashes and all: a
    session is named by free text (OpenAI's ``user``), and one named
    ``team/agent-1`` must be reachable like any other.
    """
    return await sessions.prefetch(state, tenant, session_id)


@router.get("/v1/sessions", response_model=SessionsReport, responses=ERRORS)
async def list_sessions(state: State, tenant: Caller) -> SessionsReport:
    """The caller's own live sessions, ids as given, counts only."""
    return sessions.report(sessions.registry(state), tenant.namespace)


@router.post("/v1/cache/explain", response_model=ExplainResponse, responses=ERRORS)
async def explain(body: ExplainRequest, state: State, tenant: Caller, request: Request) -> ExplainResponse:
    """How much of this request would hit, where from, and why the rest would not; the caller's namespace only."""
    return await sessions.explain(state, tenant, body, sessions.session_of(request, body.user))


# -- observability -------------------------------------------------------------------------------
@router.get("/health", response_model=Health, responses=ERRORS)
async def health(state: State) -> Health:
    if not state.loop.alive:
        raise APIError(503, "the engine is not running", type=ErrorType.UNAVAILABLE, code=ErrorCode.SHUTTING_DOWN)
    return Health(model=state.model_name)


def _report(state: ServerState) -> StatsReport:
    model = state.loaded.model
    out = build_report(state.model_name, state.cache, state.loop.metrics, hardware_report(model.device, model.dtype))
    out.sessions = None if state.sessions is None else sessions.report(state.sessions, None)
    if state.publisher is not None:
        out.kv_events = KVEventsReport(**dataclasses.asdict(state.publisher.report()))
    out.retained = {
        name: {tier: RetainedReport(**dataclasses.asdict(r)) for tier, r in tiers.items()}
        for name, tiers in state.retention.report().items()
    }
    return out


@router.get("/stats", response_model=StatsReport, responses=ERRORS, dependencies=[Reader])
async def stats(state: State) -> StatsReport:
    return await asyncio.to_thread(_report, state)


DASHBOARD_HEADERS = {
    # The page's own inline script and style, and fetches to this origin: nothing else loads or runs.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@functools.cache
def _dashboard_html() -> str:
    return resources.files("kvtier.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard(state: State, request: Request, creds: ReadCredentials, token: str | None = None) -> Response:
    """The live page: tier occupancy, hit rate and TTFT saved over time, sessions, break-even, verification.

    A browser sends no bearer header when it opens a page, so ``?token=`` is
    taken once and answered with a redirect that moves it into an HttpOnly
    cookie: the token leaves the address bar and the history, and the page's
    own fetches of ``/stats`` carry the cookie.
    """
    if token is None or state.readers.open:
        await _reader(state, request, creds)
        return HTMLResponse(_dashboard_html(), headers=DASHBOARD_HEADERS)
    if not state.readers.allows(token):
        raise unauthorized("that token opens nothing here: /dashboard?token=<server.read_token or server.admin_token>")
    url = request.url.remove_query_params("token")
    response = RedirectResponse(f"{url.path}?{url.query}" if url.query else url.path, status_code=303)
    secure = request.url.scheme == "https"
    response.set_cookie(TOKEN_COOKIE, token, path="/", httponly=True, samesite="strict", secure=secure)
    return response


@router.get("/openapi.json", include_in_schema=False, dependencies=[Reader])
async def openapi_schema(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs", include_in_schema=False, dependencies=[Reader])
async def swagger_ui() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title="kvtier - Swagger UI", oauth2_redirect_url="/docs/oauth2-redirect"
    )


@router.get("/docs/oauth2-redirect", include_in_schema=False, dependencies=[Reader])
async def swagger_ui_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc", include_in_schema=False, dependencies=[Reader])
async def redoc() -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title="kvtier - ReDoc")


@router.get(
    "/metrics",
    response_class=Response,
    responses={**ERRORS, 200: {"content": {CONTENT_TYPE_LATEST: {}}}},
    dependencies=[Reader],
)
async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/kv-events", response_class=StreamingResponse, responses=ERRORS)
async def kv_events(
    state: State, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_key)]
) -> Response:
    """This instance's block events as JSON lines, for ``kvtier route`` (see :mod:`kvtier.server.kv_events`).

    Behind the admin token when one is configured. Without one it is open:
    keys are keyed hashes, which tell nothing about a prompt to anyone
    without the deployment's secret, and the server binds loopback only.
    """
    if state.admin.configured and not state.admin.allows(creds.credentials if creds else None):
        raise unauthorized("the admin token is required: Authorization: Bearer <server.admin_token>")
    if state.events is None:
        raise APIError(
            404, "no block events here: the tiers live in the node's cache service", type=ErrorType.NOT_FOUND
        )
    return StreamingResponse(state.events.stream(), media_type="application/x-ndjson", headers=SSE_HEADERS)


# -- admin ---------------------------------------------------------------------------------------
def _tenant(state: ServerState, name: str | None) -> Tenant:
    tenant = state.tenants.by_name(name)
    if tenant is None:
        known = ", ".join(state.tenants.names)
        message = "name a tenant" if name is None else f"unknown tenant {name!r}"
        raise APIError(400, f"{message}; tenants: {known}", code=ErrorCode.UNKNOWN_TENANT, param="tenant")
    return tenant


async def _keyed(
    state: ServerState, body: LookupRequest | PinRequest | PrefetchRequest, *, add_generation_prompt: bool
) -> tuple[Tenant, KeyedTokens]:
    """The admin body's tenant and its prompt (or messages, rendered as the inference routes do), keyed."""
    tenant = _tenant(state, body.tenant)
    if body.messages is not None:
        ids = await inference.chat_ids(state, body.messages, add_generation_prompt=add_generation_prompt)
    else:
        assert body.prompt is not None
        ids = await inference.prompt_ids(state, body.prompt)
    return tenant, await asyncio.to_thread(state.cache.keyed, ids, tenant.namespace)


def _clear_resident(root: BlockKey | None, engine: Engine) -> int:
    """Runs on the engine thread: drop the pool's index of finished requests' blocks (of one namespace's chains)."""
    return 0 if engine.resident is None else engine.resident.clear(root)


@router.post("/admin/clear", response_model=ClearResponse, responses=ERRORS, dependencies=[Admin])
async def clear(state: State, body: ClearRequest | None = None) -> ClearResponse:
    """Drop every block of one tier (or all), or only one tenant's, that no load in progress is reading.

    A tenant's blocks are the chains that hang from its namespace's root
    (each block's record names its parent, block 0's the root), in the
    engine's pool and the local tiers; the remote tier is shared by the
    fleet and is not cleared from one node.
    """
    body = body or ClearRequest()
    tier = body.tier
    namespace = None if body.tenant is None else _tenant(state, body.tenant).namespace
    root = None if namespace is None else state.cache.hasher.root(namespace)
    present = [TierKind.DEVICE, *(t.kind for t in state.cache.tiers)]
    if tier is not None and tier not in present:
        raise APIError(404, f"tier {tier.value!r} is not configured", type=ErrorType.NOT_FOUND, param="tier")
    dropped: dict[TierKind, int] = {}
    for kind in present:
        if tier is not None and kind is not tier:
            continue
        if kind is TierKind.DEVICE:
            dropped[kind] = await asyncio.wrap_future(state.loop.call(functools.partial(_clear_resident, root)))
        else:
            dropped[kind] = await asyncio.to_thread(state.cache.clear, kind, namespace)
    return ClearResponse(dropped_blocks=dropped)


@router.post("/admin/settle", response_model=WarmingReport, responses=ERRORS, dependencies=[Admin])
async def settle(state: State) -> WarmingReport:
    """Return once the engine has nothing left to do: every finished turn's warm handed over and run, no request,
    no verification, every block it offered the cache stored (below host too, where a store copies it); then
    warming's counters. What tests and benchmarks wait on instead of sleeping."""
    if state.warmer is not None:
        await asyncio.to_thread(state.warmer.settle)
    try:
        await asyncio.wrap_future(state.loop.idle())
        await asyncio.wrap_future(state.loop.call(lambda engine: engine.drain_stores()))
    except EngineUnavailable as err:
        raise APIError(503, str(err), type=ErrorType.UNAVAILABLE, code=ErrorCode.SHUTTING_DOWN) from None
    return state.loop.metrics.engine_report().warming


@router.post("/admin/pin", response_model=PinResponse, responses=ERRORS, dependencies=[Admin])
async def pin(body: PinRequest, state: State) -> PinResponse:
    """Keep a prompt's (or a conversation prefix's) full blocks out of one tier's eviction for ``ttl_s`` seconds.

    ``ttl_s`` 0 unpins them; the tenant's own promises (``cache_control``,
    ``prompt_cache_retention``) over any of those blocks are kept still.
    """
    limit = state.config.server.max_pin_ttl_s
    if body.ttl_s > limit:
        raise APIError(400, f"ttl_s is {body.ttl_s}; at most {limit} is allowed", param="ttl_s")
    tier = TierKind(body.tier.value)
    if tier not in (t.kind for t in state.cache.tiers):
        raise APIError(404, f"tier {tier.value!r} is not configured", type=ErrorType.NOT_FOUND, param="tier")
    tenant, prompt = await _keyed(state, body, add_generation_prompt=False)
    pinned = await asyncio.to_thread(functools.partial(state.cache.pin_for, prompt, body.ttl_s, tier=tier))
    if body.ttl_s == 0:  # an unpin lets go of keys whoever pinned them: the tenant's clients' promises hold again
        await asyncio.to_thread(state.retention.pin_again, tenant.name, tier)
    probe = await asyncio.to_thread(state.cache.probe, prompt)
    bs = state.cache.layout.block_size
    return PinResponse(
        tenant=tenant.name,
        pinned_blocks=pinned,
        pinned_tokens=pinned * bs,
        cached_tokens=probe.cached_tokens,
        ttl_s=body.ttl_s,
        tier=body.tier,
    )


@router.post("/admin/prefetch", response_model=PrefetchResponse, responses=ERRORS, dependencies=[Admin])
async def prefetch(body: PrefetchRequest, state: State) -> PrefetchResponse:
    """Move a prompt's cached blocks up to host memory now (from disk or the remote tier), for a tenant.

    What an operator (``kvtier route``'s ``/fleet/prefetch``) asks before it
    moves traffic here: the reads happen now instead of in the first
    request's TTFT. Nothing stays pinned, as with a session's prefetch.
    """
    tenant, prompt = await _keyed(state, body, add_generation_prompt=True)
    done = await asyncio.to_thread(state.cache.prefetch, prompt)
    return PrefetchResponse(
        tenant=tenant.name,
        prompt_tokens=len(prompt),
        promoted_tokens=done.promoted,
        host_tokens=done.host_blocks * state.cache.layout.block_size,
    )


@router.post("/lookup", response_model=LookupResponse, responses=ERRORS, dependencies=[Admin])
async def lookup(body: LookupRequest, state: State) -> LookupResponse:
    """How much of a prompt the tiers hold for a tenant (the remote one too), without touching eviction or stats."""
    tenant, prompt = await _keyed(state, body, add_generation_prompt=True)
    probe = await asyncio.to_thread(state.cache.probe, prompt)
    return LookupResponse(
        tenant=tenant.name,
        prompt_tokens=len(prompt),
        cached_tokens=probe.cached_tokens,
        tiers=probe.tokens_by_tier(),
        miss_reason=probe.miss_reason,
    )


# -- the app -------------------------------------------------------------------------------------
def _cap_max_tokens(schema: dict[str, Any], limit: int) -> None:
    """Show the configured ``server.max_tokens_limit`` as the schema's bound (the models carry a static one)."""
    models = schema.get("components", {}).get("schemas", {})
    for name in ("CompletionRequest", "ChatCompletionRequest", "MessagesRequest"):
        props = models.get(name, {}).get("properties", {})
        for field in ("max_tokens", "max_completion_tokens"):
            prop = props.get(field)
            for sub in prop.get("anyOf", [prop]) if prop else ():
                if sub.get("type") == "integer":
                    sub["maximum"] = limit


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.kvtier
    if not state.loop.alive:
        state.loop.start()
    yield
    # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once this shutdown ends.
    await asyncio.to_thread(state.loop.stop)
    await asyncio.to_thread(state.cache.close, state.config.cache.flush_on_exit_s)
    if state.publisher is not None:
        await asyncio.to_thread(state.publisher.close)


def build_app(config: ServerConfig) -> FastAPI:
    """Every route, middleware and schema of the server, with no state yet: the table a route scan reads.

    FastAPI's own schema pages are off; the router serves them, behind the readers' token like the figures.
    """
    app = FastAPI(
        title="kvtier",
        version="0.1.0",
        lifespan=_lifespan,
        description=__doc__,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=int(config.max_body_bytes))
    app.include_router(router)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _cap_max_tokens(FastAPI.openapi(app), config.max_tokens_limit)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def create_app(state: ServerState) -> FastAPI:
    app = build_app(state.config.server)
    app.state.kvtier = state
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: _report(state)))
    app.state.registry = registry
    return app
