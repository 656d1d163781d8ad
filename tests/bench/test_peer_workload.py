"""The peer workload: the same token ids ``kvtier bench ttft`` sends, and agent traces with fixed replies."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvtier.bench import ttft
from kvtier.bench.peer import workload
from kvtier.config import load_config
from kvtier.demo.session import load_session


class CharTokenizer:
    """One id per character: cheap, deterministic, and enough to tell prompts apart."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class LineChat:
    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        body = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeLoaded:
    """What the workload reads from a loaded model (and ttft.run the device it names in its JSON)."""

    tokenizer: Any = None
    chat: Any = None
    model: Any = None

    def __post_init__(self) -> None:
        self.tokenizer = self.tokenizer or CharTokenizer()
        self.chat = self.chat or LineChat()
        self.model = self.model or SimpleNamespace(device=torch.device("cpu"))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.chat.render(messages, add_generation_prompt=True), add_special_tokens=False)


class FakeCache:
    hasher = None

    class disk:
        @staticmethod
        def drop_page_cache() -> bool:
            return True

    def __enter__(self) -> FakeCache:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def clear(self, kind: object) -> int:
        return 0


@pytest.mark.parametrize(("tokens", "reps"), [(2048, 3), (300, 2)])
def test_ttft_prompts_are_exactly_what_ttft_run_sends(
    tokens: int, reps: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple[str, list[int]]] = []
    monkeypatch.setattr(ttft, "open_cache", lambda loaded, cfg: FakeCache())
    monkeypatch.setattr(ttft, "make_engine", lambda loaded, cfg, **kw: "resident" if kw.get("keep_resident") else "x")
    monkeypatch.setattr(ttft, "_ttft", lambda engine, ids: sent.append((engine, list(ids))) or 0.0)
    monkeypatch.setattr(ttft, "raw_prefill_s", lambda loaded, tokens: 0.0)  # no weights in the fake
    loaded = FakeLoaded()
    env = {"KVTIER_DATA_DIR": str(tmp_path), "KVTIER_ENGINE__DTYPE": "float32"}
    ttft.run(loaded, load_config(environ=env), ttft.TTFTSpec(tokens=tokens, reps=reps))

    mine = workload.ttft_prompts(loaded, tokens, reps)
    assert len(mine.prefix) == tokens and [len(t) for t in mine.tails] == [ttft.NEW_TOKENS] * (reps + 1)
    spec = ttft.TTFTSpec(tokens=tokens, reps=reps)
    sync, disk = ttft.case_prompts(loaded, spec, 1)[1], ttft.case_prompts(loaded, spec, 2)[1]
    assert not {tuple(p) for p in mine.prompts} & ({tuple(p) for p in sync} | {tuple(p) for p in disk})
    # ttft.run: the prefix into the cache and into the resident pool, then per repetition (the first a
    # warm-up) miss, host hit, host hit without the layer-wise overlap and disk hit on tails of their own,
    # the prefix back into host, resident hit
    expected = [mine.prefix, mine.prefix]
    for rep in range(reps + 1):
        expected += [mine.prompts[rep], mine.prompts[rep], sync[rep], disk[rep], mine.prefix, mine.prompts[rep]]
    assert [ids for _, ids in sent] == expected
    assert [engine for engine, _ in sent][:2] == ["x", "resident"]


def test_trace_turns_grow_by_the_user_message_and_the_fixed_reply() -> None:
    session = {
        "system": "S",
        "turns": [
            {"user": "u1", "tool": {"name": "read_file", "path": "a.py", "content": "A"}, "assistant": "r1"},
            {"user": "u2", "tool": {"name": "read_file", "path": "b.py", "content": "B"}},
        ],
    }
    loaded = FakeLoaded()
    first, second = workload.trace_prompts(loaded, session)
    text = "".join(chr(i) for i in second)
    assert second[: len(first)] == first
    assert text == (
        "<system>S\n"
        '<user>u1\n\n<tool_result name="read_file" path="a.py">\nA\n</tool_result>\n'
        "<assistant>r1\n"
        '<user>u2\n\n<tool_result name="read_file" path="b.py">\nB\n</tool_result>\n'
        "<assistant>"
    )
    # a turn with no frozen reply gets FIXED_REPLY in the transcript after it
    _, two = workload.trace_prompts(loaded, {**session, "turns": [session["turns"][1], session["turns"][0]]})
    assert f"<assistant>{workload.FIXED_REPLY}\n<user>u1" in "".join(chr(i) for i in two)


def test_build_refuses_a_trace_longer_than_the_context() -> None:
    spec = workload.PeerSpec(sizes=(32,), reps=1, decode_context=16, traces=("demo",), n_ctx=4096)
    with pytest.raises(ValueError, match="over the 4096-token context"):
        workload.build(FakeLoaded(), spec)  # the demo session is ~13k characters, so ~13k char tokens


def test_workload_json_carries_every_prompt() -> None:
    spec = workload.PeerSpec(sizes=(64, 128), reps=2, decode_context=32, decode_tokens=8, traces=("demo",), n_ctx=10**6)
    w = workload.build(FakeLoaded(), spec)
    data = w.to_json(gguf=Path("/m.gguf"), hf_dir=Path("/hf"))
    assert data["schema"] == workload.WORKLOAD_SCHEMA
    assert [c["tokens"] for c in data["ttft"]] == [64, 128]
    assert [c["prefix"] + c["tails"][1] for c in data["ttft"]] == [t.prompts[1] for t in w.ttft]
    assert len(data["decode"]["prompt"]) == 32 and data["decode"]["max_tokens"] == 8
    assert len(data["traces"][0]["turns"]) == len(load_session()["turns"]) == 9


def test_long_session_has_twenty_turns_with_frozen_replies_and_the_demo_shape() -> None:
    demo, long = load_session(), load_session(workload.TRACE_FILES["long"])
    assert set(long) == set(demo)
    assert len(long["turns"]) == 20
    for turn in long["turns"]:
        assert set(turn) == {"user", "tool", "assistant"} and turn["assistant"].strip()
        assert set(turn["tool"]) == set(demo["turns"][0]["tool"]) and turn["tool"]["content"].strip()


def test_long_session_in_real_tokens_stays_under_the_context() -> None:
    """With the model's own tokenizer and template: ~7,000 tokens at the end, each turn extending the last."""
    from kvtier.model import default_gguf_path, load_chat_template, load_tokenizer, read_gguf_metadata

    metadata = read_gguf_metadata(default_gguf_path())
    loaded = FakeLoaded(tokenizer=load_tokenizer(metadata), chat=load_chat_template(metadata))
    turns = workload.trace_prompts(loaded, load_session(workload.TRACE_FILES["long"]))
    assert 6500 <= len(turns[-1]) <= 8192 - 64
    assert all(b[: len(a)] == a for a, b in itertools.pairwise(turns))
