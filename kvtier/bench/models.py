"""`kvtier bench models`: every model this machine has, and what kvtier makes of it.

For each GGUF it finds (the embedded SmolLM2; Gemma 3 270M when its package
is installed; any ``--model`` given), one run measures:

* ``arch``, ``weights`` (how many matrices of each GGML type) and the
  ``tokenizer`` (model and pre-tokenizer);
* ``same_output``: greedy output of an ``N + 64``-token prompt whose first
  ``N`` tokens are a host hit, against a full recompute, token for token;
* ``hit_speedup``: TTFT of the full recompute / TTFT of that host hit
  (``kvtier bench ttft``'s measurement, medians of ``reps``);
* ``decode_tok_s``: greedy decode speed after the ``N``-token prompt, with
  decode steps on the file's quantized blocks (``engine.decode_weights:
  gguf``), the same with their products in int8 (``q8``,
  ``engine.decode_activations: q8``; null without AVX-512 VNNI) and on the
  dequantized matrices (``dense``), and blocks / dense;
* ``swa_bytes_ratio``: bytes that hit copied into the pool / what loading
  every layer copies (null for a model without sliding-window layers);
* with llama-cpp-python's venv (``--llamacpp-python``, by default
  ``.venv-peer-llamacpp/bin/python`` when it exists):
  ``tokenizer_match``, the share of corpus texts
  (:mod:`kvtier.bench.llamacpp_oracle`) tokenized exactly as llama.cpp
  does, and ``next_token_agreement``, teacher-forced over about 1,500
  positions of CPython's ``json`` source: how often kvtier's most likely next
  token is llama.cpp's (K/V in float16, its default), beside
  ``llamacpp_self_agreement`` (llama.cpp with float32 K/V against itself
  with float16: how far its own choices move under rounding alone).
  Without the venv these are null.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench import llamacpp_oracle, results, shapes, ttft
from kvtier.config import Config, DecodeWeights
from kvtier.engine import quant
from kvtier.engine.engine import Engine
from kvtier.engine.llama import LlamaModel, SeqInput
from kvtier.engine.onboard import SlidingWindow
from kvtier.engine.pool import BlockTable
from kvtier.engine.runtime import LoadedModel, load_model, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.hardware import compute_dtype, cpu_isa
from kvtier.model import ModelNotFoundError, default_gguf_path, read_gguf_metadata
from kvtier.model.gguf import weight_types
from kvtier.model.locate import gemma3_270m_path
from kvtier.tiers.base import TierKind

GREEDY = SamplingParams(max_tokens=16)


@dataclass(frozen=True)
class ModelsSpec:
    tokens: int = 2048  # the cached prefix
    reps: int = 3
    threads: int = 2  # llama.cpp's, for its logits
    llamacpp_python: Path | None = None


def available(extra: list[Path] | None = None) -> dict[str, Path]:
    """Name -> GGUF of every model found: the embedded one, Gemma 3 270M if installed, and ``extra``.

    Also the random-weight Qwen2.5-1.5B shape once ``kvtier bench peer
    --model qwen2.5-1.5b-random`` has built it (its row says its weights are
    random: speed and agreement with llama.cpp on the same file mean
    something there, its text does not).
    """
    found = {"smollm2-135m": default_gguf_path()}
    with contextlib.suppress(ModelNotFoundError):
        found["gemma3-270m"] = gemma3_270m_path()
    built = shapes.gguf_path(shapes.QWEN2_5_1_5B)
    if built.exists():
        found[shapes.QWEN2_5_1_5B.name] = built
    for path in extra or []:
        found[path.stem] = path
    return found


def run(config: Config, spec: ModelsSpec, models: dict[str, Path]) -> dict[str, Any]:
    out: dict[str, Any] = {"models": {}}
    for name, path in models.items():
        out["models"][name] = measure(config, spec, path)
    out["setup"] = {
        "tokens": spec.tokens,
        "new_tokens": ttft.NEW_TOKENS,
        "reps": spec.reps,
        "statistic": "median",
        "dtype": compute_dtype(config).value,
        "isa": " ".join(cpu_isa()),
        "llamacpp_python": None if spec.llamacpp_python is None else str(spec.llamacpp_python),
        "llamacpp_threads": spec.threads,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return out


def measure(config: Config, spec: ModelsSpec, path: Path) -> dict[str, Any]:
    tree = config.model_dump()
    tree["engine"] = {**tree["engine"], "model_path": str(path)}
    cfg = Config.model_validate(tree)
    loaded = load_model(cfg, progress=False)
    metadata = read_gguf_metadata(path)
    row: dict[str, Any] = {
        "arch": loaded.model.config.architecture.value,
        "weights": weight_types(path),
        "tokenizer": f"{metadata.get('tokenizer.ggml.model')}/{metadata.get('tokenizer.ggml.pre', '-')}",
        "random_weights": shapes.random_weights(metadata),
    }
    row |= reuse(loaded, cfg, spec)
    timing = ttft.run(loaded, cfg, ttft.TTFTSpec(tokens=spec.tokens, reps=spec.reps))
    row["hit_speedup"] = round(timing["miss_s"] / timing["host_hit_s"], 2)
    row["ttft_s"] = {"recompute": timing["miss_s"], "host_hit": timing["host_hit_s"]}
    row |= against_llamacpp(loaded, path, spec)
    blocks = decode_rate(loaded, cfg, spec)
    q8 = None
    if quant.Q8 and loaded.model.decode_layers is not None:  # the same blocks, products in int8
        loaded.model.q8_decode, exact = True, loaded.model.q8_decode
        q8 = decode_rate(loaded, cfg, spec)
        loaded.model.q8_decode = exact
    del loaded  # one model in memory at a time
    tree["engine"] = {**tree["engine"], "decode_weights": DecodeWeights.DENSE.value}
    dense_cfg = Config.model_validate(tree)
    dense = decode_rate(load_model(dense_cfg, progress=False), dense_cfg, spec)
    row["decode_tok_s"] = {"blocks": blocks, "q8": q8, "dense": dense, "ratio": round(blocks / dense, 2)}
    return row


DECODE_STEPS = 32


def decode_rate(loaded: LoadedModel, config: Config, spec: ModelsSpec) -> float:
    """Tokens per second of greedy decode after an ``N``-token prompt (median of ``reps``; no cache)."""
    engine = make_engine(loaded, config, cache=None, keep_resident=False)
    return decode_median(engine, ttft.text_tokens(loaded, spec.tokens), spec.reps)


def decode_median(engine: Engine, prompt: list[int], reps: int) -> float:
    """Median tokens per second of :data:`DECODE_STEPS` greedy steps after ``prompt``, over ``reps`` requests."""
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    rates = []
    for _ in range(reps):
        (done,) = engine.generate([prompt], params)
        rates.append(DECODE_STEPS / (done.total_s - done.ttft_s))
    return round(statistics.median(rates), 1)


def reuse(loaded: LoadedModel, config: Config, spec: ModelsSpec) -> dict[str, Any]:
    """Greedy output of a host hit against a full recompute, and the bytes that hit copied into the pool."""
    prefix, prompts = ttft.case_prompts(loaded, ttft.TTFTSpec(tokens=spec.tokens, reps=1))
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        tree = config.model_dump()
        tree["data_dir"] = tmp
        tree["disk"] = {**tree["disk"], "path": None, "capacity_bytes": 2 * 1024**3}
        cfg = Config.model_validate(tree)
        (cold,) = make_engine(loaded, cfg, cache=None, keep_resident=False).generate([prompts[0]], GREEDY)
        with open_cache(loaded, cfg) as cache:
            engine = make_engine(loaded, cfg, cache=cache, keep_resident=False)
            engine.generate([prefix], SamplingParams(max_tokens=1))
            engine.drain_stores()
            (hit,) = engine.generate([prompts[0]], GREEDY)
    sliding = SlidingWindow.of(loaded.model.config) is not None
    ratio = engine.onboarded_bytes / engine.onboarded_full_bytes if engine.onboarded_full_bytes else None
    return {
        "same_output": hit.token_ids == cold.token_ids,
        "hit_tokens": hit.served_from.get(TierKind.HOST, 0),
        "swa_bytes_ratio": round(ratio, 3) if sliding and ratio is not None else None,
    }


def against_llamacpp(loaded: LoadedModel, path: Path, spec: ModelsSpec) -> dict[str, Any]:
    python = spec.llamacpp_python
    if python is None or not python.exists():
        return {"tokenizer_match": None, "next_token_agreement": None, "llamacpp_self_agreement": None}
    tokenizer = loaded.tokenizer
    with tempfile.TemporaryDirectory(prefix="bench-models-text-") as tmp:
        folder = Path(tmp)
        texts = llamacpp_oracle.corpus_texts(folder)
        theirs = llamacpp_oracle.llamacpp_tokens(python, path, texts)
        match = statistics.mean(tokenizer.encode_text(t) == theirs[p] for p, t in texts.items())
        text = folder / "agreement.txt"
        text.write_text(
            llamacpp_oracle.AGREEMENT_TEXT.read_text(encoding="utf-8")[: llamacpp_oracle.AGREEMENT_CHARS],
            encoding="utf-8",
        )
        choices = llamacpp_oracle.llamacpp_choices(python, path, text, spec.threads)
    ours = teacher_forced_argmax(loaded.model, choices["ids"])
    f16, f32 = np.array(choices["f16"]["argmax"]), np.array(choices["f32"]["argmax"])
    return {
        "tokenizer_match": round(float(match), 4),
        "next_token_agreement": round(float((ours == f16).mean()), 4),
        "llamacpp_self_agreement": round(float((f32 == f16).mean()), 4),
        "agreement_positions": len(ours),
    }


def teacher_forced_argmax(model: LlamaModel, ids: list[int]) -> np.ndarray:
    """The model's most likely next token after every prefix of ``ids``, in one prefill."""
    block = 16
    pool = model.make_pool(block, len(ids) // block + 1)
    table = BlockTable()
    pool.grow(table, len(ids))
    (logits,) = model.forward_all([SeqInput(ids, 0, table)], pool)
    return logits.argmax(-1).cpu().numpy()


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    path = results.write(result, out_dir, "models")
    plt = results.pyplot()
    if plt is None:
        return path, None
    names = list(result["models"])
    speedups = [result["models"][n]["hit_speedup"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(names, speedups, color="#4c72b0")
    ax.set_ylabel("TTFT recompute / host hit")
    ax.set_title(f"{result['setup']['tokens']:,}-token hit + {result['setup']['new_tokens']} new, median")
    for i, value in enumerate(speedups):
        ax.text(i, value, f"{value:.1f}x", ha="center", va="bottom")
    fig.tight_layout()
    png = out_dir / "models-latest.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return path, png


def table(result: dict[str, Any]) -> str:
    lines = [
        f"kvtier models: {result['setup']['tokens']:,}-token host hit + {result['setup']['new_tokens']} new, "
        f"{result['setup']['dtype']}, median of {result['setup']['reps']}"
    ]
    for name, m in result["models"].items():
        weights = ", ".join(f"{k} x{v}" for k, v in m["weights"].items())
        swa = "-" if m["swa_bytes_ratio"] is None else f"{m['swa_bytes_ratio']:.2f}"
        agree = "-" if m["next_token_agreement"] is None else f"{m['next_token_agreement']:.3f}"
        tokens = "-" if m["tokenizer_match"] is None else f"{m['tokenizer_match']:.2f}"
        lines.append(
            f"  {name:14s} {m['arch']:7s} {m['tokenizer']:12s} hit {m['hit_speedup']:5.1f}x  same output "
            f"{m['same_output']}  swa bytes {swa}  tokens = llama.cpp {tokens}  next token {agree}"
        )
        d = m["decode_tok_s"]
        q8 = "" if d.get("q8") is None else f" ({d['q8']:.1f} with int8 products)"
        lines.append(
            f"  {'':14s} weights: {weights}; decode {d['blocks']:.1f} tok/s on blocks{q8}, {d['dense']:.1f} dense"
        )
        if m.get("random_weights"):
            lines.append(f"  {'':14s} random weights in the model's exact shape: speed does not depend on their values")
    return "\n".join(lines)


__all__ = ["ModelsSpec", "available", "measure", "run", "save", "table"]
