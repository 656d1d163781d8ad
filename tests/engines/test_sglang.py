"""kvtier as SGLang's HiCache L3 backend, inside SGLang's own storage path, across fresh processes.

Runs only under ``--engines`` (``make test-engines``): it needs SGLang's venv
(``ENGINES_SGLANG_PYTHON``, default ``.venv-peer-sglang/bin/python``). Each
SGLang here is a process of ``tests/engines/runners/sglang_runner.py``: a
real ``MHATokenToKVPoolHost`` on the CPU, the backend loaded by SGLang's
``dynamic`` factory, pages moved by ``HiCacheController``'s own L3 methods
(see the runner's docstring for what is SGLang's code and what is not). The
service is a real ``kvtier cache serve`` started from this venv for a tiny
Hugging Face directory whose shape is the runner's pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.bench import engines
from kvtier.config import load_config
from kvtier.connectors.sglang_pages import Shard, page_namespace
from kvtier.identity import kv_identity_for
from kvtier.manager import CacheManager
from kvtier.service.client import CacheClient

pytestmark = pytest.mark.engines

SGLANG_PYTHON = Path(os.environ.get("ENGINES_SGLANG_PYTHON", engines.REPO / ".venv-peer-sglang" / "bin" / "python"))
RUNNER = Path(__file__).parent / "runners" / "sglang_runner.py"
LAYERS, KV_HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
PAGES = 6
TOKENS = list(range(1000, 1000 + PAGES * PAGE))


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"no SGLang venv at {SGLANG_PYTHON} (make test-engines builds it)")
    return SGLANG_PYTHON


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face directory of the runner's shape: all kvtier reads of it is config.json and the weights' bytes."""
    root = tmp_path_factory.mktemp("model")
    config = {
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2 * KV_HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_size": 2 * KV_HEADS * HEAD_DIM,
        "head_dim": HEAD_DIM,
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(torch.arange(4096, dtype=torch.int32).numpy().tobytes())
    return root


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "runner.yaml").write_text(f"data_dir: {tmp_path / 'runner-data'}\n")
    return tmp_path


def serve(work: Path, model: Path) -> engines.ServiceProcess:
    return engines.ServiceProcess(work / "cache.sock", work / "data", model=model, dtype="float32", block_size=PAGE)


def sglang(
    python: Path, work: Path, model: Path, name: str, layout: str = "page_first", path: str = "v1"
) -> engines.EngineProcess:
    args = ["--model", str(model), "--socket", str(work / "cache.sock"), "--config", str(work / "runner.yaml")]
    args += ["--layout", layout, "--path", path, "--layers", str(LAYERS), "--heads", str(KV_HEADS)]
    args += ["--head-dim", str(HEAD_DIM), "--page-size", str(PAGE)]
    return engines.EngineProcess(python, str(RUNNER), args, work / f"{name}.log", timeout=300)


def ok(answer: dict) -> dict:
    """A runner's answer to a command that raised nothing into SGLang."""
    assert "error" not in answer, answer.get("trace") or answer["error"]
    return answer


def identity(model: Path, data_dir: Path):
    return kv_identity_for(model, torch.float32, PAGE, data_dir)


def service_stats(work: Path, model: Path) -> dict:
    layout, fp = identity(model, work / "ids")
    with CacheClient(work / "cache.sock", layout, model_fingerprint=fp) as client:
        return client.stats()


def damage_page(data_dir: Path, model: Path, key: str) -> None:
    """Flip a byte inside SGLang page ``key``'s block where the (stopped) service's disk tier keeps it."""
    config = load_config(environ={"KVTIER_DATA_DIR": str(data_dir)})
    config = config.model_copy(update={"cache": config.cache.model_copy(update={"block_size": PAGE})})
    layout, fp = identity(model, data_dir)
    with CacheManager(config, layout, model_fingerprint=fp) as manager:
        assert manager.disk is not None
        name = manager.hasher.named(key.encode(), page_namespace(config.cache.namespace, Shard()))
        path, offset = manager.disk.slab_path(manager.disk.slot_of(name))
    offset += layout.layer_bytes + 11  # inside the block's second layer
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x20]))


@pytest.fixture
def service(work: Path, model: Path) -> Iterator[engines.ServiceProcess]:
    s = serve(work, model)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("set_layout", "get_layout", "path"),
    [
        ("page_first", "page_first", "v1"),
        ("layer_first", "page_head", "v1"),
        ("page_first_direct", "layer_first", "generic"),
    ],
)
def test_pages_set_by_one_sglang_process_come_back_byte_identical_in_a_fresh_one(
    sglang_python: Path, work: Path, model: Path, service: engines.ServiceProcess, set_layout, get_layout, path
) -> None:
    with sglang(sglang_python, work, model, "setter", set_layout, path) as setter:
        assert setter.ready["backend"] == "KVTierStorage" and setter.ready["is_hicache_storage"]
        assert setter.ready["abstract_left"] == []  # every abstract method of SGLang's HiCacheStorage implemented
        put = ok(setter.ask("set", tokens=TOKENS, seed=1))
        assert put["stored_pages"] == PAGES
    assert service_stats(work, model).tiers["host"].blocks == PAGES
    with sglang(sglang_python, work, model, "fresh", get_layout, path) as fresh:
        got = ok(fresh.ask("get", tokens=TOKENS))
        again = ok(fresh.ask("set", tokens=TOKENS, seed=1))  # held already: SGLang is told stored, nothing rewritten
        assert ok(fresh.ask("stats"))["stored_pages"] == 0
    assert got["hit_pages"] == got["loaded_pages"] == PAGES
    assert got["digests"] == put["digests"]  # every page, byte for byte, whatever either pool's layout
    assert again["stored_pages"] == PAGES


def test_batch_exists_counts_the_leading_pages_held(
    sglang_python: Path, work: Path, model: Path, service: engines.ServiceProcess
) -> None:
    with sglang(sglang_python, work, model, "leading") as e:
        keys = ok(e.ask("set", tokens=TOKENS[: 4 * PAGE], seed=2))["keys"]
        assert ok(e.ask("exists", keys=[keys[0], keys[1], "0" * 64, keys[3]])) == {
            "leading": 2,
            "each": [True, True, False, True],
        }
        got = ok(e.ask("get", tokens=TOKENS))  # six pages asked, the first four held
        assert got["hit_pages"] == got["loaded_pages"] == 4
        other_start = [7] * PAGE + TOKENS[PAGE:]  # SGLang's keys chain: another first page changes every key
        assert ok(e.ask("get", tokens=other_start))["hit_pages"] == 0


def test_a_stopped_service_is_a_miss_for_every_call_never_an_exception(
    sglang_python: Path, work: Path, model: Path, service: engines.ServiceProcess
) -> None:
    with sglang(sglang_python, work, model, "orphaned") as e:
        keys = ok(e.ask("set", tokens=TOKENS[: 4 * PAGE], seed=3))["keys"]
        service.stop()
        assert ok(e.ask("exists", keys=keys)) == {"leading": 0, "each": [False] * 4}
        assert ok(e.ask("get", tokens=TOKENS))["hit_pages"] == 0
        assert ok(e.ask("set", tokens=TOKENS[4 * PAGE :], seed=4))["stored_pages"] == 0
        assert ok(e.ask("stats"))["service_failures"] >= 1
    with sglang(sglang_python, work, model, "no-service") as e:  # no service when SGLang starts: it starts
        assert ok(e.ask("get", tokens=TOKENS))["hit_pages"] == 0
        assert ok(e.ask("set", tokens=TOKENS, seed=5))["stored_pages"] == 0


def test_a_damaged_block_is_a_miss_never_wrong_bytes(sglang_python: Path, work: Path, model: Path) -> None:
    with serve(work, model), sglang(sglang_python, work, model, "before") as e:
        put = ok(e.ask("set", tokens=TOKENS, seed=6))
    damage_page(work / "data", model, put["keys"][1])  # the stopped service flushed every page to disk
    with serve(work, model):
        with sglang(sglang_python, work, model, "after") as e:
            got = ok(e.ask("get", tokens=TOKENS))
        disk = service_stats(work, model).tiers["disk"]
    assert got["hit_pages"] == PAGES  # the index believes every page: only reading one finds the damage
    assert got["loaded_pages"] == 1 and got["digests"] == put["digests"][:1]
    assert got["untouched"] == [True] * (PAGES - 1)  # the damaged page and those after it: not a byte written
    assert disk.checksum_failures == 1
