"""Moving bytes off the engine's critical path: a worker pool with job ids.

The manager decides *what* moves; this module only runs the copies and says
which finished. The engine submits a job and keeps stepping; it polls by id
(or collects every finished id at once, the shape vLLM's connector
``get_finished`` wants) instead of blocking.

Every job has an owner who collects it: a caller that submits keeps its id
and ends with :meth:`TransferWorker.wait` or :meth:`TransferWorker.finished`;
work nobody polls (a fetch reports through its own :class:`~kvtier.fetch.Fetch`)
goes through :meth:`TransferWorker.spawn`, which the worker reaps itself,
logging and counting a failure instead of keeping it in a table forever.

When CUDA exists, each worker thread owns a dedicated CUDA stream and a job
runs under it; the job counts as done only once an event recorded after it on
that stream has completed, so a poll never reports a copy the GPU has not
finished.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NewType

import torch

log = logging.getLogger(__name__)

JobId = NewType("JobId", int)


class JobStatus(enum.StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferWorker:
    def __init__(self, workers: int = 2) -> None:
        self._cuda = torch.cuda.is_available()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-transfer")
        self._jobs: dict[JobId, Future[Any]] = {}
        self._spawned: dict[Future[Any], str] = {}  # -> what it does, for the log
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.spawn_failures = 0

    def _stream(self) -> torch.cuda.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream()
        return stream

    def _run(self, fn: Callable[[], Any]) -> Any:
        if not self._cuda:
            return fn()
        stream = self._stream()
        with torch.cuda.stream(stream):
            result = fn()
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return result

    def submit(self, fn: Callable[[], Any]) -> JobId:
        job = JobId(next(self._ids))
        future = self._pool.submit(self._run, fn)
        with self._lock:
            self._jobs[job] = future
        return job

    def spawn(self, fn: Callable[[], Any], what: str) -> None:
        """Run ``fn`` with no id to poll: it is forgotten once it ends, and a failure is logged and counted."""
        future = self._pool.submit(self._run, fn)
        with self._lock:
            self._spawned[future] = what
        future.add_done_callback(self._reap)

    def _reap(self, future: Future[Any]) -> None:
        """Forget an ended spawned job, counting and logging its failure; only the first call for a job acts."""
        with self._lock:  # logged under the lock too: once drain() returns, the failure is counted and said
            what = self._spawned.pop(future, None)
            if what is not None and future.exception() is not None:
                self.spawn_failures += 1
                log.error("transfer job failed: %s", what, exc_info=future.exception())

    def held(self) -> int:
        """Jobs the worker still tracks: running, or ended but not collected by their owner."""
        with self._lock:
            return len(self._jobs) + len(self._spawned)

    def poll(self, job: JobId) -> JobStatus:
        future = self._future(job)
        if not future.done():
            return JobStatus.PENDING
        return JobStatus.FAILED if future.exception() is not None else JobStatus.DONE

    def wait(self, job: JobId, timeout: float | None = None) -> Any:
        """Block until ``job`` ends; return its result (re-raising its error) and forget it."""
        future = self._future(job)
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                self._jobs.pop(job, None)

    def finished(self) -> dict[JobId, JobStatus]:
        """Every job that ended since the last call, with its status; they are forgotten."""
        with self._lock:
            done = {j: f for j, f in self._jobs.items() if f.done()}
            for j in done:
                del self._jobs[j]
        return {j: JobStatus.FAILED if f.exception() is not None else JobStatus.DONE for j, f in done.items()}

    def pending(self) -> int:
        with self._lock:
            return sum(not f.done() for f in self._jobs.values())

    def drain(self) -> None:
        """Wait for every submitted and spawned job (submitted ones' errors stay readable through poll)."""
        with self._lock:
            futures, spawned = list(self._jobs.values()), list(self._spawned)
        for f in futures + spawned:
            f.exception()
        for f in spawned:
            self._reap(f)  # a done callback may not have run yet when the future wakes its waiters

    def _future(self, job: JobId) -> Future[Any]:
        with self._lock:
            try:
                return self._jobs[job]
            except KeyError:
                raise KeyError(f"unknown or already collected transfer job {job}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
