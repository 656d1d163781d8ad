"""Replay a multi-turn agent session twice: full recompute, then with kvtier.

The session (``agent_session.json``, shipped with the package) is a coding
agent reading this project's own files, one tool result per turn; like every
agent, it resends the whole transcript each turn. Both passes use the same
engine code and the same loaded weights; the only difference is whether
block keys lead to cached KV (host and disk tiers in a temporary data
directory). Stores are drained between turns, standing in for the time a tool
call takes, so every turn sees the blocks of the turns before it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvtier.config import Config
from kvtier.engine.engine import Completion, Engine
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams

# Of the cached pass's hits, recomputed between turns and compared with the KV served (kvtier.engine.verify).
SHADOW_FRACTION = 0.25


@dataclass(frozen=True)
class TurnResult:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    served_from: str
    ttft_cold_s: float
    ttft_cached_s: float
    same_output: bool

    @property
    def speedup(self) -> float:
        return self.ttft_cold_s / self.ttft_cached_s if self.ttft_cached_s else float("inf")


def load_session(name: str = "agent_session.json") -> dict[str, Any]:
    return json.loads(resources.files("kvtier.demo").joinpath(name).read_text())


def user_message(turn: dict[str, Any]) -> str:
    tool = turn["tool"]
    opening = f'<tool_result name="{tool["name"]}" path="{tool["path"]}">'
    return f"{turn['user']}\n\n{opening}\n{tool['content']}\n</tool_result>"


def transcript_ids(loaded: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    """The conversation in the model's chat template; a base model (no template) gets it as plain text.

    Either way each turn's prompt extends the one before, which is what the
    cache reuses.
    """
    if loaded.chat is not None:
        return loaded.chat_ids(messages)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
    return loaded.tokenizer.encode(text)


def replay(
    engine: Engine, loaded: LoadedModel, session: dict[str, Any], params: SamplingParams, bar: tqdm | None = None
) -> list[tuple[int, Completion]]:
    """Run every turn in order; each turn's prompt is the whole transcript so far."""
    messages = [{"role": "system", "content": session["system"]}]
    out = []
    for turn in session["turns"]:
        messages.append({"role": "user", "content": user_message(turn)})
        ids = transcript_ids(loaded, messages)
        (done,) = engine.generate([ids], params)
        engine.drain_stores()
        if engine.verifier is not None:  # the tool call's pause is the engine's idle time
            engine.verifier.drain()
        messages.append({"role": "assistant", "content": done.text})
        out.append((len(ids), done))
        if bar is not None:
            bar.update()
    return out


def run_demo(
    loaded: LoadedModel, config: Config, *, max_tokens: int = 24, host_bytes: int = 64 * 1024**2
) -> list[TurnResult]:
    """Both passes; host memory is kept small so later turns are served partly from disk."""
    session = load_session()
    params = SamplingParams(max_tokens=max_tokens)
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        tree = config.model_dump()
        tree["data_dir"] = tmp
        tree["disk"] = {**tree["disk"], "path": None, "enabled": True, "capacity_bytes": 1024**3}
        tree["host"] = {**tree["host"], "capacity_bytes": host_bytes}
        tree["verify"] = {**tree["verify"], "shadow_fraction": SHADOW_FRACTION}
        demo_config = Config.model_validate(tree)
        total = 2 * len(session["turns"])
        with tqdm(total=total, desc="agent session", unit="turn", leave=False) as bar:
            cold = replay(
                make_engine(loaded, demo_config, cache=None, keep_resident=False), loaded, session, params, bar
            )
            with open_cache(loaded, demo_config) as cache:
                engine = make_engine(loaded, demo_config, cache=cache, keep_resident=False)
                cached = replay(engine, loaded, session, params, bar)
                if engine.verifier is not None:
                    c = engine.verifier.counters
                    tqdm.write(
                        f"shadow verification: {c.verified} hits ({c.blocks_verified} blocks) recomputed,"
                        f" {c.mismatched_blocks} mismatched blocks"
                    )
    results = []
    for i, ((n, a), (_, b)) in enumerate(zip(cold, cached, strict=True), start=1):
        tiers = "+".join(f"{k.value}:{v}" for k, v in b.served_from.items()) or "-"
        results.append(TurnResult(i, n, b.cached_tokens, tiers, a.ttft_s, b.ttft_s, a.token_ids == b.token_ids))
    return results


def table(results: list[TurnResult]) -> str:
    head = (
        f"{'turn':>4} {'prompt':>7} {'cached':>7}  {'served from':<24} {'TTFT cold':>10} {'TTFT kvtier':>12}"
        f" {'speed-up':>9}  same output"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.turn:>4} {r.prompt_tokens:>7} {r.cached_tokens:>7}  {r.served_from:<24} {r.ttft_cold_s:>9.3f}s"
            f" {r.ttft_cached_s:>11.3f}s {r.speedup:>8.1f}x  {'yes' if r.same_output else 'NO'}"
        )
    cold = sum(r.ttft_cold_s for r in results)
    hot = sum(r.ttft_cached_s for r in results)
    rows.append("-" * len(head))
    rows.append(
        f"total TTFT: {cold:.2f}s without cache, {hot:.2f}s with kvtier ({cold / hot:.1f}x); "
        f"identical outputs: {sum(r.same_output for r in results)}/{len(results)} turns"
    )
    return "\n".join(rows)


def as_json(results: list[TurnResult]) -> list[dict[str, Any]]:
    keys = ("turn", "prompt_tokens", "cached_tokens", "ttft_cold_s", "ttft_cached_s", "same_output")
    return [{k: asdict(r)[k] for k in keys} | {"served_from": r.served_from} for r in results]


def save(results: list[TurnResult], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "demo-latest.json"
    path.write_text(json.dumps(as_json(results), indent=2))
    return path
