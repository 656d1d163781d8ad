"""Moving bytes off the engine's critical path: a worker pool with job ids.

The manager decides *what* moves; this module only runs the copies and says
which finished. The engine submits a job and keeps stepping; it polls by id
(or collects every finished id at once, the shape vLLM's connector
``get_finished`` wants) instead of blocking.

When CUDA exists, each worker thread owns a dedicated CUDA stream and a job
runs under it; the job counts as done only once an event recorded after it on
that stream has completed, so a poll never reports a copy the GPU has not
finished.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NewType

import torch

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
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

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
        """Wait for every submitted job (their errors stay readable through poll)."""
        with self._lock:
            futures = list(self._jobs.values())
        for f in futures:
            f.exception()

    def _future(self, job: JobId) -> Future[Any]:
        with self._lock:
            try:
                return self._jobs[job]
            except KeyError:
                raise KeyError(f"unknown or already collected transfer job {job}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
