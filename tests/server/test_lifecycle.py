"""A real ``kvtier serve`` across its life: clients that leave, then SIGTERM and a restart that keeps the cache."""

from __future__ import annotations

import json
import selectors
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvtier.bench.faults_process import stream_then_leave
from tests.server.live import LiveServer, running


def until(server: LiveServer, check: Callable[[dict[str, Any]], bool], timeout_s: float = 60) -> dict[str, Any]:
    """Poll /stats until ``check`` holds (each poll is one request: the server is the clock here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.stats()
        if check(stats) or time.monotonic() > deadline:
            return stats


def chat_body(text: str, **extra: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": text}], **extra}).encode()


def send_then_leave(server: LiveServer) -> None:
    """A non-streaming request whose client closes the connection once the engine has it."""
    url = urlparse(server.url)
    body = chat_body("Write a long poem about the sea.", max_tokens=900, temperature=0)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((url.hostname, url.port), timeout=120) as sock:
        sock.sendall(head.encode() + body)
        stats = until(server, lambda s: s["engine"]["in_flight"] == 1)
        assert stats["engine"]["in_flight"] == 1
        sock.shutdown(socket.SHUT_RDWR)


def test_clients_that_leave_abort_and_sigterm_keeps_the_host_tier(tmp_path: Path) -> None:
    question = "Explain, in two sentences, why caches make agents faster. " * 8
    with running(tmp_path) as server:
        assert stream_then_leave(urlparse(server.url).port, 0) == 3  # the chaos run's disconnect, once
        stats = until(server, lambda s: s["engine"]["requests"]["abort"] == 1 and s["engine"]["in_flight"] == 0)
        assert (stats["engine"]["requests"]["abort"], stats["engine"]["in_flight"]) == (1, 0)
        send_then_leave(server)
        stats = until(server, lambda s: s["engine"]["requests"]["abort"] == 2 and s["engine"]["in_flight"] == 0)
        assert (stats["engine"]["requests"]["abort"], stats["engine"]["in_flight"]) == (2, 0)
        assert stats["engine"]["requests"]["length"] == 0  # neither ran on to its max_tokens
        device = stats["tiers"]["device"]
        assert device["used_bytes"] == device["blocks"] * device["capacity_bytes"] // device["capacity_blocks"]

        first = server.post("/v1/chat/completions", json=json.loads(chat_body(question, max_tokens=8, temperature=0)))
        assert first.status_code == 200, first.text
        assert server.stats()["tiers"]["disk"]["blocks"] == 0  # write_back: host only, until the exit
    assert server.process.returncode is not None
    assert "Traceback" not in server.log.read_text()

    with running(tmp_path) as again:
        second = again.post("/v1/chat/completions", json=json.loads(chat_body(question, max_tokens=8, temperature=0)))
        assert second.status_code == 200, second.text
        usage = second.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 16 * 16
        assert second.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]


def test_half_sent_requests_are_cut_off_and_others_are_served(tmp_path: Path) -> None:
    """200 clients send part of a request and stop; each is closed by the server, a whole request meanwhile works."""
    with running(tmp_path, read_timeout_s=2, max_connections=512) as server:
        url = urlparse(server.url)
        partial = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        halves = [partial, partial + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "he']
        socks = []
        try:
            for i in range(200):
                sock = socket.create_connection((url.hostname, url.port), timeout=120)
                sock.sendall(halves[i % 2])
                socks.append(sock)
            whole = server.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 2
            closed = 0
            with selectors.DefaultSelector() as sel:
                for sock in socks:
                    sel.register(sock, selectors.EVENT_READ)
                while closed < len(socks):
                    ready = sel.select(timeout=120)
                    assert ready, f"{len(socks) - closed} half-sent connections still open"
                    for key, _ in ready:
                        assert key.fileobj.recv(1024) == b""  # EOF: closed by the server, nothing answered
                        sel.unregister(key.fileobj)
                        closed += 1
        finally:
            for sock in socks:
                sock.close()
        assert server.get("/health").status_code == 200
