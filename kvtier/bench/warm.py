"""The next turn warmed while a tool runs: later-turn TTFT with ``session.warm_next_turn`` on and off.

(c) of ``kvtier bench agents``. Two ``kvtier serve`` processes whose configs
differ only in ``session.warm_next_turn`` see the same client:

* **turns**: ``agents`` chat sessions, one after another, ``turns`` turns
  each. A session opens with real files (the demo's) and a question; each
  turn streams a greedy reply of up to ``reply_tokens``, then the agent
  "runs a tool" for 0.5-2 s (a pause drawn from a fixed seed: the tool's
  run is the one thing simulated here) and sends the transcript back with
  the assistant's reply and a short tool result (``tool_chars`` of real
  text). TTFT at the client of every turn after the first;
  ``warm_speedup`` is the ratio of the two sides' medians. Without warming
  the next turn prefills the reply again wherever the engine does not cache
  decode-computed KV (``engine.decoded_kv``: bfloat16 by default), which the
  JSON records with the engine's dtype.
* **concurrent**: does warming cost a request that arrives while it runs?
  ``trials`` times: a fresh session's turn ends (its warm starts), the
  client waits until ``/stats`` shows a warm running, then sends an
  anonymous request (a cached document plus a new question) and times its
  first token. ``concurrent_ttft_ratio`` is its median with warming on, over
  the trials in which it did stop a warm, against its median with warming
  off (where nothing runs beside it); ``/admin/settle`` separates trials.

``same_output``: every reply, both phases, equal on both sides. Sides
alternate ``reps`` times; medians over everything each side measured.
"""

from __future__ import annotations

import functools
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.client import Streamed, stream_chat
from kvtier.bench.fleet import Proc
from kvtier.bench.soak import serving
from kvtier.demo.session import load_session

ADMIN = "kvtier-bench-warm-admin-token"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
WAIT_POLLS = 2000  # /stats reads before a trial gives up on seeing its warm start (it counts as missed)


@dataclass(frozen=True)
class WarmSpec:
    agents: int = 3
    turns: int = 4
    reply_tokens: int = 128
    tool_chars: int = 120  # a short tool result beside the transcript
    files_per_agent: int = 2  # demo files in a session's first message (~800 tokens)
    pause_s: tuple[float, float] = (0.5, 2.0)
    trials: int = 20
    reps: int = 2
    seed: int = 7

    def sections(self, warm: bool) -> dict[str, Any]:
        return {"server": {"admin_token": ADMIN}, "session": {"warm_next_turn": warm}}


@functools.cache
def _texts() -> tuple[str, ...]:
    """The demo session's files: every opening, tool result and document here is cut from them."""
    return tuple(t["tool"]["content"] for t in load_session()["turns"])


def _opening(spec: WarmSpec, agent: int) -> list[dict[str, str]]:
    texts = _texts()
    files = [texts[(agent * spec.files_per_agent + i) % len(texts)] for i in range(spec.files_per_agent)]
    return [
        {"role": "system", "content": "You are a coding agent. Read the files and say what to change."},
        {"role": "user", "content": "\n\n".join(files) + "\n\nWhat does this code do, and what would you fix first?"},
    ]


def _tool_result(spec: WarmSpec, agent: int, turn: int) -> str:
    texts = _texts()
    source = texts[(agent * 5 + turn * 3 + 1) % len(texts)]
    start = (turn * 97) % max(1, len(source) - spec.tool_chars)
    return "Tool output:\n" + source[start : start + spec.tool_chars]


def _chat(server: Proc, messages: list[dict[str, str]], max_tokens: int, session: str | None) -> Streamed:
    headers = {} if session is None else {"X-Session-ID": session}
    return stream_chat(server.port, messages, max_tokens, headers).checked()


def _warming(server: Proc) -> dict[str, Any]:
    reply = server.get("/stats", headers=AUTH)
    reply.raise_for_status()
    return reply.json()["engine"]["warming"]


def _settle(server: Proc) -> None:
    server.post("/admin/settle", headers=AUTH).raise_for_status()


def drive_turns(server: Proc, spec: WarmSpec, pause: Callable[[float], None]) -> tuple[list[float], list[str]]:
    """Every session's turns in order: later-turn TTFTs and every reply."""
    rng = random.Random(spec.seed)
    ttfts: list[float] = []
    replies: list[str] = []
    for agent in range(spec.agents):
        messages = _opening(spec, agent)
        for turn in range(spec.turns):
            got = _chat(server, messages, spec.reply_tokens, f"warm-agent-{agent}")
            assert got.ttft_s is not None
            if turn > 0:
                ttfts.append(got.ttft_s)
            replies.append(got.text)
            pause(rng.uniform(*spec.pause_s))  # the tool runs
            tool = _tool_result(spec, agent, turn)
            messages = [*messages, {"role": "assistant", "content": got.text}, {"role": "user", "content": tool}]
        _settle(server)
    return ttfts, replies


def drive_concurrent(server: Proc, spec: WarmSpec, warm: bool) -> tuple[list[float], list[bool], list[str]]:
    """Requests sent while a warm runs (warming off: at the same point): TTFTs, whether each stopped one, replies."""
    texts = _texts()
    document = {"role": "user", "content": "\n\n".join(texts[-2:])}
    _chat(server, [document], 1, None)  # cached before the trials: each arrival is a hit plus a new question
    ttfts, stopped, replies = [], [], []
    for trial in range(spec.trials):
        _settle(server)
        before = _warming(server)
        opener = _opening(spec, spec.agents + trial)
        turn = _chat(server, opener, spec.reply_tokens, f"warm-trial-{trial}")
        replies.append(turn.text)
        if warm:
            for _ in range(WAIT_POLLS):
                now = _warming(server)
                if now["running"] or now["finished"] > before["finished"]:
                    break
        question = {"role": "user", "content": f"Question {trial}: which function above is the longest, and why?"}
        got = _chat(server, [document, {"role": "assistant", "content": "Read."}, question], 1, None)
        assert got.ttft_s is not None
        ttfts.append(got.ttft_s)
        replies.append(got.text)
        after = _warming(server)
        stopped.append(after["interrupted"] + after["superseded"] > before["interrupted"] + before["superseded"])
    _settle(server)
    return ttfts, stopped, replies


@dataclass
class Side:
    later_turn_ttft_s: list[float]
    concurrent_ttft_s: list[float]
    stopped_a_warm: list[bool]
    replies: list[str]
    warming: dict[str, Any]
    engine: dict[str, Any]


def run_side(spec: WarmSpec, warm: bool, pause: Callable[[float], None]) -> Side:
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-warm-") as tmp,
        serving(None, Path(tmp), spec.sections(warm)) as server,
    ):
        later, replies = drive_turns(server, spec, pause)
        concurrent, stopped, more = drive_concurrent(server, spec, warm)
        stats = server.get("/stats", headers=AUTH).json()
        hardware = stats.get("hardware") or {}
    return Side(later, concurrent, stopped, replies + more, stats["engine"]["warming"], hardware)


def run_warm(
    spec: WarmSpec, pause: Callable[[float], None], progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Both sides, alternating ``reps`` times; the figures of :mod:`kvtier.bench.warm`'s docstring."""
    sides: dict[str, list[Side]] = {"plain": [], "warm": []}
    for rep in range(spec.reps):
        for name, on in (("plain", False), ("warm", True)):
            if progress is not None:
                progress(f"warm: {name} {rep + 1}/{spec.reps}")
            sides[name].append(run_side(spec, on, pause))
    later = {n: statistics.median(t for s in ss for t in s.later_turn_ttft_s) for n, ss in sides.items()}
    plain_arrivals = [t for s in sides["plain"] for t in s.concurrent_ttft_s]
    warm_arrivals = [
        t for s in sides["warm"] for t, hit in zip(s.concurrent_ttft_s, s.stopped_a_warm, strict=True) if hit
    ]
    replies = [s.replies for ss in sides.values() for s in ss]
    ratio = statistics.median(warm_arrivals) / statistics.median(plain_arrivals) if warm_arrivals else None
    return {
        "later_turn_ttft_s": later,
        "warm_speedup": later["plain"] / later["warm"],
        "same_output": all(r == replies[0] for r in replies),
        "concurrent_ttft_ratio": ratio,
        "concurrent_ttft_s": {
            "plain": statistics.median(plain_arrivals),
            "warm": statistics.median(warm_arrivals) if warm_arrivals else None,
        },
        "arrivals_that_stopped_a_warm": f"{len(warm_arrivals)}/{spec.trials * spec.reps}",
        "warming": sides["warm"][-1].warming,
        "engine": {**sides["warm"][-1].engine, "decoded_kv_cached": _decoded_cached(spec)},
        "spec": asdict(spec),
    }


def _decoded_cached(spec: WarmSpec) -> bool:
    """Whether the servers cached decode-computed KV (``engine.decoded_kv`` resolved on this machine)."""
    from kvtier.config import Config
    from kvtier.engine.runtime import cache_decoded

    return cache_decoded(Config.model_validate(spec.sections(True)))


__all__ = ["WarmSpec", "run_warm"]
