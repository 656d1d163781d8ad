"""Real ``kvtier serve`` backends and a real ``kvtier route`` in front of them (:mod:`kvtier.bench.fleet`),
with the small tiers of the server tests."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from kvtier.bench import fleet as processes
from kvtier.bench.fleet import Proc
from kvtier.config import load_config
from kvtier.route.prompt import Prompts
from tests.server.live import ADMIN, SIZES

__all__ = ["ROUTER_ADMIN", "Fleet", "Proc", "fleet", "held"]

ROUTER_ADMIN = "router-admin-token-0123456789"  # route.admin_token: the fleet control routes'


@dataclass
class Fleet:
    router: Proc
    backends: list[Proc]

    def stats(self) -> dict[str, Any]:
        return self.router.get("/stats").json()

    def control(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """A fleet control call with the router's admin token; its answer, which must be a 200."""
        auth = {"Authorization": f"Bearer {ROUTER_ADMIN}"}
        response = requests.request(method, self.router.url + path, json=body, headers=auth, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def prompts(self) -> Prompts:
        """The router's own prompt reader, from its config file: the keys it computes for a request."""
        return Prompts(load_config(self.router.log.parent / "kvtier.yaml"))

    def indexed(self, backend: Proc) -> dict[str, int]:
        """Keys per tier the router's index holds for ``backend``."""
        return next(b["indexed_by_tier"] for b in self.stats()["backends"] if b["url"] == backend.url)

    def agree(self, backend: Proc, timeout_s: float = 10) -> dict[str, int]:
        """The router's index of ``backend`` once it matches what the backend holds (fails after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            want, got = {t: len(k) for t, k in held(backend).items() if k}, self.indexed(backend)
            if want == got or time.monotonic() > deadline:
                assert got == want
                return got
            time.sleep(0.1)


def held(backend: Proc) -> dict[str, list[str]]:
    """Keys (hex) per tier from a fresh subscription's snapshot: what the backend holds now."""
    with requests.get(
        backend.url + "/v1/kv-events", headers={"Authorization": f"Bearer {ADMIN}"}, stream=True, timeout=30
    ) as response:
        lines = response.iter_lines()
        next(lines)  # hello
        snapshot = json.loads(next(lines))
    return snapshot["tiers"]


@contextmanager
def fleet(tmp: Path, n: int, policy: str = "kvtier", sizes: dict[str, Any] | None = None) -> Iterator[Fleet]:
    """``n`` backends (``sizes`` over the small test tiers) and a router with ``policy`` in front."""
    tiers = {**SIZES, **(sizes or {})}
    route = {"policy": policy, "health_interval_s": 0.5, "admin_token": ROUTER_ADMIN}
    with (
        processes.backends(tmp, n, tiers, ADMIN) as backends,
        processes.router(tmp / "router", backends, tiers["engine"], route) as router,
    ):
        yield Fleet(router, backends.procs)
