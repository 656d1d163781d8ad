"""The benchmarks' client side: one streamed completion against a ``kvtier serve``, timed at the client.

TTFT is request sent → the first server-sent event that carries generated
text or an end (a chat stream opens with a chunk naming only the role, sent
before the prompt is prefilled: it is not a first token). The usage chunk is asked for, so a caller
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
    text: str = ""  # what the stream generated

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
    return _streamed(port, "/v1/completions", body, headers, timeout)


def stream_chat(
    port: int,
    messages: list[dict[str, str]],
    max_tokens: int = 1,
    headers: dict[str, str] | None = None,
    timeout: float = 900,
) -> Streamed:
    """One greedy streamed ``/v1/chat/completions`` on 127.0.0.1:``port``, read to its end (its text kept)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return _streamed(port, "/v1/chat/completions", body, headers, timeout)


def _streamed(port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None, timeout: float) -> Streamed:
    body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    ttft: float | None = None
    usage: dict[str, Any] = {}
    text: list[str] = []
    try:
        started = time.perf_counter()
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        if response.status != 200:
            return Streamed(None, usage, f"HTTP {response.status}: {response.read()[:300]!r}")
        for line in response:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return Streamed(ttft, usage, None if usage else "the stream ended without usage", "".join(text))
            event = json.loads(data)
            if "error" in event:
                return Streamed(ttft, usage, f"error event: {event['error'].get('message', '')[:200]}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                if ttft is None and (text[-1] or choice.get("finish_reason")):  # not a chat's opening role chunk
                    ttft = time.perf_counter() - started
        return Streamed(ttft, usage, "the stream ended without [DONE]")
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
        return Streamed(ttft, usage, f"{type(err).__name__}: {err}")
    finally:
        conn.close()
