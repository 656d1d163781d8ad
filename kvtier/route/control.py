"""The fleet control API: one call of the router's, behind ``route.admin_token``, over every backend's admin routes.

``/fleet/lookup``, ``/fleet/pins``, ``/fleet/prefetch``, ``/fleet/clear``,
``/fleet/usage``. Each asks the backends concerned at once
(:func:`asyncio.gather`), each within ``route.fleet_timeout_s``, with
``route.backend_token``, and answers one typed entry per backend whose
``status`` says what became of it:

* ``ok``: it answered, and its figures are in the entry;
* ``down``: its health checks have it out of the fleet, or it refused the
  connection, broke it, or did not answer in time;
* ``error``: it answered something else (a 4xx, a 5xx, a body that is none
  of its answers), given in ``detail``.

A backend is never left out of an answer: a down one is reported down.

The prompt (text or token ids) or messages are passed to the backends as
given, with the tenant's name: each renders and keys it itself, exactly as
its inference routes would. The tenant is named, as on the backends' own
admin routes: whoever holds the admin token acts on every tenant's cache.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import httpx2 as httpx
from fastapi import APIRouter, Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvtier.config import RouteConfig
from kvtier.pins import MAX_TTL_S, PinTier
from kvtier.route.backends import Fleet
from kvtier.route.pins import FleetPin, PinBook, same_prefix
from kvtier.tiers.base import TierKind
from kvtier.web.auth import AdminToken

MAX_ANSWER_BYTES = 8 * 1024**2  # a backend's admin answer read past this is no answer (its /stats is some KiB)


class BackendStatus(enum.StrEnum):
    OK = "ok"
    DOWN = "down"
    ERROR = "error"


# -- requests ------------------------------------------------------------------------------------
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptBody(_Body):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | None = None
    messages: list[dict[str, Any]] | None = Field(
        None, min_length=1, description="A chat, as /v1/chat/completions takes it; each backend renders it."
    )
    tenant: str | None = Field(None, description="Whose cache, by the backends' tenant names; null: their default.")

    @model_validator(mode="after")
    def _exactly_one(self) -> PromptBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def for_backend(self) -> dict[str, Any]:
        return self.model_dump(include={"prompt", "messages", "tenant"}, exclude_none=True)


class Backends(_Body):
    backends: list[str] | None = Field(None, description="Backend URLs as the router names them; null: all.")


class FleetLookupRequest(PromptBody):
    pass


class FleetPinRequest(PromptBody, Backends):
    ttl_s: float = Field(gt=0, le=MAX_TTL_S, description="Seconds to keep it (each backend caps it).")
    tier: PinTier = PinTier.HOST


class FleetPrefetchRequest(PromptBody):
    backend: str = Field(description="The backend to warm, by its URL as the router names it.")


class FleetClearRequest(Backends):
    tier: TierKind | None = Field(None, description="null: every tier.")
    tenant: str | None = Field(
        None,
        description="Only this tenant's: its fleet pins released (in tier, when given), then its blocks dropped "
        "(the chains from its namespace's root, in the engine's pool and the local tiers; never the shared remote).",
    )


# -- answers -------------------------------------------------------------------------------------
class BackendEntry(BaseModel):
    url: str
    status: BackendStatus
    detail: str | None = Field(None, description="Why it is down, or the error it answered.")


class BackendLookup(BackendEntry):
    prompt_tokens: int | None = None
    cached_tokens: int | None = Field(None, description="Leading tokens its tiers hold, whole blocks only.")
    tiers: dict[TierKind, int] = Field(
        default_factory=dict, description="Of cached_tokens, how many each tier would serve (remote: from Redis)."
    )
    miss_reason: str | None = None


class FleetLookup(BaseModel):
    backends: list[BackendLookup]


class BackendPin(BackendEntry):
    pinned_blocks: int | None = None
    pinned_tokens: int | None = None
    cached_tokens: int | None = Field(None, description="Of the pinned tokens, how many it holds now.")


class FleetPinAnswer(BaseModel):
    id: str | None = Field(description="The pin's id for DELETE /fleet/pins/{id}; null: no backend holds it.")
    tenant: str | None
    tier: PinTier
    ttl_s: float
    backends: list[BackendPin]


class FleetPinListed(BaseModel):
    id: str
    tenant: str | None
    tier: PinTier
    ttl_s: float
    expires_in_s: float
    backends: list[str] = Field(description="Where it holds.")


class FleetPinList(BaseModel):
    pins: list[FleetPinListed]


class BackendRelease(BackendEntry):
    kept_by: list[str] = Field(
        default_factory=list, description="The tenant's other fleet pins there in that tier, pinned again: kept."
    )


class FleetRelease(BaseModel):
    id: str
    backends: list[BackendRelease]


class BackendPrefetch(BackendEntry):
    prompt_tokens: int | None = None
    promoted_tokens: dict[TierKind, int] = Field(default_factory=dict, description="Moved to host, by tier left.")
    host_tokens: int | None = Field(None, description="Leading prompt tokens its host memory holds now.")


class BackendClear(BackendEntry):
    dropped_blocks: dict[TierKind, int] = Field(default_factory=dict)


class FleetClear(BaseModel):
    tier: TierKind | None
    tenant: str | None
    released_pins: list[str] = Field(default_factory=list, description="Fleet pins released (a tenant's clear).")
    backends: list[BackendClear]


class TierUsage(BaseModel):
    capacity_bytes: int
    used_bytes: int
    capacity_blocks: int
    blocks: int
    hit_tokens: int
    miss_tokens: int
    hit_rate: float | None


class RetainedUsage(BaseModel):
    blocks: int
    bytes: int
    prefixes: int


class BackendUsage(BackendEntry):
    tiers: dict[TierKind, TierUsage] = Field(default_factory=dict)
    ttl_pinned_blocks: int | None = Field(None, description="Keys under a live TTL pin there, any tier, any reason.")
    tenants: dict[str, dict[TierKind, RetainedUsage]] = Field(
        default_factory=dict, description="Per tenant, per tier: what its promises (cache_control, 24h) keep there."
    )


class TenantUsage(BaseModel):
    retained: dict[TierKind, RetainedUsage] = Field(description="Summed over the backends that answered.")
    fleet_pins: int = Field(description="Live fleet pins of this tenant.")


class FleetUsage(BaseModel):
    backends: list[BackendUsage]
    tenants: dict[str, TenantUsage]


# -- what the backends answer (only what is read of it) --------------------------------------------
class _Stats(BaseModel):
    tiers: dict[TierKind, TierUsage]
    ttl_pinned_blocks: int
    retained: dict[str, dict[TierKind, RetainedUsage]] = Field(default_factory=dict)


class _Dropped(BaseModel):
    dropped_blocks: dict[TierKind, int]


# -- asking the backends -------------------------------------------------------------------------
E = TypeVar("E", bound=BackendEntry)


@dataclass(frozen=True)
class Reply:
    status: BackendStatus
    detail: str | None = None
    body: Any = None  # the answer's JSON, when ok


@dataclass
class Control:
    """What the fleet routes act on; ``client`` is set while the app runs."""

    fleet: Fleet
    config: RouteConfig
    pins: PinBook = field(default_factory=PinBook)
    client: httpx.AsyncClient | None = None
    pinning: asyncio.Lock = field(default_factory=asyncio.Lock)  # pins are set and released one call at a time

    def headers(self) -> dict[str, str]:
        token = self.config.backend_token
        return {"Authorization": f"Bearer {token.get_secret_value()}"} if token is not None else {}

    async def ask(self, url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Reply:
        """One backend's answer to one admin call, read within ``route.fleet_timeout_s`` and the size bound."""
        backend = self.fleet.backends[url]
        if not backend.up:
            return Reply(BackendStatus.DOWN, "out of the fleet: its health checks fail")
        try:
            return await asyncio.wait_for(self._call(url, method, path, body), self.config.fleet_timeout_s)
        except TimeoutError:
            return Reply(BackendStatus.DOWN, "no answer within route.fleet_timeout_s")
        except httpx.HTTPError as err:
            return Reply(BackendStatus.DOWN, f"{type(err).__name__}: {err}")

    async def _call(self, url: str, method: str, path: str, body: dict[str, Any] | None) -> Reply:
        assert self.client is not None, "the app is not running"
        timeout = self.config.fleet_timeout_s  # the client's own (the health checks') is shorter than a prefetch
        request = self.client.build_request(method, url + path, json=body, headers=self.headers(), timeout=timeout)
        response = await self.client.send(request, stream=True)
        try:
            raw = await _bounded(response)
        finally:
            await response.aclose()
        if raw is None:
            return Reply(BackendStatus.ERROR, f"{path} answered more than {MAX_ANSWER_BYTES} bytes")
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):
            return Reply(BackendStatus.ERROR, f"{path} answered {response.status_code}, not JSON")
        if response.status_code != 200:
            return Reply(BackendStatus.ERROR, f"{path} answered {response.status_code}: {_message(parsed)}")
        return Reply(BackendStatus.OK, None, parsed)

    async def each(self, urls: Sequence[str], ask: Callable[[str], Awaitable[E]]) -> list[E]:
        return list(await asyncio.gather(*(ask(url) for url in urls)))

    def chosen(self, backends: list[str] | None) -> list[str]:
        """The backends a call names (all when none), each one the router knows, or a 404."""
        if backends is None:
            return list(self.fleet.backends)
        unknown = [b for b in backends if b.rstrip("/") not in self.fleet.backends]
        if unknown:
            raise HTTPException(
                404, f"no such backend: {', '.join(unknown)}; backends: {', '.join(self.fleet.backends)}"
            )
        return list(dict.fromkeys(b.rstrip("/") for b in backends))


async def _bounded(response: httpx.Response) -> bytes | None:
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) > MAX_ANSWER_BYTES:
            return None
    return bytes(out)


def _message(body: Any) -> str:
    """A backend's error message (OpenAI's shape, or FastAPI's), or the body itself, cut short."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"][:500]
        if "detail" in body:
            return json.dumps(body["detail"])[:500]
    return json.dumps(body)[:500]


def entry(cls: type[E], url: str, reply: Reply, read: Callable[[Any], dict[str, Any]]) -> E:
    """The typed entry of one backend's reply; an ok reply whose body is not the answer expected is an error."""
    if reply.status is not BackendStatus.OK:
        return cls(url=url, status=reply.status, detail=reply.detail)
    try:
        return cls(url=url, status=reply.status, **read(reply.body))
    except (ValidationError, LookupError, TypeError) as err:  # a field missing, or the body no object
        return cls(url=url, status=BackendStatus.ERROR, detail=f"an answer that is none: {str(err)[:300]}")


# -- the calls -----------------------------------------------------------------------------------
LOOKUP_FIELDS = ("prompt_tokens", "cached_tokens", "tiers", "miss_reason")
PIN_FIELDS = ("pinned_blocks", "pinned_tokens", "cached_tokens")
PREFETCH_FIELDS = ("prompt_tokens", "promoted_tokens", "host_tokens")


def fields(names: Sequence[str]) -> Callable[[Any], dict[str, Any]]:
    return lambda body: {name: body[name] for name in names}


async def lookup(control: Control, body: FleetLookupRequest) -> FleetLookup:
    sent = body.for_backend()

    async def one(url: str) -> BackendLookup:
        return entry(BackendLookup, url, await control.ask(url, "POST", "/lookup", sent), fields(LOOKUP_FIELDS))

    return FleetLookup(backends=await control.each(list(control.fleet.backends), one))


async def pin(control: Control, body: FleetPinRequest) -> FleetPinAnswer:
    sent = {**body.for_backend(), "tier": body.tier.value}
    urls = control.chosen(body.backends)

    async def one(url: str) -> BackendPin:
        reply = await control.ask(url, "POST", "/admin/pin", {**sent, "ttl_s": body.ttl_s})
        return entry(BackendPin, url, reply, fields(PIN_FIELDS))

    async with control.pinning:
        answers = await control.each(urls, one)
        held = [a.url for a in answers if a.status is BackendStatus.OK]
        made = control.pins.add(sent, body.ttl_s, held)
    pin_id = made.id if held else None
    return FleetPinAnswer(id=pin_id, tenant=body.tenant, tier=body.tier, ttl_s=body.ttl_s, backends=answers)


def listed(control: Control) -> FleetPinList:
    now = control.pins.now()
    return FleetPinList(
        pins=[
            FleetPinListed(
                id=p.id,
                tenant=p.tenant,
                tier=PinTier(p.tier),
                ttl_s=p.ttl_s,
                expires_in_s=round(p.left_s(now), 3),
                backends=list(p.backends),
            )
            for p in control.pins.live()
        ]
    )


async def _release_on(control: Control, made: FleetPin, url: str) -> BackendRelease:
    """Let ``made`` go on one backend, and pin again the fleet pins that stand there (see :mod:`.pins`)."""
    standing = control.pins.standing(url, made)
    if not any(same_prefix(made, other) for other in standing):
        reply = await control.ask(url, "POST", "/admin/pin", {**made.body, "ttl_s": 0})
        if reply.status is not BackendStatus.OK:
            detail = f"{reply.detail}; its pin there ends with its TTL"
            return BackendRelease(url=url, status=reply.status, detail=detail)
    now = control.pins.now()
    standing = [other for other in standing if other.left_s(now) > 0]  # a ttl_s of 0 would unpin
    for other in standing:  # the shortest first: a block under several keeps the longest promise
        reply = await control.ask(url, "POST", "/admin/pin", {**other.body, "ttl_s": other.left_s(now)})
        if reply.status is not BackendStatus.OK:
            detail = f"released, but pin {other.id} was not set again: {reply.detail}"
            return BackendRelease(url=url, status=reply.status, detail=detail)
    return BackendRelease(url=url, status=BackendStatus.OK, kept_by=[other.id for other in standing])


async def _release(control: Control, made: FleetPin, urls: Sequence[str]) -> list[BackendRelease]:
    """Release ``made`` on ``urls`` (those of its backends); the book forgets it there whatever they answer.

    A backend that is down or errs keeps its pin until the TTL ends: the
    entry says so, and the router no longer counts it.
    """
    answers = await control.each(urls, lambda url: _release_on(control, made, url))
    control.pins.drop(made, urls)
    return answers


async def release(control: Control, pin_id: str) -> FleetRelease:
    async with control.pinning:
        made = control.pins.get(pin_id)
        if made is None:
            raise HTTPException(404, f"no live fleet pin {pin_id!r}")
        answers = await _release(control, made, list(made.backends))
    return FleetRelease(id=pin_id, backends=answers)


async def prefetch(control: Control, body: FleetPrefetchRequest) -> BackendPrefetch:
    (url,) = control.chosen([body.backend])
    reply = await control.ask(url, "POST", "/admin/prefetch", body.for_backend())
    return entry(BackendPrefetch, url, reply, fields(PREFETCH_FIELDS))


async def clear(control: Control, body: FleetClearRequest) -> FleetClear:
    """A tier (or all) cleared on ``body.backends``; a tenant's: its fleet pins released there first, then only its
    blocks dropped (each backend finds them by its namespace's root). A backend whose release failed says so."""
    urls = control.chosen(body.backends)
    failed: dict[str, BackendRelease] = {}
    released: list[str] = []
    if body.tenant is not None:
        released, failed = await _release_tenant(control, body, urls)
    sent = {} if body.tier is None else {"tier": body.tier.value}
    if body.tenant is not None:
        sent["tenant"] = body.tenant

    async def one(url: str) -> BackendClear:
        answer = entry(
            BackendClear, url, await control.ask(url, "POST", "/admin/clear", sent), fields(("dropped_blocks",))
        )
        if url in failed and answer.status is BackendStatus.OK:
            unpinned = failed[url]
            return answer.model_copy(update={"status": unpinned.status, "detail": f"pins kept: {unpinned.detail}"})
        return answer

    answers = await control.each(urls, one)
    return FleetClear(tier=body.tier, tenant=body.tenant, released_pins=released, backends=answers)


async def _release_tenant(
    control: Control, body: FleetClearRequest, urls: list[str]
) -> tuple[list[str], dict[str, BackendRelease]]:
    """The tenant's fleet pins on ``urls`` (in the tier, when it is host or disk) released: their ids, and the
    backends where a release failed (their first failure)."""
    tier = body.tier.value if body.tier is not None and body.tier.value in set(PinTier) else None
    if body.tier is not None and tier is None:
        return [], {}  # no fleet pin holds a block in that tier
    released: list[str] = []
    failed: dict[str, BackendRelease] = {}
    async with control.pinning:
        for made in control.pins.of_tenant(body.tenant, tier):
            there = [url for url in made.backends if url in urls]
            if not there:
                continue
            released.append(made.id)
            for answer in await _release(control, made, there):
                if answer.status is not BackendStatus.OK:
                    failed.setdefault(answer.url, answer)
    return released, failed


async def usage(control: Control) -> FleetUsage:
    async def one(url: str) -> BackendUsage:
        reply = await control.ask(url, "GET", "/stats")
        return entry(BackendUsage, url, reply, _usage_of)

    answers = await control.each(list(control.fleet.backends), one)
    return FleetUsage(backends=answers, tenants=_tenants(answers, control.pins.live()))


def _usage_of(body: Any) -> dict[str, Any]:
    stats = _Stats.model_validate(body)
    return {"tiers": stats.tiers, "ttl_pinned_blocks": stats.ttl_pinned_blocks, "tenants": stats.retained}


def _tenants(answers: list[BackendUsage], pins: list[FleetPin]) -> dict[str, TenantUsage]:
    out: dict[str, TenantUsage] = {}
    for answer in answers:
        for name, tiers in answer.tenants.items():
            tenant = out.setdefault(name, TenantUsage(retained={}, fleet_pins=0))
            for tier, kept in tiers.items():
                have = tenant.retained.get(tier, RetainedUsage(blocks=0, bytes=0, prefixes=0))
                tenant.retained[tier] = RetainedUsage(
                    blocks=have.blocks + kept.blocks,
                    bytes=have.bytes + kept.bytes,
                    prefixes=have.prefixes + kept.prefixes,
                )
    for made in pins:
        name = made.tenant if made.tenant is not None else "default"
        out.setdefault(name, TenantUsage(retained={}, fleet_pins=0)).fleet_pins += 1
    return out


# -- the routes ----------------------------------------------------------------------------------
_admin_key = HTTPBearer(auto_error=False, scheme_name="AdminToken", description="route.admin_token.")


def routes(control: Control) -> APIRouter:
    """``/fleet/*``, each behind the router's admin token; without one configured, every call is refused."""
    token = AdminToken(control.config.admin_token)

    async def admin(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_admin_key)]) -> None:
        if not token.allows(creds.credentials if creds else None):
            raise HTTPException(
                401,
                "the admin token is required: Authorization: Bearer <route.admin_token>",
                headers={"WWW-Authenticate": "Bearer"},
            )

    router = APIRouter(prefix="/fleet", dependencies=[Depends(admin)])

    @router.post("/lookup", response_model=FleetLookup)
    async def fleet_lookup(body: FleetLookupRequest) -> FleetLookup:
        """How much of a prompt each backend holds for a tenant, per tier (remote: what it would take from Redis)."""
        return await lookup(control, body)

    @router.post("/pins", response_model=FleetPinAnswer)
    async def fleet_pin(body: FleetPinRequest) -> FleetPinAnswer:
        """Keep a prefix on the chosen backends (or all) for ``ttl_s``; release it early with its id."""
        return await pin(control, body)

    @router.get("/pins", response_model=FleetPinList)
    async def fleet_pins() -> FleetPinList:
        return listed(control)

    @router.delete("/pins/{pin_id}", response_model=FleetRelease)
    async def fleet_unpin(pin_id: str) -> FleetRelease:
        """Release one fleet pin; the other fleet pins on its backends keep their promises."""
        return await release(control, pin_id)

    @router.post("/prefetch", response_model=BackendPrefetch)
    async def fleet_prefetch(body: FleetPrefetchRequest) -> BackendPrefetch:
        """Move a prompt's blocks up to one backend's host memory (from its disk, or Redis) before traffic moves."""
        return await prefetch(control, body)

    @router.post("/clear", response_model=FleetClear)
    async def fleet_clear(body: FleetClearRequest | None = None) -> FleetClear:
        return await clear(control, body or FleetClearRequest())

    @router.get("/usage", response_model=FleetUsage)
    async def fleet_usage() -> FleetUsage:
        """Per backend: each tier's bytes, blocks and hit rate, and per tenant what its promises keep."""
        return await usage(control)

    return router


__all__ = ["BackendStatus", "Control", "routes"]
