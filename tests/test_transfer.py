"""The transfer worker: results and errors by job id, spawned jobs reaped, nothing kept once collected."""

from __future__ import annotations

import threading

import pytest

from kvtier.transfer import JobStatus, TransferWorker


def test_results_and_errors_come_back_by_id_and_are_then_forgotten() -> None:
    worker = TransferWorker(2)
    try:
        ok = worker.submit(lambda: 42)
        bad = worker.submit(lambda: 1 // 0)
        assert worker.wait(ok) == 42
        with pytest.raises(ZeroDivisionError):
            worker.wait(bad)
        assert worker.held() == 0
        with pytest.raises(KeyError, match="already collected"):
            worker.poll(ok)
    finally:
        worker.shutdown()


def test_poll_says_pending_until_the_job_ends_and_finished_collects_each_once() -> None:
    worker = TransferWorker(1)
    go = threading.Event()
    try:
        job = worker.submit(go.wait)
        assert worker.poll(job) is JobStatus.PENDING and worker.pending() == 1
        go.set()
        worker.drain()
        assert worker.finished() == {job: JobStatus.DONE}
        assert worker.finished() == {} and worker.held() == 0
    finally:
        worker.shutdown()


def test_spawned_jobs_are_reaped_and_their_failures_counted() -> None:
    worker = TransferWorker(2)
    ran = []
    try:
        for i in range(50):
            worker.spawn(lambda i=i: ran.append(i), "appending")
        worker.spawn(lambda: 1 // 0, "dividing by zero")
        worker.drain()
        assert sorted(ran) == list(range(50))
        assert worker.held() == 0 and worker.spawn_failures == 1
    finally:
        worker.shutdown()
