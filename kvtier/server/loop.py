"""The engine's own thread: once the server runs, the only code that touches the :class:`Engine`.

The engine is not thread-safe and one step is many milliseconds of model
work, so it lives on one dedicated thread that loops: run every command
queued in a thread-safe inbox (new requests join between steps, which is
continuous batching; admin calls run there too), run one step, hand each
request's new text to its HTTP handler. Handlers wait on the asyncio event
loop, each on its own :class:`Stream`; the engine thread reaches them only
through ``loop.call_soon_threadsafe``, so neither side ever blocks the other.

Client disconnects: the HTTP side notices the connection close (an
``http.disconnect`` from the server, also while the request is still
prefilling) and sends :meth:`EngineLoop.abort`; the engine thread runs it
between two steps, so the request leaves the batch within one step and its
pages, pins and fetch are given back. What it computed so far is stored and
kept, which is what the client's retry wants.

Idle time is given to warming sessions' next turns (:mod:`kvtier.server.warming`):
a warm runs only while no request waits or runs, and one that arrives stops it
before the forward's next layer.

Failures: what belongs to one request (a prompt that does not fit) is
refused before or at admission and ends only that request. A step that
raises leaves the batch in an unknown state: every request in flight fails,
the traceback is logged, and the engine is rebuilt, so the server goes on
serving instead of hanging every client on a dead thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from kvtier.engine.engine import Engine
from kvtier.engine.request import FinishReason, PrefetchCounters, Request
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.verify import VerifyCounters
from kvtier.keys import KeyedTokens
from kvtier.server.metrics import EngineMetrics, PoolSnapshot
from kvtier.server.warming import SessionKey, Warming, WarmTurn

log = logging.getLogger(__name__)


class Failure(enum.StrEnum):
    """Why a request produced no normal finish."""

    REJECTED = "rejected"  # the engine refused this request (it cannot fit): the client's to fix
    INTERNAL = "internal"  # a step failed; the request's output is lost
    SHUTDOWN = "shutdown"  # the server stopped before the request finished


@dataclass(frozen=True)
class Delta:
    text: str
    num_tokens: int
    cached_tokens: int | None = None  # on the first: the prompt tokens the cache served (the rest were computed)


@dataclass(frozen=True)
class Outcome:
    """A request's end: its totals, or why it failed."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str
    finish_reason: FinishReason
    failure: Failure | None = None
    message: str = ""
    stop_sequence: str | None = None  # the stop string that ended it (the Messages API reports it)

    @classmethod
    def of(cls, req: Request) -> Outcome:
        assert req.finish_reason is not None
        failed = req.finish_reason is FinishReason.ERROR
        return cls(
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output_ids),
            text=req.text,
            finish_reason=req.finish_reason,
            failure=Failure.REJECTED if failed else None,
            message=req.error or "",
            stop_sequence=req.stop_sequence,
        )

    @classmethod
    def failed(cls, prompt_tokens: int, failure: Failure, message: str) -> Outcome:
        return cls(prompt_tokens, 0, 0, "", FinishReason.ERROR, failure, message)


Event = Delta | Outcome


class ClientGone(Exception):
    """The client closed its connection before the request's end: nobody reads the rest."""


class Stream:
    """One request's events: written by the engine thread, read on the event loop that created it."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()

    def put(self, event: Event) -> None:
        """Thread-safe; a no-op once the event loop is closed (shutdown: nobody is listening)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self, gone: asyncio.Future[None] | None = None) -> AsyncIterator[Event]:
        """Deltas in order, then the one :class:`Outcome`, which ends the iteration.

        ``gone`` resolves when the client disconnects: waiting then raises
        :class:`ClientGone` at once, instead of at the next event (a long
        prefill sends none for a while).
        """
        while True:
            event = await self._next(gone)
            yield event
            if isinstance(event, Outcome):
                return

    async def _next(self, gone: asyncio.Future[None] | None) -> Event:
        if not self._queue.empty() or gone is None:
            return await self._queue.get()
        get = asyncio.ensure_future(self._queue.get())
        await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        raise ClientGone


@dataclass(eq=False)
class Submission:
    request_id: str
    prompt: KeyedTokens
    params: SamplingParams
    stream: Stream
    session: SessionKey | None = None  # the agent session it is a turn of: its warm, if any, is moot


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(eq=False)
class _Call:
    fn: Callable[[Engine], Any]
    future: Future[Any] = field(default_factory=Future)


class Arrival:
    """A request on its way to the engine, from its route's first line to its submission.

    While any is on its way, warms hold still (a warm's forward stops at the
    next layer and none starts): the request's own tokenizing and keying then
    has the cores to itself. :meth:`done` is idempotent; submitting calls it.
    """

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self._open = True

    def done(self) -> None:
        if self._open:
            self._open = False
            self._loop._landed()


@dataclass(eq=False)
class _WhenIdle:
    future: Future[None] = field(default_factory=Future)


_STOP = object()
_WAKE = object()  # every arrival landed: whatever waited on them goes on


@dataclass(frozen=True)
class EngineLimits:
    """Facts about the engine the HTTP layer checks requests against (fixed for the engine's life)."""

    context_length: int
    vocab_size: int
    block_size: int
    pool_blocks: int

    @classmethod
    def of(cls, engine: Engine) -> EngineLimits:
        return cls(
            context_length=engine.model.config.context_length,
            vocab_size=engine.tokenizer.vocab_size,
            block_size=engine.block_size,
            pool_blocks=engine.pool.num_blocks,
        )

    def blocks_needed(self, prompt_tokens: int, max_tokens: int) -> int:
        """KV blocks the engine reserves at admission (the same arithmetic as ``Engine._admit``)."""
        tokens = min(prompt_tokens + max_tokens, self.context_length)
        return -(-tokens // self.block_size)


class EngineUnavailable(RuntimeError):
    pass


Counters = TypeVar("Counters", PrefetchCounters, VerifyCounters)


def _plus(a: Counters, b: Counters) -> Counters:
    """Field by field, into a new object."""
    return type(a)(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in fields(a)})


def _verify_counters(engine: Engine) -> VerifyCounters:
    return engine.verifier.counters if engine.verifier is not None else VerifyCounters()


class EngineLoop:
    def __init__(self, build: Callable[[], Engine], metrics: EngineMetrics) -> None:
        self._build = build
        self._engine = build()
        self.limits = EngineLimits.of(self._engine)
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._subs: dict[str, Submission] = {}
        self._thread = threading.Thread(target=self._run, name="kvtier-engine", daemon=True)
        self._prefetch_before = PrefetchCounters()  # engines replaced after a failed step: counters never go back
        self._verify_before = VerifyCounters()
        self._warming = Warming()
        self._expected = 0  # arrivals on their way (Arrival); read by the engine thread, no lock needed to read
        self._expected_lock = threading.Lock()
        self._idle_waiters: list[Future[None]] = []
        self._publish()

    # -- the HTTP side (any thread) ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Fail what is still in flight, wait for stores to land, and end the thread."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def expect(self) -> Arrival:
        """A request is coming: warms hold still until it is submitted (or :meth:`Arrival.done` says it is not)."""
        with self._expected_lock:
            self._expected += 1
        return Arrival(self)

    def _landed(self) -> None:
        with self._expected_lock:
            self._expected -= 1
            last = self._expected == 0
        if last:
            self._inbox.put(_WAKE)

    def submit(self, sub: Submission, arrival: Arrival | None = None) -> None:
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        self._inbox.put(sub)
        if arrival is not None:
            arrival.done()  # after the put: at no moment does the engine see neither the arrival nor the request

    def abort(self, request_id: str) -> None:
        """Take a request out of the engine between two steps (its client went away); a no-op once it ended."""
        if self.alive:
            self._inbox.put(_Abort(request_id))

    def warm(self, turn: WarmTurn) -> None:
        """Prefill ``turn`` in the engine's idle time (see :mod:`kvtier.server.warming`)."""
        if self.alive:
            self._inbox.put(turn)

    def idle(self) -> Future[None]:
        """Resolves once the engine thread has nothing left to do: no request, no warm, no verification.

        What tests and benchmarks wait on instead of sleeping.
        """
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        command = _WhenIdle()
        self._inbox.put(command)
        return command.future

    def call(self, fn: Callable[[Engine], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the engine thread between two steps (admin actions on the device tier)."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        command = _Call(fn)
        self._inbox.put(command)
        return command.future

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        while self._take(block=not self._busy() or self._yielding()):
            if self._yielding():
                continue  # only warms in the engine and a request on its way: wait for it, computing nothing
            if self._engine.has_unfinished():
                self._step()
            elif self._warming.pending:
                self._start_warm()  # only with nothing waiting or running, like verification; warms first
            elif self._engine.verify_pending:
                self._verify()  # one chunk, only with nothing waiting or running: new requests come first
            if not self._busy():
                self._tell_idle()
        self._fail_all(Failure.SHUTDOWN, "the server is shutting down")
        self._tell_idle()
        self._engine.close()

    def _busy(self) -> bool:
        return self._engine.has_unfinished() or self._warming.pending or self._engine.verify_pending

    def _yielding(self) -> bool:
        """Idle work only (warms, verification) and a request on its way: hold still until it lands."""
        return self._expected > 0 and not self._subs

    def _tell_idle(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for future in waiters:
            future.set_result(None)

    def _take(self, block: bool) -> bool:
        """Run every queued command, first waiting for one when the engine is idle; False: stop."""
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            if command is _WAKE:
                continue
            if isinstance(command, _Call):
                self._call(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id)
            elif isinstance(command, WarmTurn):
                self._warming.queue(command)
            elif isinstance(command, _WhenIdle):
                self._idle_waiters.append(command.future)
            else:
                assert isinstance(command, Submission)
                self._stop_warms(command.session)
                self._admit(command)

    def _admit(self, sub: Submission) -> None:
        try:
            self._engine.add_request(sub.prompt, sub.params, request_id=sub.request_id)
        except ValueError as err:  # the engine's own refusal of one prompt (empty, longer than the context)
            sub.stream.put(Outcome.failed(len(sub.prompt), Failure.REJECTED, str(err)))
            return
        self._subs[sub.request_id] = sub
        self.metrics.set_in_flight(len(self._subs))

    def _start_warm(self) -> None:
        taken = self._warming.next()
        if taken is None:
            return
        request_id, turn = taken
        try:
            self._engine.add_request(turn.prompt, SamplingParams(max_tokens=0), request_id=request_id)
        except ValueError:  # a prompt past the context: the engine refuses it before it starts
            self._warming.ended(request_id, FinishReason.ERROR)
        self._publish()

    def _stop_warms(self, session: SessionKey | None) -> None:
        """A request arrived: the warms in the engine give way (their work so far is stored); see warming.py."""
        running = self._warming.arrived(session)
        for request_id in running:
            self._engine.abort(request_id)
        if running:
            self._collect()

    def _abort(self, request_id: str) -> None:
        self._subs.pop(request_id, None)
        if self._engine.abort(request_id):
            self._collect()
            self._publish()
        self.metrics.set_in_flight(len(self._subs))

    def _call(self, command: _Call) -> None:
        try:
            command.future.set_result(command.fn(self._engine))
        except Exception as err:  # handed to the caller, who re-raises it: nothing is swallowed here
            command.future.set_exception(err)
        self._publish()

    def _step(self) -> None:
        engine = self._engine
        computed, skipped = engine.prefill_tokens_computed, engine.prefill_tokens_skipped
        onboarded, full = engine.onboarded_bytes, engine.onboarded_full_bytes
        background = not self._subs  # only warms in the engine: anything arriving stops the forward
        started = time.perf_counter()
        try:
            outputs = engine.step(interrupt=self._arrived if background else None)
        except Exception:  # the thread's last line of defence; see the module docstring
            log.exception("engine step failed: failing %d requests and rebuilding the engine", len(self._subs))
            self._fail_all(Failure.INTERNAL, "internal engine error")
            self._warming.lost()
            self._prefetch_before = _plus(self._prefetch_before, engine.prefetch_counters)
            self._verify_before = _plus(self._verify_before, _verify_counters(engine))
            try:
                engine.close()  # its pins and pool references; the pool itself goes with it
            except Exception:
                log.exception("closing the failed engine failed too")
            self._engine = self._build()
            self._publish()
            return
        self.metrics.observe_step(
            seconds=time.perf_counter() - started,
            prefill_tokens=engine.prefill_tokens_computed - computed,
            skipped_tokens=engine.prefill_tokens_skipped - skipped,
            batch=len(outputs),
            onboarded=(engine.onboarded_bytes - onboarded, engine.onboarded_full_bytes - full),
        )
        if background:
            self._warming.computed(engine.prefill_tokens_computed - computed)
        for out in outputs:
            sub = self._subs.get(out.request_id)
            if sub is not None and (out.text or out.cached_tokens is not None):
                sub.stream.put(Delta(out.text, len(out.token_ids), out.cached_tokens))
        self._collect()
        self.metrics.set_in_flight(len(self._subs))
        self._publish()

    def _arrived(self) -> bool:
        """Whether a request is on its way or a command waits (asked between layers of a warm's forward)."""
        return self._expected > 0 or not self._inbox.empty()

    def _verify(self) -> None:
        self._engine.verify_idle()
        self._publish()

    def _collect(self) -> None:
        """Hand every request that ended (aborted ones too: they are counted) its outcome."""
        engine = self._engine
        for req in engine.collect_finished():
            if self._warming.ended(req.id, req.finish_reason):
                continue  # a warm is nobody's request: counted apart, never in the request metrics
            self.metrics.observe_finished(req, engine.block_size)
            sub = self._subs.pop(req.id, None)
            if sub is not None:
                sub.stream.put(Outcome.of(req))

    def _fail_all(self, failure: Failure, message: str) -> None:
        for sub in self._subs.values():
            sub.stream.put(Outcome.failed(len(sub.prompt), failure, message))
        self._subs.clear()
        self.metrics.set_in_flight(0)

    def _publish(self) -> None:
        """What /stats shows of the engine, as copies the HTTP side may read from any thread."""
        engine = self._engine
        self.metrics.set_prefetch(_plus(self._prefetch_before, engine.prefetch_counters))
        self.metrics.set_speculation(engine.speculation)
        self.metrics.set_verify(_plus(self._verify_before, _verify_counters(engine)))
        self.metrics.set_warming(self._warming.counters)
        self.metrics.set_pool(
            PoolSnapshot(
                num_blocks=engine.pool.num_blocks,
                free_blocks=engine.pool.num_free,
                resident_blocks=len(engine.resident) if engine.resident is not None else 0,
                block_bytes=engine.pool.layout.block_bytes,
            )
        )
