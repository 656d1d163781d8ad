"""The benchmarks' client side: one streamed completion against a ``kvtier serve``, timed at the client.

TTFT is request sent → first server-sent event (a completion stream's first
event carries the first token). The usage chunk is asked for, so a caller
also learns the tokens the server served from cache; a stream that ends
without usage and ``[DONE]``, an error event or an HTTP error is reported as
an error string, never raised, so a load test can count it.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Streamed:
    ttft_s: float | None
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def checked(self) -> Streamed:
        """This answer, or ``RuntimeError`` for a failed one (benchmarks that cannot go on without it)."""
        if self.error is not None or self.ttft_s is None:
            raise RuntimeError(self.error or "the stream carried no event")
        return self


def stream_completion(
    port: int, prompt: list[int], max_tokens: int = 1, headers: dict[str, str] | None = None, timeout: float = 900
) -> Streamed:
    """One greedy streamed ``/v1/completions`` on 127.0.0.1:``port``, read to its end."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    ttft: float | None = None
    usage: dict[str, Any] = {}
    try:
        started = time.perf_counter()
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
        )
        response = conn.getresponse()
        if response.status != 200:
            return Streamed(None, usage, f"HTTP {response.status}: {response.read()[:300]!r}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - started
            data = line[6:].strip()
            if data == b"[DONE]":
                return Streamed(ttft, usage, None if usage else "the stream ended without usage")
            event = json.loads(data)
            if "error" in event:
                return Streamed(ttft, usage, f"error event: {event['error'].get('message', '')[:200]}")
            usage = event.get("usage") or usage
        return Streamed(ttft, usage, "the stream ended without [DONE]")
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        return Streamed(ttft, usage, f"{type(err).__name__}: {err}")
    finally:
        conn.close()
