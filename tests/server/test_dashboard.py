"""/dashboard in real headless Chromium, against a real ``kvtier serve``: its figures move with the server's.

Chromium is driven over the DevTools protocol (its page's websocket, found
through the port it announces and its ``/json/list``). The test reads the
page's figures from the DOM (each carries its raw number in ``data-value``),
sends requests, waits on the DOM changing (polled with Runtime.evaluate under
a deadline), checks the page agrees with ``/stats``, and saves a screenshot
to bench/results/dashboard.png. Shadow verification is on at every hit, and
the engine keeps nothing resident, so the repeated prompt is served from the
host tier and then verified while the engine is idle. The server has a read
token, which the browser hands over the only way it can, ``?token=`` once.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
import websocket

from tests.server.live import ROOT, SIZES, LiveServer, metric_values, running

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (`make setup` installs it)"
)

SCREENSHOT = ROOT / "bench" / "results" / "dashboard.png"
PROMPT = "An agent reads a file, calls a tool, and resends its whole transcript every turn. " * 6
DEADLINE_S = 120.0
READ = "read-token-for-the-dashboard-0123"

FIGURES_JS = """JSON.stringify(Object.fromEntries(
  [...document.querySelectorAll('[data-value]')].map(e => [e.id, e.dataset.value])))"""


@dataclass
class Page:
    """One page target of a running Chromium, spoken to over its DevTools websocket."""

    ws: websocket.WebSocket
    ids: Iterator[int]

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One command and its answer (events that arrive meanwhile are skipped)."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") != msg_id:
                continue
            if "error" in reply:
                raise RuntimeError(f"{method}: {reply['error']}")
            return reply["result"]

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def figures(self) -> dict[str, float | None]:
        raw = json.loads(self.evaluate(FIGURES_JS))
        return {k: float(v) if v not in ("", None) else None for k, v in raw.items()}

    def wait_for(self, what: str, ok: Callable[[dict[str, float | None]], bool]) -> dict[str, float | None]:
        """Poll the DOM until ``ok(figures)``; fail with the last figures after the deadline."""
        deadline = time.monotonic() + DEADLINE_S
        figures = self.figures()
        while not ok(figures):
            if time.monotonic() > deadline:
                raise AssertionError(f"the page never showed {what}; last figures: {figures}")
            self.evaluate("new Promise(r => setTimeout(r, 100))")  # let the page run a little, then look again
            figures = self.figures()
        return figures


def _devtools_port(process: subprocess.Popen[bytes]) -> int:
    """The port Chromium chose (``--remote-debugging-port=0``), from the line it prints once it listens.

    It also writes the port to ``DevToolsActivePort`` in the profile, but
    after that line, so the file can be missing when the line arrives: the
    line is the event to block on, and it carries the same port.
    """
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        text = line.decode(errors="replace").strip()
        seen.append(text)
        if text.startswith("DevTools listening on "):
            return urlsplit(text.removeprefix("DevTools listening on ")).port or 0
    pytest.skip(f"chromium cannot run here; it exited with: {' | '.join(seen[-3:])}")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Page]:
    assert CHROMIUM is not None
    profile = tmp_path / "chromium-profile"
    process = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--no-first-run",
            "--window-size=1280,800",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    ws = None
    try:
        port = _devtools_port(process)
        targets = requests.get(f"http://127.0.0.1:{port}/json/list", timeout=30).json()
        page = next(t for t in targets if t["type"] == "page")
        ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        yield Page(ws, itertools.count(1))
    finally:
        if ws is not None:
            ws.close()
        process.terminate()  # by its own handle: only the Chromium this test started
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    sections = {
        "engine": {**SIZES["engine"], "keep_resident": False},  # a repeat is served by the host tier, not the pool
        "cache": {"write_mode": "write_through"},
        "verify": {"shadow_fraction": 1.0},
    }
    with running(tmp_path / "serve", sections, read_token=READ) as live:
        yield live


def _complete(server: LiveServer, session: str) -> None:
    model = server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    response = server.post("/v1/completions", json=body, headers={"X-Session-ID": session})
    response.raise_for_status()


def _wait_stats(server: LiveServer, what: str, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + DEADLINE_S
    stats = server.stats()
    while not ok(stats):
        if time.monotonic() > deadline:
            raise AssertionError(f"/stats never showed {what}: {stats['engine']}")
        stats = server.stats()
    return stats


def test_the_dashboard_follows_the_server_in_real_chromium(server: LiveServer, browser: Page) -> None:
    page = server.get("/dashboard", headers={"Authorization": f"Bearer {READ}"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]

    browser.send("Emulation.setDeviceMetricsOverride", width=1280, height=800, deviceScaleFactor=1, mobile=False)
    browser.send("Page.navigate", url=f"{server.url}/dashboard?token={READ}&interval=250")
    before = browser.wait_for("a first update", lambda f: (f.get("updates") or 0) >= 1)
    # The token left the address for an HttpOnly cookie, which the page's fetches of /stats carry.
    assert browser.evaluate("location.pathname + location.search") == "/dashboard?interval=250"
    assert browser.evaluate("document.cookie") == ""
    assert before["requests"] == 0 and before["verify-verified"] == 0

    _complete(server, "agent-1")
    blocks = server.stats()["engine"]["prefill_tokens_computed"] // 16
    _wait_stats(server, "the first prompt's blocks in host", lambda s: s["tiers"]["host"]["blocks"] >= blocks)
    _complete(server, "agent-1")  # the same transcript again: served from host, then verified while idle
    stats = _wait_stats(server, "the hit verified", lambda s: s["engine"]["verify"]["verified"] >= 1)
    e, v = stats["engine"], stats["engine"]["verify"]

    after = browser.wait_for(
        "the two requests and the verification",
        lambda f: f["requests"] == 2 and f["verify-verified"] == v["verified"] and f["tokens-skipped"] > 0,
    )
    assert after["tokens-skipped"] == e["prefill_tokens_skipped"] > 0
    assert after["tokens-computed"] == e["prefill_tokens_computed"]
    skipped, computed = e["prefill_tokens_skipped"], e["prefill_tokens_computed"]
    assert after["hit-rate"] == pytest.approx(skipped / (skipped + computed))
    assert after["ttft-saved"] == pytest.approx(e["prefill_seconds_saved_estimate"]) and after["ttft-saved"] > 0
    assert (after["verify-sampled"], after["verify-blocks"]) == (v["sampled"], v["blocks_verified"])
    assert after["verify-mismatched"] == v["mismatched_blocks"] == 0
    metrics = metric_values(server.read("/metrics").text)
    assert metrics[("kvtier_verify_verified_total", ())] == v["verified"]
    assert metrics[("kvtier_verify_mismatched_blocks_total", ())] == 0
    assert after["updates"] > before["updates"]
    host_used = browser.evaluate("document.getElementById('tier-host').dataset.usedBytes")
    assert int(host_used) == stats["tiers"]["host"]["used_bytes"] > 0
    assert int(browser.evaluate("document.getElementById('chart-hit-rate').dataset.points")) >= 2
    assert browser.evaluate("document.querySelectorAll('#break-even tbody tr').length") > 0

    shot = browser.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.write_bytes(base64.b64decode(shot["data"]))
