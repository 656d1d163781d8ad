"""The process faults of the chaos run, as tests: a real ``kvtier serve`` each (the embedded model loads: slow)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from kvtier.bench.faults import FAULTS, Fault
from kvtier.bench.faults_process import READY, launch

pytestmark = pytest.mark.slow


def test_the_ready_line_is_written_once_connections_are_accepted(tmp_path: Path) -> None:
    """The server is frozen the moment it says it serves; the kernel must already queue a connection for it.

    Before, the line came before uvicorn listened: a supervisor (or the chaos
    run) that connected on seeing it was refused.
    """
    server = launch(tmp_path)
    process = server.process
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if READY in line:
                os.kill(process.pid, signal.SIGSTOP)
                break
        else:
            pytest.fail("kvtier serve exited before it served")
        with socket.create_connection(("127.0.0.1", server.port), timeout=30):  # refused if not yet listening
            pass
    finally:
        os.kill(process.pid, signal.SIGCONT)
        server.stop()


def test_a_second_server_on_one_data_directory_refuses_naming_the_first(tmp_path: Path) -> None:
    out = FAULTS[Fault.TWO_SERVERS](tmp_path)
    assert out.held
    assert out.figures == {
        "second_exit_code": 2,
        "refusal_lines": 1,
        "refusal_names_first_pid": 1,
        "tracebacks": 0,
        "first_completion_tokens": 4,
        "first_health": 200,
    }


def test_dozens_of_clients_leaving_mid_stream_are_aborted_and_release_everything(tmp_path: Path) -> None:
    out = FAULTS[Fault.DISCONNECTS](tmp_path)
    assert out.held
    assert out.figures == {
        "clients_left": 32,
        "aborted": 32,
        "ran_to_length": 0,
        "in_flight_after": 0,
        "pinned_blocks_after": 0,
        "pool_bytes_unaccounted": 0,
        "completion_tokens_after": 2,
        "tracebacks": 0,
    }
