"""A real ``kvtier serve`` in a subprocess, on a free loopback port, with a temp data_dir and small tiers.

Also the greedy reference the server's outputs are compared with: the same
model in this process, with no cache at all (``cache=None``, nothing kept
resident), so any difference the cache or batching made would show.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench import fleet
from kvtier.config import Config, load_config
from kvtier.engine.engine import Completion
from kvtier.engine.runtime import LoadedModel, make_engine
from kvtier.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
B = 16  # block_size, the default
BLOCK_BYTES = 46080 * B  # one fp32 block of SmolLM2-135M: 30 layers x K and V x 3 heads x 64 x 4 bytes, per token
ADMIN = "admin-token-for-tests-0123456789"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}  # the admin token also opens /stats, /metrics and the schema
SIZES: dict[str, Any] = {
    "engine": {"pool_bytes": 400 * BLOCK_BYTES, "dtype": "float32"},  # 400 blocks
    "host": {"capacity_bytes": "64MiB"},
    "disk": {"capacity_bytes": "128MiB"},
}


@dataclass
class LiveServer(fleet.Proc):
    """A ``kvtier serve`` process (:class:`kvtier.bench.fleet.Proc`, the one handle the benches use too),
    with the admin token of :func:`config_tree`."""

    def admin_post(self, path: str, body: dict[str, Any] | None = None) -> requests.Response:
        return self.post(path, json=body, headers=ADMIN_AUTH)

    def read(self, path: str) -> requests.Response:
        """GET a readers' route (``/stats``, ``/metrics``, the schema) with the token they ask for."""
        return self.get(path, headers=ADMIN_AUTH)

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def stats(self) -> dict[str, Any]:
        response = self.read("/stats")
        response.raise_for_status()
        return response.json()


def config_tree(tmp: Path, server: dict[str, Any], sections: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"data_dir": str(tmp / "data"), **SIZES, "server": {"admin_token": ADMIN, **server}, **(sections or {})}


@contextmanager
def running(
    tmp: Path, sections: dict[str, Any] | None = None, *, verbose: bool = False, **server: Any
) -> Iterator[LiveServer]:
    """``kvtier serve`` with ``server`` settings (and other config ``sections``); SIGTERM, then SIGKILL, on exit.

    ``verbose``: ``kvtier -v``, INFO logs (what a test that reads the log wants to see all of).
    """
    proc = fleet.start(tmp, config_tree(tmp, server, sections), [*(["-v"] if verbose else []), "serve"])
    live = LiveServer(proc.url, proc.process, proc.log)
    try:
        fleet.wait_until(live, fleet.healthy, timeout_s=120)
        yield live
    finally:
        live.stop()


# -- the reference -------------------------------------------------------------------------------------
def reference_config(tmp: Path) -> Config:
    cfg = load_config(environ={"KVTIER_DATA_DIR": str(tmp / "ref-data")})
    tree = cfg.model_dump()
    tree["engine"] = {**tree["engine"], **SIZES["engine"]}
    return Config.model_validate(tree)


class Reference:
    """Greedy outputs with no cache: what every server answer must equal, token for token."""

    def __init__(self, loaded: LoadedModel, tmp: Path) -> None:
        self.loaded = loaded
        self._engine = make_engine(loaded, reference_config(tmp), cache=None, keep_resident=False)

    def run(self, ids: list[int], max_tokens: int) -> Completion:
        (done,) = self._engine.generate([ids], SamplingParams(max_tokens=max_tokens))
        return done

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[int], Completion]:
        ids = self.loaded.chat_ids(messages)
        return ids, self.run(ids, max_tokens)


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus exposition as ``{(sample name, sorted labels): value}``."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
