"""Real ``kvtier serve`` backends and a real ``kvtier route`` in front of them (:mod:`kvtier.bench.fleet`),
with the small tiers of the server tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench import fleet as processes
from kvtier.bench.fleet import Proc
from tests.server.live import ADMIN, SIZES

__all__ = ["Fleet", "Proc", "fleet"]


@dataclass
class Fleet:
    router: Proc
    backends: list[Proc]

    def stats(self) -> dict[str, Any]:
        return self.router.get("/stats").json()


@contextmanager
def fleet(tmp: Path, n: int, policy: str = "kvtier", sizes: dict[str, Any] | None = None) -> Iterator[Fleet]:
    """``n`` backends (``sizes`` over the small test tiers) and a router with ``policy`` in front."""
    tiers = {**SIZES, **(sizes or {})}
    route = {"policy": policy, "health_interval_s": 0.5}
    with (
        processes.backends(tmp, n, tiers, ADMIN) as backends,
        processes.router(tmp / "router", backends, tiers["engine"], route) as router,
    ):
        yield Fleet(router, backends.procs)
