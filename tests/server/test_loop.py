"""The engine thread on the real model: one request's failure ends that request only, and a crash is survived.

A rebuilt engine starts its counters at zero; what the server reports keeps the lost engine's counts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier.config import Config
from kvtier.engine.engine import Engine, FinishReason
from kvtier.engine.runtime import LoadedModel, make_engine
from kvtier.engine.sampling import SamplingParams
from kvtier.keys import KeyHasher
from kvtier.server.loop import Delta, EngineLoop, Failure, Outcome, Stream, Submission
from kvtier.server.metrics import EngineMetrics
from tests.server.live import B, Reference, reference_config

GREEDY = SamplingParams(max_tokens=6)
HASHER = KeyHasher.process_local("test-loop", B)  # every engine a loop builds keys with it, as a server's cache's


def small_pool(tmp: Path, blocks: int) -> Config:
    cfg = reference_config(tmp)
    tree = cfg.model_dump()
    tree["engine"] = {**tree["engine"], "pool_bytes": blocks * 46080 * B}
    return Config.model_validate(tree)


async def run(loop: EngineLoop, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Outcome]:
    """Submit every prompt at once (they batch) and gather each one's outcome; deltas must add up to its text."""
    streams = [Stream() for _ in prompts]
    subs = [
        Submission(f"r{i}", HASHER.keyed(ids, "default"), params, st)
        for i, (ids, st) in enumerate(zip(prompts, streams, strict=True))
    ]
    for sub in subs:  # back to back, keyed beforehand: the loop takes them in one wake-up, so they batch
        loop.submit(sub)

    async def outcome(stream: Stream) -> Outcome:
        text = ""
        async for event in stream.events():
            if isinstance(event, Delta):
                text += event.text
            else:
                assert event.failure is not None or text == event.text
                return event
        raise AssertionError("no outcome")

    return await asyncio.wait_for(asyncio.gather(*(outcome(s) for s in streams)), timeout=120)


@pytest.fixture
def prompts(loaded_model: LoadedModel) -> list[list[int]]:
    return [loaded_model.chat_ids([{"role": "user", "content": t}]) for t in ("Say hi.", "Count to 3.")]


def test_a_request_the_engine_refuses_ends_alone(
    loaded_model: LoadedModel, tmp_path: Path, prompts: list[list[int]]
) -> None:
    expected = [Reference(loaded_model, tmp_path).run(p, GREEDY.max_tokens).text for p in prompts]
    loop = EngineLoop(
        lambda: make_engine(loaded_model, small_pool(tmp_path, 8), cache=None, hasher=HASHER, keep_resident=False),
        EngineMetrics(),
    )
    loop.start()
    try:
        too_big = prompts[0] * 6  # more KV blocks than the whole pool: refused at admission
        first, refused, second, empty = asyncio.run(run(loop, [prompts[0], too_big, prompts[1], []]))
    finally:
        loop.stop()
    assert [first.text, second.text] == expected
    assert first.failure is None and second.failure is None
    assert refused.failure is Failure.REJECTED and "KV blocks" in refused.message
    assert empty.failure is Failure.REJECTED and "at least one token" in empty.message
    report = loop.metrics.engine_report()
    assert report.requests[FinishReason.ERROR] == 1 and report.in_flight == 0


def test_a_failed_step_fails_the_batch_then_a_rebuilt_engine_serves(
    loaded_model: LoadedModel, tmp_path: Path, prompts: list[list[int]]
) -> None:
    built: list[Engine] = []

    def build() -> Engine:
        engine = make_engine(loaded_model, small_pool(tmp_path, 64), cache=None, hasher=HASHER, keep_resident=False)
        if not built:

            def crash() -> list:
                raise RuntimeError("injected step failure")

            engine.step = crash  # type: ignore[method-assign]
            engine.prefetch_counters.started, engine.prefetch_counters.blocks_planned = 2, 5  # as if it had fetched
        built.append(engine)
        return engine

    expected = Reference(loaded_model, tmp_path).run(prompts[1], GREEDY.max_tokens).text
    loop = EngineLoop(build, EngineMetrics())
    loop.start()
    try:
        crashed = asyncio.run(run(loop, prompts))
        (served,) = asyncio.run(run(loop, [prompts[1]]))
        current = loop.call(lambda engine: engine).result(timeout=10)
    finally:
        loop.stop()
    assert [o.failure for o in crashed] == [Failure.INTERNAL, Failure.INTERNAL]
    assert len(built) == 2 and served.failure is None and served.text == expected
    assert current is built[1]  # call() runs on the rebuilt engine
    prefetch = loop.metrics.engine_report().prefetch
    assert (prefetch.started, prefetch.blocks_planned) == (2, 5), "the lost engine's counters were dropped"
    assert not loop.alive


def test_call_hands_back_the_exception(loaded_model: LoadedModel, tmp_path: Path) -> None:
    loop = EngineLoop(
        lambda: make_engine(loaded_model, small_pool(tmp_path, 8), cache=None, hasher=HASHER, keep_resident=False),
        EngineMetrics(),
    )
    loop.start()
    try:
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda engine: 1 // 0).result(timeout=10)
        assert loop.alive
    finally:
        loop.stop()


def test_abort_takes_a_request_out_between_steps(
    loaded_model: LoadedModel, tmp_path: Path, prompts: list[list[int]]
) -> None:
    """A client gone after its third token: the request leaves at the next step, and the pool gets its pages back."""
    loop = EngineLoop(
        lambda: make_engine(loaded_model, small_pool(tmp_path, 64), cache=None, hasher=HASHER, keep_resident=False),
        EngineMetrics(),
    )
    loop.start()

    async def three_then_leave() -> int:
        stream = Stream()
        leaver = HASHER.keyed(prompts[0], "ns")
        loop.submit(Submission("leaver", leaver, SamplingParams(max_tokens=900, ignore_eos=True), stream))
        seen = 0
        async for event in stream.events():
            assert isinstance(event, Delta)
            seen += event.num_tokens
            if seen >= 3:
                loop.abort("leaver")
                return seen
        raise AssertionError("no tokens")

    try:
        asyncio.run(asyncio.wait_for(three_then_leave(), timeout=120))
        # The inbox is FIFO: this runs on the engine thread after the abort did.
        made, free, busy = loop.call(lambda e: (len(e.collect_finished()), e.pool.num_free, e.has_unfinished())).result(
            timeout=60
        )
    finally:
        loop.stop()
    report = loop.metrics.engine_report()
    assert report.requests[FinishReason.ABORT] == 1 and report.in_flight == 0
    assert not busy and made == 0  # handed to the metrics when it was aborted
    assert free == 64  # every page back (this engine keeps nothing resident)
