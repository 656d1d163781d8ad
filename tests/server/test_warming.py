"""Warming a session's next turn in idle time (kvtier.server.warming): the queue, the engine thread, a live server.

The queue's rules on a stepped clock; the engine thread on the real model
(a warm runs only when idle, an arriving request stops it within a layer
and it resumes after, the session's own next turn drops it); and a live
``kvtier serve`` whose warmed next turn prefills only what the agent added,
with the same greedy tokens as a server that does not warm.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import anthropic
import openai
from openai.types.chat import ChatCompletion

from kvtier.engine.request import FinishReason
from kvtier.engine.runtime import LoadedModel, make_engine
from kvtier.engine.sampling import SamplingParams
from kvtier.model.chat import next_turn_ids
from kvtier.server.loop import EngineLoop, Outcome, Stream, Submission
from kvtier.server.metrics import EngineMetrics
from kvtier.server.warming import Warming, WarmTurn
from tests.server.live import ADMIN_AUTH, B, LiveServer, Reference, running
from tests.server.test_loop import HASHER, small_pool

NS = "default"
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def turn(session: str, ids: list[int], until: float = float("inf")) -> WarmTurn:
    return WarmTurn((NS, session), HASHER.keyed(ids, NS), until)


# -- the queue ------------------------------------------------------------------------------------------
def test_a_sessions_newer_turn_replaces_its_queued_warm_and_an_expired_one_is_dropped() -> None:
    now = [0.0]
    w = Warming(clock=lambda: now[0])
    w.queue(turn("a", [1, 2, 3], until=10))
    w.queue(turn("b", [4, 5], until=5))
    w.queue(turn("a", [1, 2, 3, 6], until=20))  # a's next turn: its older warm goes
    now[0] = 6.0  # past b's TTL
    request_id, first = w.next() or ("", None)
    assert first is not None and first.session == (NS, "a") and len(first.prompt) == 4
    assert w.next() is None and not w.pending
    c = w.counters
    assert (c.queued, c.started, c.expired, c.running) == (3, 1, 1, 1)
    assert w.ended(request_id, FinishReason.LENGTH) and not w.ended("not-a-warm", FinishReason.STOP)
    assert (w.counters.finished, w.counters.running) == (1, 0)


def test_an_arrival_stops_every_warm_and_only_other_sessions_resume() -> None:
    w = Warming()
    w.queue(turn("a", [1]))
    w.queue(turn("b", [2]))
    a, _ = w.next() or ("", None)
    b, _ = w.next() or ("", None)
    w.queue(turn("c", [3]))
    assert sorted(w.arrived((NS, "a"))) == sorted([a, b])  # both stop; a's own turn has come
    w.ended(a, FinishReason.ABORT)
    w.ended(b, FinishReason.ABORT)
    c = w.counters
    assert (c.superseded, c.interrupted) == (1, 1)
    resumed = [w.next() for _ in range(2)]  # b first (it was under way), then c
    assert [t.session[1] for _, t in resumed if t] == ["b", "c"]  # type: ignore[misc]


# -- the engine thread -----------------------------------------------------------------------------------
def _loop(loaded: LoadedModel, tmp: Path) -> EngineLoop:
    def build():  # type: ignore[no-untyped-def]
        return make_engine(loaded, small_pool(tmp, 400), cache=None, hasher=HASHER, keep_resident=True)

    loop = EngineLoop(build, EngineMetrics())
    loop.start()
    return loop


def _submit(loop: EngineLoop, ids: list[int], session: str | None, max_tokens: int = 6) -> Outcome:
    async def go() -> Outcome:
        stream = Stream()
        key = None if session is None else (NS, session)
        loop.submit(Submission(f"r-{len(ids)}", HASHER.keyed(ids, NS), SamplingParams(max_tokens), stream, key))
        async for event in stream.events():
            if isinstance(event, Outcome):
                return event
        raise AssertionError("no outcome")

    return asyncio.run(asyncio.wait_for(go(), timeout=120))


def _warm_under_way(loop: EngineLoop) -> None:
    """Wait, by round trips to the engine thread, until a warm is in the engine."""
    for _ in range(1000):
        if loop.call(lambda e: e.has_unfinished()).result(timeout=60):
            return
    raise AssertionError("the warm never started")


def test_a_request_stops_a_warm_within_a_layer_gets_its_answer_and_the_warm_resumes(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    words = " ".join(f"note{i}" for i in range(200))  # ~800 tokens: two chunks of warm
    long = loaded_model.chat_ids([{"role": "user", "content": words}])
    other = loaded_model.chat_ids([{"role": "user", "content": "Say hi."}])
    expected = Reference(loaded_model, tmp_path).run(other, 6).text
    loop = _loop(loaded_model, tmp_path)
    try:
        loop.warm(turn("a", long))
        _warm_under_way(loop)
        answer = _submit(loop, other, session="b")
        loop.idle().result(timeout=300)
        cached = _submit(loop, long + other, session="a").cached_tokens
    finally:
        loop.stop()
    assert answer.text == expected
    c = loop.metrics.engine_report().warming
    assert (c.interrupted, c.finished, c.started, c.running) == (1, 1, 2, 0)
    assert c.tokens >= len(long) - B  # what the first run stored is not computed again when it resumes
    assert cached == len(long) // B * B  # the warmed prompt's full blocks, resident for its session's turn
    report = loop.metrics.engine_report()
    assert sum(report.requests.values()) == 2  # the two requests; the warms are nobody's


def test_the_sessions_own_next_turn_drops_its_warm(loaded_model: LoadedModel, tmp_path: Path) -> None:
    long = loaded_model.chat_ids([{"role": "user", "content": " ".join(f"item{i}" for i in range(150))}])
    loop = _loop(loaded_model, tmp_path)
    try:
        loop.warm(turn("a", long))
        _warm_under_way(loop)
        _submit(loop, [*long, 198], session="a")
        loop.idle().result(timeout=300)
    finally:
        loop.stop()
    c = loop.metrics.engine_report().warming
    assert (c.superseded, c.interrupted, c.finished, c.started) == (1, 0, 0, 1)


# -- the next turn's start -------------------------------------------------------------------------------
def test_the_next_turn_starts_with_the_warmed_ids(loaded_model: LoadedModel) -> None:
    convo = [{"role": "system", "content": "You help."}, {"role": "user", "content": "List three primes."}]
    reply = "2, 3 and 5."
    head = next_turn_ids(loaded_model.tokenizer, loaded_model.chat, convo, reply)  # type: ignore[arg-type]
    for said in ("The tool says: 7 is prime too.", "<|im_start|>x"):  # plain text, and text spelling a control token
        said_next = [*convo, {"role": "assistant", "content": reply}, {"role": "user", "content": said}]
        nxt = loaded_model.chat_ids(said_next)
        assert nxt[: len(head)] == head
    assert len(head) > len(loaded_model.chat_ids(convo))


# -- a live server ---------------------------------------------------------------------------------------
SECTIONS = {"engine": {"pool_bytes": 400 * 46080 * B, "dtype": "float32", "decoded_kv": "skip"}}


def ask(client: openai.OpenAI, convo: list[dict[str, str]]) -> ChatCompletion:
    """One greedy turn of the agent's session."""
    return client.chat.completions.create(model=MODEL, messages=convo, max_tokens=24, temperature=0, user="agent-1")  # type: ignore[arg-type]


def test_a_warmed_turn_prefills_only_what_the_agent_added_and_answers_the_same(
    loaded_model: LoadedModel, tmp_path: Path
) -> None:
    """``decoded_kv: skip``: a reply's blocks are not cached, so without warming the next turn prefills it again.

    Answers equal an engine with no cache at all; each later turn reads the
    whole start the warm computed, where without it only the earlier prompt's
    blocks would be cached (the reply's were computed by decode).
    """
    ref = Reference(loaded_model, tmp_path)
    convo = [{"role": "user", "content": "Write a short list of ten fruits, one per line."}]
    with running(tmp_path, SECTIONS) as server:
        client = server.client()
        answers, cached = [], []
        for tool in ("The tool found: apple, pear.", "The tool found nothing more."):
            done = ask(client, convo)
            reply = done.choices[0].message.content or ""
            answers.append(reply)
            cached.append(done.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
            settled = server.post("/admin/settle", headers=ADMIN_AUTH)
            assert settled.status_code == 200
            convo = [*convo, {"role": "assistant", "content": reply}, {"role": "user", "content": tool}]
        last = ask(client, convo)
        answers.append(last.choices[0].message.content or "")
        cached.append(last.usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
        warming = settled.json()
        messages_turns = messages_session(server)
    expected = []
    history: list[dict[str, str]] = [convo[0]]
    for i in range(3):
        expected.append(ref.chat(history, 24)[1].text)
        if i < 2:
            history = [*history, {"role": "assistant", "content": expected[-1]}, convo[2 * i + 2]]
    assert answers == expected
    for i in range(2):  # turns 2 and 3: what was cached of each
        earlier = convo[: 2 * i + 1]
        known = len(next_turn_ids(loaded_model.tokenizer, loaded_model.chat, earlier, answers[i]))  # type: ignore[arg-type]
        assert cached[i + 1] == known // B * B  # the prompt, the reply, the next message's opening: to a whole block
        assert cached[i + 1] > len(loaded_model.chat_ids(earlier)) // B * B  # more than the earlier prompt's blocks
    assert warming["finished"] >= 2 and warming["tokens"] > 0 and warming["superseded"] == 0
    first, second, conversation = messages_turns
    known = len(next_turn_ids(loaded_model.tokenizer, loaded_model.chat, conversation, first.content[0].text))  # type: ignore[arg-type, union-attr]
    assert second.usage.cache_read_input_tokens == known // B * B  # the Messages API's turns are warmed alike


def messages_session(server: LiveServer) -> tuple[anthropic.types.Message, anthropic.types.Message, list]:
    """Two turns of a Messages session (``metadata.user_id``), the engine settled between them."""
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    convo: list[dict] = [{"role": "user", "content": "Name five rivers of Europe, one per line."}]
    asked = {"model": MODEL, "max_tokens": 24, "metadata": {"user_id": "agent-2"}, "extra_body": {"temperature": 0}}
    first = claude.messages.create(messages=convo, **asked)  # type: ignore[arg-type]
    server.post("/admin/settle", headers=ADMIN_AUTH).raise_for_status()
    reply = first.content[0].text  # type: ignore[union-attr]
    tool = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "Danube, Rhine."}]}
    second = claude.messages.create(messages=[*convo, {"role": "assistant", "content": reply}, tool], **asked)  # type: ignore[arg-type]
    return first, second, [{"role": "user", "content": convo[0]["content"]}]
