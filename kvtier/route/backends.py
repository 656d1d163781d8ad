"""The backends: which are up, how loaded each is, and what each is known (or believed) to hold.

A backend is up while its ``/health`` answers 200. One that stops answering,
or refuses a connection, is taken out at once: requests go elsewhere, its
index entries and sessions are dropped (it may come back empty), and the
health loop lets it back in when it answers again.

A ``/stats`` the router cannot read (not JSON, another shape, a count that
is no count) leaves the backend up, since its ``/health`` said so, with its
stats ignored: its load is this router's own requests alone. A check that
raises anything else, a bug or a peer nobody foresaw, takes only that
backend out; the loop goes on for the others (:func:`health_loop`).

Load is the requests this router has open there, known at once, plus those
others sent: the backend's own ``engine.in_flight`` at its last ``/stats``
less what this router had open there then. Only that difference is taken
from the poll, since a poll is up to a health interval old and this
router's own count never is. Beside the count, the prefill queued there:
each request adds the tokens it is predicted to prefill on that backend
(from the index, when it is sent) until its first token arrives; that is
the load the ``kvtier`` policy weighs, a request being as heavy as its miss.

What a backend holds is the index, when its events are live, extended by
what this router sent there itself beyond the index (a guess): the blocks
of a turn that just ended may reach the router after the next turn does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated

import httpx2 as httpx
import msgspec

from kvtier.route.choice import Ask, CacheAware, Candidate, Chooser, Ranking, prefill_cost
from kvtier.route.index import BlockIndex, RoutedPrefixes
from kvtier.route.prompt import RoutedPrompt
from kvtier.tiers.base import TierKind

log = logging.getLogger("kvtier.route")


@dataclass
class Backend:
    url: str
    up: bool = False
    events_live: bool = False  # its event stream is open and agrees on keys: the index is exact for it
    open_requests: int = 0  # sent by this router and not finished
    others: int = 0  # requests other clients had running there at the last /stats
    queued_tokens: int = 0  # prefill of this router's requests there that have no first token yet
    requests: int = 0
    failures: int = 0
    epoch: int = 0  # bumped when taken out: an event stream opened before then is stale
    bad_stats: int = 0  # /stats replies that could not be read, so ignored
    stats_readable: bool = True  # the last /stats was read: an unreadable one is logged when this flips
    check_errors: int = 0  # checks that raised what no clause names (logged the first time)
    event_overflows: int = 0  # event streams dropped for a line longer than route.max_event_line_bytes
    event_resyncs: int = 0  # ZMQ events: snapshots or replays asked for (a restart, a reconnect, a gap)
    event_resync_s: float | None = None  # the last one's round trip: asked -> its answer in the index

    @property
    def load(self) -> int:
        return self.open_requests + self.others

    def loaded(self, body: bytes, open_before: int) -> None:
        """Take others' requests from a ``/stats`` body; an unreadable one is ignored, counted, logged once."""
        try:
            in_flight = _STATS.decode(body).engine.in_flight
        except (msgspec.DecodeError, RecursionError) as err:
            self.bad_stats += 1
            if self.stats_readable:
                log.warning("backend %s: its /stats is unreadable (%s); load is this router's alone", self.url, err)
            self.stats_readable = False
            self.others = 0
            return
        self.stats_readable = True
        self.others = max(0, in_flight - max(open_before, self.open_requests))


class _Engine(msgspec.Struct):
    in_flight: Annotated[int, msgspec.Meta(ge=0)]


class _Stats(msgspec.Struct):
    """What the router reads of a backend's ``/stats``: requests running there, whoever sent them."""

    engine: _Engine


_STATS = msgspec.json.Decoder(_Stats)  # strict JSON: Infinity and NaN are no numbers here


@dataclass
class Fleet:
    """Every backend, the index of their blocks, and the policy that ranks them; one per router."""

    backends: dict[str, Backend]
    chooser: Chooser
    block_size: int
    index: BlockIndex = field(default_factory=BlockIndex)
    guesses: RoutedPrefixes = field(default_factory=lambda: RoutedPrefixes(65536))
    reasons: Counter[str] = field(default_factory=Counter)

    def up(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.up]

    def held(self, backend: Backend, prompt: RoutedPrompt) -> tuple[TierKind | None, ...]:
        """The fastest tier of each leading block of ``prompt`` on ``backend``; None where only routed there."""
        known = self.index.match(backend.url, prompt.keys) if backend.events_live else []
        routed = self.guesses.match(backend.url, prompt.keys)
        return (*known, *(None,) * (routed - len(known)))

    def candidate(self, backend: Backend, prompt: RoutedPrompt) -> Candidate:
        held = self.held(backend, prompt)
        return Candidate(backend.url, backend.load, held, backend.queued_tokens, backend.others)

    def prefill(self, backend: Backend, prompt: RoutedPrompt) -> int:
        """Tokens ``prompt`` is predicted to prefill on ``backend``: what it adds to the queue there."""
        return round(prefill_cost(prompt.tokens, self.held(backend, prompt), self.block_size))

    def rank(self, prompt: RoutedPrompt) -> Ranking | None:
        """Live backends, preferred first; None when none is up."""
        live = self.up()
        if not live:
            return None
        ranking = self.chooser.rank(Ask(prompt.tokens, prompt.session), [self.candidate(b, prompt) for b in live])
        self.reasons[ranking.reason] += 1
        return ranking

    def routed(self, backend: Backend, prompt: RoutedPrompt) -> None:
        self.guesses.routed(backend.url, prompt.keys)

    def take_out(self, backend: Backend, why: str) -> None:
        if backend.up:
            log.warning("backend %s is out: %s", backend.url, why)
        backend.up = False
        backend.events_live = False
        backend.epoch += 1
        backend.others = 0
        self.index.drop(backend.url)
        self.guesses.drop(backend.url)
        if isinstance(self.chooser, CacheAware):
            self.chooser.forget(backend.url)

    def bring_in(self, backend: Backend) -> None:
        if not backend.up:
            log.info("backend %s is up", backend.url)
        backend.up = True


async def _probe(backend: Backend, client: httpx.AsyncClient, token: str | None) -> httpx.Response | str:
    """``/health``, then ``/stats``: the latter's answer, or why the backend is not up.

    A ``/stats`` refused (the router holds the wrong token) takes the backend
    out, loudly, rather than reading the error body as an idle backend.
    """
    health = await client.get(backend.url + "/health")
    if health.status_code != 200:
        return f"/health answered {health.status_code}"
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    stats = await client.get(backend.url + "/stats", headers=auth)
    if stats.status_code != 200:
        return f"/stats answered {stats.status_code}"
    return stats


async def check(fleet: Fleet, backend: Backend, client: httpx.AsyncClient, token: str | None) -> None:
    """One health check; the backend is brought in only once both answers are in, so a refusal never flaps it."""
    open_before = backend.open_requests
    try:
        stats = await _probe(backend, client, token)
    except httpx.HTTPError as err:
        fleet.take_out(backend, f"/health: {type(err).__name__}: {err}")
        return
    if isinstance(stats, str):
        fleet.take_out(backend, stats)
        return
    fleet.bring_in(backend)
    backend.loaded(stats.content, open_before)


async def _guarded(fleet: Fleet, backend: Backend, client: httpx.AsyncClient, token: str | None) -> None:
    """:func:`check`, whatever it raises: one backend's failure must never end the loop for all the others."""
    try:
        await check(fleet, backend, client, token)
    except Exception as err:  # the loop's one broad catch (see above): counted, logged once, that backend out
        backend.check_errors += 1
        if backend.check_errors == 1:
            log.exception("the health check of backend %s raised; it stays out until a check passes", backend.url)
        fleet.take_out(backend, f"its check raised {type(err).__name__}")


async def health_loop(fleet: Fleet, client: httpx.AsyncClient, interval_s: float, token: str | None) -> None:
    while True:
        await asyncio.gather(*(_guarded(fleet, b, client, token) for b in fleet.backends.values()))
        await asyncio.sleep(interval_s)
