"""The router's fleet pins: each a promise, with an id, to keep one prefix on some backends for a TTL.

A backend keeps a TTL pin per block key and tier, with one expiry: pinning
again moves it, and unpinning (``ttl_s`` 0) lets the keys go whoever asked
(:mod:`kvtier.pins`). So the router keeps the account. Two fleet pins of one
prefix on one backend are two promises: releasing one must leave the other
standing, with its own expiry. Releasing a pin on a backend therefore
unpins its prefix there (unless another live pin asks for the very same
prefix), then pins again every other live fleet pin of that backend, tier
and tenant, the longest last, so a block shared by several prefixes keeps the
longest promise over it (as the server's retention registry does for its
clients' promises).

Nothing here talks to a backend: :mod:`kvtier.route.control` does, and
asks this book what to send. Expiry is lazy, on the book's clock.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class FleetPin:
    id: str
    body: dict[str, Any]  # what each backend's POST /admin/pin gets, but its ttl_s: prompt or messages, tenant, tier
    tenant: str | None
    tier: str
    ttl_s: float
    until: float  # on the book's clock
    backends: list[str]  # where it holds: the backends that answered its pin

    def left_s(self, now: float) -> float:
        return max(0.0, self.until - now)


class PinBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._pins: dict[str, FleetPin] = {}
        self._clock = clock

    def now(self) -> float:
        return self._clock()

    def add(self, body: dict[str, Any], ttl_s: float, backends: list[str]) -> FleetPin:
        """A new promise over ``backends`` (those that pinned it), from now for ``ttl_s``."""
        pin = FleetPin(
            secrets.token_hex(8),
            body,
            body.get("tenant"),
            body["tier"],
            ttl_s,
            self._clock() + ttl_s,
            list(backends),
        )
        if pin.backends:
            self._pins[pin.id] = pin
        return pin

    def live(self) -> list[FleetPin]:
        self._expire()
        return list(self._pins.values())

    def get(self, pin_id: str) -> FleetPin | None:
        self._expire()
        return self._pins.get(pin_id)

    def drop(self, pin: FleetPin, backends: Iterable[str]) -> None:
        """``pin`` no longer holds on ``backends``; with none left it is gone."""
        gone = set(backends)
        pin.backends = [b for b in pin.backends if b not in gone]
        if not pin.backends:
            self._pins.pop(pin.id, None)

    def standing(self, backend: str, but: FleetPin) -> list[FleetPin]:
        """The other live pins of ``but``'s tenant and tier on ``backend``, the shortest first: the order to pin
        them again in. Another tenant's never shares a block with it (the namespace enters every key)."""
        self._expire()
        others = [
            p
            for p in self._pins.values()
            if p is not but and (p.tenant, p.tier) == (but.tenant, but.tier) and backend in p.backends
        ]
        return sorted(others, key=lambda p: p.until)

    def of_tenant(self, tenant: str | None, tier: str | None) -> list[FleetPin]:
        """Live pins of ``tenant`` (in ``tier``, or any)."""
        return [p for p in self.live() if p.tenant == tenant and (tier is None or p.tier == tier)]

    def _expire(self) -> None:
        now = self._clock()
        for pin_id in [i for i, p in self._pins.items() if p.until <= now]:
            del self._pins[pin_id]


def same_prefix(a: FleetPin, b: FleetPin) -> bool:
    """The same request body: the same prefix for the same tenant (other bodies may be too; then it is unpinned
    and pinned again, which is right, only not the shortest way)."""
    return a.body == b.body


__all__ = ["FleetPin", "PinBook", "same_prefix"]
