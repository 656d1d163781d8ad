"""Prompt-lookup decoding on copy-heavy replies: decode tokens/s with and without it, same engine, same prompts.

An agent asks a model to repeat or edit code it was just shown; most of the
reply is already in the prompt. Each prompt here holds one of kvtier's own
source files and asks for it back (once verbatim, once with an edit), and
each is run greedily on one engine with ``speculative`` off, then on, in
alternation, ``reps`` times. Decode tokens/s is (tokens after the first) /
(time after the first token), so the prompt's prefill is left out of both.
The outputs must match token for token (``spec_same_output``); the speedup
is the ratio of the two medians, taken in the same run. ``kvtier bench
agents`` reports it as its (b) half; ``python -m kvtier.bench.spec --json``
runs it alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.engine.engine import Completion, Engine
from kvtier.engine.runtime import LoadedModel
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.speculate import PromptLookup

SOURCES = Path(__file__).resolve().parents[1]
FILES = ("engine/sampling.py", "engine/schedule.py")  # real code an agent would be shown
LINES = 40  # of each file: a prompt of a few hundred tokens keeps the prefill short on two cores
ASKS = (
    "Repeat the code above exactly, in one Python code block, with nothing else.",
    "Rewrite the code above with every docstring removed; keep all other lines exactly as they are.",
)


@dataclass(frozen=True)
class Run:
    """One greedy reply: its tokens and its decode speed."""

    token_ids: list[int]
    tokens_per_s: float


def prompts(loaded: LoadedModel) -> list[list[int]]:
    """Chat prompts holding a source file and asking for it back (repeated, or lightly edited)."""
    out = []
    for name in FILES:
        code = "\n".join((SOURCES / name).read_text().splitlines()[:LINES])
        for ask in ASKS:
            messages = [{"role": "user", "content": f"```python\n{code}\n```\n\n{ask}"}]
            out.append(loaded.chat_ids(messages))
    return out


def decode_rate(done: Completion) -> float:
    """Tokens after the first per second after the first: decode speed without the prefill."""
    return (len(done.token_ids) - 1) / max(done.total_s - done.ttft_s, 1e-9)


def one(engine: Engine, ids: list[int], params: SamplingParams, lookup: PromptLookup | None) -> Run:
    engine.speculative = lookup
    (done,) = engine.generate([ids], params)
    return Run(done.token_ids, decode_rate(done))


def run_spec(
    loaded: LoadedModel | None = None,
    *,
    max_tokens: int = 96,
    reps: int = 1,
    lookup: PromptLookup | None = None,
) -> dict[str, Any]:
    """Decode tokens/s on copy-heavy replies, plain vs prompt lookup; same engine, prompts and (checked) outputs.

    ``lookup`` defaults to what ``engine.speculative`` configures by default,
    so the figure is the one ``kvtier serve`` gets out of the box.
    """
    from kvtier.bench.peer.machine import describe
    from kvtier.config import load_config
    from kvtier.engine.runtime import load_model, make_engine, prompt_lookup

    with tempfile.TemporaryDirectory(prefix="kvtier-spec-") as data:
        config = load_config(environ={"KVTIER_DATA_DIR": data, "KVTIER_ENGINE__POOL_BYTES": "128MiB"})
        lookup = lookup or prompt_lookup(config) or PromptLookup()
        loaded = loaded or load_model(config, progress=False)
        engine = make_engine(loaded, config, cache=None, keep_resident=False)
        try:
            return _measure(engine, prompts(loaded), SamplingParams(max_tokens=max_tokens), lookup, reps) | {
                "max_tokens": max_tokens,
                "reps": reps,
                "num_draft_tokens": lookup.num_draft_tokens,
                "ngram": [lookup.min_ngram, lookup.max_ngram],
                "isa": describe()["isa"],
                "cpu": describe()["cpu"],
            }
        finally:
            engine.close()


def _measure(
    engine: Engine, asks: list[list[int]], params: SamplingParams, lookup: PromptLookup, reps: int
) -> dict[str, Any]:
    """Plain then speculative for every prompt, ``reps`` rounds; a warm-up reply first (allocations, kernels)."""
    one(engine, asks[0], SamplingParams(max_tokens=4), None)
    plain: list[Run] = []
    spec: list[Run] = []
    for _ in range(reps):
        for ids in asks:
            plain.append(one(engine, ids, params, None))
            spec.append(one(engine, ids, params, lookup))
    engine.speculative = None
    counters = engine.speculation
    plain_rate = statistics.median(r.tokens_per_s for r in plain)
    spec_rate = statistics.median(r.tokens_per_s for r in spec)
    return {
        "spec_speedup": round(spec_rate / plain_rate, 3),
        "spec_same_output": all(a.token_ids == b.token_ids for a, b in zip(plain, spec, strict=True)),
        "acceptance_rate": round(counters.acceptance_rate or 0.0, 3),
        "drafted": counters.drafted,
        "accepted": counters.accepted,
        "tokens_per_s_plain": round(plain_rate, 2),
        "tokens_per_s_spec": round(spec_rate, 2),
        "prompts": len(asks),
        "reply_tokens": [len(r.token_ids) for r in plain[: len(asks)]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.spec", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON (the default prints it too)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--drafts", type=int, help="num_draft_tokens (default: the config's default)")
    parser.add_argument("--min-ngram", type=int)
    parser.add_argument("--max-ngram", type=int)
    args = parser.parse_args(argv)
    given = {"num_draft_tokens": args.drafts, "min_ngram": args.min_ngram, "max_ngram": args.max_ngram}
    lookup = None
    if any(v is not None for v in given.values()):
        lookup = PromptLookup(**{k: v for k, v in given.items() if v is not None})
    result = run_spec(max_tokens=args.max_tokens, reps=args.reps, lookup=lookup)
    json.dump(result, sys.stdout, indent=None if args.json else 2)
    print()
    return 0 if result["spec_same_output"] else 1


if __name__ == "__main__":
    sys.exit(main())
