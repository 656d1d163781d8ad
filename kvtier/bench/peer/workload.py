"""The one workload every engine runs, built once as token ids with kvtier's tokenizer and chat template.

Handing every engine the same ids (llama-cpp-python takes a token list as a
prompt, vLLM a ``TokensPrompt``) removes tokenizers and chat templates from
the comparison: the three engines prefill exactly the same tokens.

* TTFT prompts are those of :func:`kvtier.bench.ttft.run`, rebuilt here the
  same way (same text, same prefix, same 64-token tails, ``tails[0]`` the
  warm-up), so kvtier's numbers can come from ``ttft.run`` itself.
* Agent traces render each session turn by turn, the way the demo does
  (:mod:`kvtier.demo.session`), except that the assistant's reply is fixed
  (frozen in the session file, else :data:`FIXED_REPLY`) instead of each
  engine's own generation, so every engine sees identical transcripts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench import ttft
from kvtier.demo.session import load_session, transcript_ids, user_message
from kvtier.engine.runtime import LoadedModel

WORKLOAD_SCHEMA = "kvtier-peer-workload/1"

TRACE_FILES: dict[str, str] = {"demo": "agent_session.json", "long": "agent_session_long.json"}
"""Trace name -> session file shipped in ``kvtier/demo``."""

FIXED_REPLY = "Noted. I have read the file; go on."
"""The reply put into the transcript after a turn whose session entry freezes none (the demo's)."""


@dataclass(frozen=True)
class PeerSpec:
    """What ``kvtier bench peer`` measures; the defaults are the published run."""

    sizes: tuple[int, ...] = (2048, 4096)
    reps: int = 3
    trace_reps: int = 3
    decode_context: int = 2048
    decode_tokens: int = 64
    traces: tuple[str, ...] = ("demo", "long")
    threads: int = 2
    n_ctx: int = 8192


@dataclass(frozen=True)
class TTFTPrompts:
    tokens: int
    prefix: list[int]
    tails: list[list[int]]  # tails[0] warms up, the rest are measured

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prefix + tail for tail in self.tails]


@dataclass(frozen=True)
class Trace:
    name: str
    turns: list[list[int]]  # the prompt of each turn: the whole transcript so far


@dataclass(frozen=True)
class Workload:
    spec: PeerSpec
    ttft: list[TTFTPrompts]
    decode_prompt: list[int]
    traces: list[Trace]

    def to_json(self, *, gguf: Path, hf_dir: Path, weight_types: dict[str, int] | None = None) -> dict[str, Any]:
        """The runners' input (contract in ``bench/runners/workload.py``); ``weight_types``: the GGUF's, recorded."""
        s = self.spec
        return {
            "schema": WORKLOAD_SCHEMA,
            "gguf": str(gguf),
            "gguf_weight_types": weight_types or {},
            "hf_dir": str(hf_dir),
            "threads": s.threads,
            "n_ctx": s.n_ctx,
            "reps": s.reps,
            "trace_reps": s.trace_reps,
            "ttft": [
                {"tokens": t.tokens, "new_tokens": ttft.NEW_TOKENS, "prefix": t.prefix, "tails": t.tails}
                for t in self.ttft
            ],
            "decode": {"prompt": self.decode_prompt, "max_tokens": s.decode_tokens},
            "traces": [{"name": t.name, "turns": t.turns} for t in self.traces],
        }


def ttft_prompts(loaded: LoadedModel, tokens: int, reps: int) -> TTFTPrompts:
    """Exactly the prompts ``ttft.run(loaded, config, TTFTSpec(tokens, reps))`` sends (a test holds it to that)."""
    prefix, prompts = ttft.case_prompts(loaded, ttft.TTFTSpec(tokens=tokens, reps=reps), 0)
    return TTFTPrompts(tokens, prefix, [p[tokens:] for p in prompts])


def trace_prompts(loaded: LoadedModel, session: dict[str, Any]) -> list[list[int]]:
    """Each turn's prompt ids; the transcript grows by the turn's user message and its fixed reply.

    As the demo renders it: in the chat template, or as plain text for a base model.
    """
    messages = [{"role": "system", "content": session["system"]}]
    turns = []
    for turn in session["turns"]:
        messages.append({"role": "user", "content": user_message(turn)})
        turns.append(transcript_ids(loaded, messages))
        messages.append({"role": "assistant", "content": turn.get("assistant", FIXED_REPLY)})
    return turns


def build(loaded: LoadedModel, spec: PeerSpec) -> Workload:
    traces = [Trace(name, trace_prompts(loaded, load_session(TRACE_FILES[name]))) for name in spec.traces]
    for trace in traces:
        longest = max(len(t) for t in trace.turns)
        if longest + spec.decode_tokens > spec.n_ctx:
            raise ValueError(f"trace {trace.name!r} reaches {longest} tokens, over the {spec.n_ctx}-token context")
    return Workload(
        spec=spec,
        ttft=[ttft_prompts(loaded, n, spec.reps) for n in spec.sizes],
        decode_prompt=ttft.text_tokens(loaded, spec.decode_context),
        traces=traces,
    )
