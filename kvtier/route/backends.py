"""The backends: which are up, how loaded each is, and what each is known (or believed) to hold.

A backend is up while its ``/health`` answers 200. One that stops answering,
or refuses a connection, is taken out at once: requests go elsewhere, its
index entries and sessions are dropped (it may come back empty), and the
health loop lets it back in when it answers again.

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

import httpx2 as httpx

from kvtier.route.choice import Ask, CacheAware, Candidate, Policy, Ranking, prefill_cost
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

    @property
    def load(self) -> int:
        return self.open_requests + self.others


@dataclass
class Fleet:
    """Every backend, the index of their blocks, and the policy that ranks them; one per router."""

    backends: dict[str, Backend]
    policy: Policy
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
        ranking = self.policy.rank(Ask(prompt.tokens, prompt.session), [self.candidate(b, prompt) for b in live])
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
        if isinstance(self.policy, CacheAware):
            self.policy.forget(backend.url)

    def bring_in(self, backend: Backend) -> None:
        if not backend.up:
            log.info("backend %s is up", backend.url)
        backend.up = True


async def check(fleet: Fleet, backend: Backend, client: httpx.AsyncClient, token: str | None) -> None:
    """One health check: ``/health``, then its load from ``/stats``, which a backend with a token asks for.

    A ``/stats`` refused (the router holds the wrong token) takes the backend
    out, loudly, rather than reading the error body as an idle backend.
    """
    try:
        health = await client.get(backend.url + "/health")
        if health.status_code != 200:
            fleet.take_out(backend, f"/health answered {health.status_code}")
            return
        fleet.bring_in(backend)
        open_now = backend.open_requests
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        stats = await client.get(backend.url + "/stats", headers=auth)
        if stats.status_code != 200:
            fleet.take_out(backend, f"/stats answered {stats.status_code}")
            return
        in_flight = int(stats.json().get("engine", {}).get("in_flight", 0))
        backend.others = max(0, in_flight - max(open_now, backend.open_requests))
    except (httpx.HTTPError, ValueError, TypeError) as err:
        fleet.take_out(backend, f"/health: {type(err).__name__}: {err}")


async def health_loop(fleet: Fleet, client: httpx.AsyncClient, interval_s: float, token: str | None) -> None:
    while True:
        await asyncio.gather(*(check(fleet, b, client, token) for b in fleet.backends.values()))
        await asyncio.sleep(interval_s)
