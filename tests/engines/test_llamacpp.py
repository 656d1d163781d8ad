"""kvtier inside real llama-cpp-python 0.3.36: states saved by one process load in fresh ones, output unchanged.

Runs only under ``--engines``: it needs llama-cpp-python's venv with kvtier
installed in it (``ENGINES_LLAMACPP_PYTHON``, default
``.venv-peer-llamacpp/bin/python``). Every Llama here is a separate process
(``bench/runners/llamacpp_runner.py``), greedy, two threads; the
cache service runs on a thread of this process over a real disk tier, so the
test can stop, restart and damage it. One module-wide story, in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
import torch

from kvtier.bench.engines import LLAMACPP_RUNNER, EngineProcess, llamacpp_engine
from kvtier.config import load_config
from kvtier.connectors.llamacpp_store import state_name
from kvtier.identity import kv_identity_for
from kvtier.model import default_gguf_path
from kvtier.service import CacheService

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TOKENS = 4000  # 250 blocks of 16
SHORT = 600  # a prompt for the checks that need no long one
MAX_TOKENS = 8
N_CTX = 4608
N_THREADS = 2
QUESTION = "\n\nQuestion: in two sentences, what do the files above do, and which one would you change first?"


class Service:
    """A cache service for llama.cpp's KV identity (the GGUF, float16, 16-token blocks) over ``data``."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.socket = work / "cache.sock"
        self.svc: CacheService | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> CacheService:
        env = {
            "KVTIER_DATA_DIR": str(self.work / "data"),
            "KVTIER_CACHE__BLOCK_SIZE": "16",
            "KVTIER_HOST__CAPACITY_BYTES": "1GiB",
            "KVTIER_DISK__CAPACITY_BYTES": "2GiB",
            "KVTIER_DISK__FILE_BYTES": "512MiB",
        }
        config = load_config(environ=env)
        layout, fingerprint = kv_identity_for(default_gguf_path(), torch.float16, 16, config.data_dir)
        self.svc = CacheService(
            config, layout, model_fingerprint=fingerprint, socket_path=self.socket, slab_dir=self.work
        )
        self.thread = threading.Thread(target=self.svc.serve_forever, daemon=True)
        self.thread.start()
        return self.svc

    def stop(self) -> None:
        """A planned stop: clients are cut off, host blocks flushed down to disk."""
        if self.svc is not None:
            self.svc.close()
            assert self.thread is not None
            self.thread.join(timeout=60)
            self.svc = None


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llamacpp")


@pytest.fixture(scope="module")
def prompts() -> tuple[list[int], list[int]]:
    from kvtier.bench.soak import text_ids
    from kvtier.model import load_tokenizer, read_gguf_metadata

    p = text_ids(PROMPT_TOKENS)
    q = load_tokenizer(read_gguf_metadata(default_gguf_path())).encode(QUESTION, add_special_tokens=False)
    return p, p + q


@pytest.fixture(scope="module")
def service(work: Path):
    s = Service(work)
    s.start()
    yield s
    s.stop()


def llama(python: Path, work: Path, name: str, socket: Path | None) -> EngineProcess:
    return llamacpp_engine(python, work / f"{name}.log", default_gguf_path(), socket, n_threads=N_THREADS, n_ctx=N_CTX)


@pytest.fixture(scope="module")
def reference(
    llama_python: Path, work: Path, prompts: tuple[list[int], list[int]]
) -> tuple[list[int], list[int], list[int]]:
    """llama.cpp with no cache: what every cached run must reproduce, token for token (and a short prompt's)."""
    p, pq = prompts
    with llama(llama_python, work, "alone", None) as e:
        refs = [e.generate(prompt, MAX_TOKENS)["tokens"] for prompt in (p, pq, p[:SHORT])]
    assert [len(r) for r in refs] == [MAX_TOKENS] * 3
    return refs[0], refs[1], refs[2]


saved_by_first: dict[str, object] = {}


def test_a_fresh_process_continues_from_the_state_another_one_saved(
    llama_python: Path, work: Path, service: Service, prompts: tuple[list[int], list[int]], reference
) -> None:
    p, pq = prompts
    ref_p, ref_pq, _ = reference
    with llama(llama_python, work, "first", service.socket) as first:
        out = first.generate(p, MAX_TOKENS)
    assert out["tokens"] == ref_p and out["cached_tokens"] == 0
    assert out["counters"]["saves"] == {"stored": 1} and out["saved"]["generation"] == 0
    saved_by_first.update(out["saved"], namespace=first.ready["namespace"])
    with llama(llama_python, work, "second", service.socket) as second:
        asked = second.generate(pq, MAX_TOKENS)  # the same document, a new question
        again = second.generate(p, MAX_TOKENS)  # the same prompt
    assert asked["tokens"] == ref_pq and asked["cached_tokens"] >= PROMPT_TOKENS
    assert again["tokens"] == ref_p and again["cached_tokens"] >= PROMPT_TOKENS - 1
    assert again["counters"]["hits"] == 2 and again["counters"]["service_failures"] == 0
    assert service.svc is not None and service.svc.manager.stats().pinned_blocks == 0


def test_without_the_service_llama_answers_alike(
    llama_python: Path, work: Path, service: Service, prompts: tuple[list[int], list[int]], reference
) -> None:
    p, pq = prompts
    with llama(llama_python, work, "orphaned", service.socket) as orphaned:
        service.stop()  # under a connected process
        out = orphaned.generate(pq, MAX_TOKENS)
    assert out["tokens"] == reference[1] and out["cached_tokens"] == 0
    assert out["counters"]["service_failures"] >= 1
    with llama(llama_python, work, "no-service", service.socket) as alone:  # nobody listens at all
        out = alone.generate(p[:SHORT], MAX_TOKENS)
    assert out["tokens"] == reference[2] and out["counters"]["misses"] == 1


def test_a_chunk_corrupted_on_disk_is_a_miss_and_is_stored_again(
    llama_python: Path, work: Path, service: Service, prompts: tuple[list[int], list[int]], reference
) -> None:
    p, _ = prompts
    svc = service.start()  # everything is on disk now; host memory is empty
    m = svc.manager
    position, generation = bytes.fromhex(str(saved_by_first["position"])), int(saved_by_first["generation"])
    key = m.hasher.named(state_name(position, generation, 100), str(saved_by_first["namespace"]))
    assert m.disk is not None and m.disk.slot_of(key) is not None
    path, offset = m.disk.slab_path(m.disk.slot_of(key))
    with open(path, "r+b") as f:
        f.seek(offset + 5000)
        byte = f.read(1)
        f.seek(offset + 5000)
        f.write(bytes([byte[0] ^ 0x20]))
        os.fsync(f.fileno())
    with llama(llama_python, work, "corrupt", service.socket) as e:
        out = e.generate(p, MAX_TOKENS)
    assert out["tokens"] == reference[0]
    assert m.stats().tiers["disk"].checksum_failures == 1
    assert out["cached_tokens"] < PROMPT_TOKENS - 1  # not that state: at most a shorter one's prefix
    assert out["saved"]["generation"] == generation + 1  # recomputed, stored beside the damaged one
    with llama(llama_python, work, "repaired", service.socket) as e:
        out = e.generate(p, MAX_TOKENS)
    assert out["tokens"] == reference[0] and out["cached_tokens"] >= PROMPT_TOKENS - 1


def test_states_survive_a_service_restart(
    llama_python: Path, work: Path, service: Service, prompts: tuple[list[int], list[int]], reference
) -> None:
    _, pq = prompts
    service.stop()
    svc = service.start()
    assert svc.manager.stats().tiers["host"].blocks == 0 and svc.manager.stats().tiers["disk"].blocks > 0
    with llama(llama_python, work, "after-restart", service.socket) as e:
        out = e.generate(pq, MAX_TOKENS)
    assert out["tokens"] == reference[1] and out["cached_tokens"] >= PROMPT_TOKENS
    assert svc.manager.stats().tiers["disk"].hit_tokens > 0


def test_the_benchmark_mode_reports_a_hit_with_the_same_output(
    llama_python: Path, work: Path, prompts: tuple[list[int], list[int]]
) -> None:
    p, pq = prompts
    bench = Service(work / "bench")
    (work / "bench").mkdir()
    bench.start()
    try:
        spec = work / "bench-prompts.json"
        short = p[:1000]  # the mode is what is tested here, not the figures
        spec.write_text(json.dumps({"prompts": [short], "question": pq[len(p) :]}))
        args = [str(llama_python), str(LLAMACPP_RUNNER), "bench", "--model", str(default_gguf_path())]
        args += ["--socket", f"unix://{bench.socket}", "--prompts", str(spec), "--work", str(work / "bench-logs")]
        done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("KVTIER ")]
        result = json.loads(line[len("KVTIER ") :])
    finally:
        bench.stop()
    assert result["same_output"] is True and result["hit_tokens"] >= 1000 // 16 * 16
    assert result["setting"]["n_threads"] == N_THREADS and result["cold_s"] > 0 and result["hit_s"] > 0
    print(json.dumps({k: result[k] for k in ("cold_s", "hit_s", "speedup", "hit_tokens", "same_output")}))
