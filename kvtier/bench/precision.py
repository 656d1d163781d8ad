"""`kvtier bench precision`: what each KV precision costs and saves, against float32 KV, in one run.

Each row is the same model (the embedded SmolLM2, or ``--model``) with its
KV pool, and so every tier, at one precision: ``float32``, ``int8``,
``fp8_e4m3`` and ``float16`` compute in float32, so only the KV differs
between them; ``bfloat16`` is the bfloat16 engine (its KV is its compute
dtype) and ``int8_bf16_compute`` that engine over int8 KV (what
``engine.dtype: auto`` gives on a CPU with native bf16; read it against the
``bfloat16`` row). Per row:

* ``bytes_per_token``: KV bytes a token takes in the pool, every tier and
  on the wire (all layers, K and V, an 8-bit row's scales included), and
  ``host_capacity_tokens``: how many tokens the configured host tier holds;
* ``agreement_vs_fp32`` and ``nll_delta``: teacher-forced over
  :data:`POSITIONS` positions of real text (CPython's sources and Debian's
  GPL text, cut into :data:`WINDOW`-token windows, each prefilled from
  position 0): how often the most likely next token is float32 KV's, and
  the mean negative log-likelihood of the text's next token minus float32
  KV's (positive: worse);
* ``same_output``: greedy output of a prompt whose prefix is served from
  the host tier, from disk and from Redis, each against a full recompute at
  the same precision, token for token;
* ``decode_tok_s_8k``: greedy decode speed after an :data:`LONG`-token
  prompt (median of ``reps``; the prompt is prefilled once and kept in the
  engine's pool, decode reads all of it every step), its requests
  alternating with float32 KV's (``decode_fp32_alternating_tok_s_8k``,
  which its ratio divides by);
* ``remote_hit_s_4k`` and ``disk_hit_s_4k``: TTFT of a 4,096-token prompt
  whose blocks another instance stored, served from a throwaway
  ``redis-server`` on loopback (the host tier emptied before each
  repetition), and from disk with its page cache dropped. Either includes
  the reader's own forward over the last, partial block (16 tokens against
  4,080 cached), the same at every precision; ``remote_fetch_s_4k`` is the
  remote tier's part alone: its pipelined GETs of those blocks.

``ratios`` divides each row by float32's; the targets for 8-bit KV are
bytes ≤ 0.27x, agreement ≥ 0.97, decode at 8k ≥ 1.3x, remote hit ≤ 0.6x.
"""

from __future__ import annotations

import statistics
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.bench import results, ttft
from kvtier.bench.models import DECODE_STEPS, ModelsSpec, decode_median
from kvtier.bench.models import reuse as host_reuse
from kvtier.bench.redis_server import RedisServer
from kvtier.cache import Cache
from kvtier.config import Config
from kvtier.engine.engine import Engine
from kvtier.engine.llama import SeqInput
from kvtier.engine.pool import BlockTable
from kvtier.engine.runtime import LoadedModel, load_model, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.hardware import cpu_isa
from kvtier.keys import KeyHasher
from kvtier.layout import dtype_name
from kvtier.promote import PROMOTE_BATCH
from kvtier.tiers.base import TierKind

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXTS = [
    Path("/usr/share/common-licenses/GPL-3"),
    STDLIB / "textwrap.py",
    STDLIB / "json" / "decoder.py",
    STDLIB / "json" / "encoder.py",
    STDLIB / "argparse.py",
]
WINDOW = 2048
POSITIONS = 10_240  # five windows, each scored at its 2,047 next tokens and one more
LONG = 8000  # decode's context: 8,000 tokens, then DECODE_STEPS more, inside SmolLM2's 8,192
HIT_TOKENS = 4096
CONTINUATION = SamplingParams(max_tokens=8, ignore_eos=True)
FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class Precision:
    """One row: the engine's compute dtype and its KV pool's."""

    name: str
    dtype: str
    kv_dtype: str


ROWS = (
    Precision("float32", "float32", "auto"),
    Precision("bfloat16", "bfloat16", "auto"),
    Precision("int8", "float32", "int8"),
    Precision("fp8_e4m3", "float32", "fp8_e4m3"),
    Precision("float16", "float32", "float16"),
    Precision("int8_bf16_compute", "bfloat16", "int8"),
)


@dataclass(frozen=True)
class PrecisionSpec:
    reps: int = 3
    positions: int = POSITIONS
    long: int = LONG
    window: int = WINDOW
    hit_tokens: int = HIT_TOKENS
    rows: tuple[Precision, ...] = ROWS  # the first is the baseline, float32 KV


def text_windows(loaded: LoadedModel, positions: int, window: int = WINDOW) -> list[list[int]]:
    """Windows of ``window`` + 1 token ids of real text, enough to score ``positions`` next tokens."""
    ids: list[int] = []
    for path in TEXTS:
        if path.exists():
            ids += loaded.tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False)
    windows = []
    for at in range(0, len(ids) - window, window):
        if len(windows) * window >= positions:
            break
        windows.append(ids[at : at + window + 1])
    if len(windows) * window < positions:
        raise RuntimeError(f"the texts hold {len(ids)} tokens, fewer than {positions} positions need")
    return windows


def scores(loaded: LoadedModel, windows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced argmax and negative log-likelihood of the text's next token at every scored position."""
    model = loaded.model
    argmax, nll = [], []
    for ids in windows:
        pool = model.make_pool(16, len(ids) // 16 + 1)
        table = BlockTable()
        pool.grow(table, len(ids) - 1)
        (logits,) = model.forward_all([SeqInput(ids[:-1], 0, table)], pool)
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(ids[1:])
        argmax.append(logits.argmax(-1).numpy())
        nll.append((-logp[torch.arange(len(target)), target]).numpy())
        del logits, logp, pool
    return np.concatenate(argmax), np.concatenate(nll)


@dataclass(frozen=True)
class LongContext:
    """An engine holding a ``spec.long``-token prompt in its pool, ready to decode after it."""

    engine: Engine
    prompt: list[int]

    @classmethod
    def prefill(cls, loaded: LoadedModel, config: Config, spec: PrecisionSpec) -> LongContext:
        prompt = ttft.text_tokens(loaded, spec.long)
        layout = loaded.model.kv_layout(config.cache.block_size)
        hasher = KeyHasher.process_local(layout.descriptor, config.cache.block_size)
        engine = make_engine(loaded, config, cache=None, keep_resident=True, hasher=hasher)
        engine.generate([prompt], SamplingParams(max_tokens=1))  # the long prefill, once
        return cls(engine, prompt)

    def rate(self) -> float:
        """Tokens per second of one request's decode steps, served from the pool."""
        return decode_median(self.engine, self.prompt, 1)


def decode_rates(ctx: LongContext, baseline: LongContext | None, reps: int) -> tuple[float, float | None]:
    """Median decode rates of ``ctx`` and of float32 KV's ``baseline``, their requests alternating.

    Alternating is what makes the ratio mean something on a shared VM:
    its speed drifts by tens of percent over minutes, and rows measured
    minutes apart would carry that drift into the ratio.
    """
    ours, base = [], []
    for _ in range(reps + 1):  # the first round warms both up
        ours.append(ctx.rate())
        if baseline is not None:
            base.append(baseline.rate())
    return round(statistics.median(ours[1:]), 1), round(statistics.median(base[1:]), 1) if base else None


def tier_hits(loaded: LoadedModel, config: Config, spec: PrecisionSpec) -> dict[str, Any]:
    """TTFT of a ``spec.hit_tokens`` prompt served from Redis and from disk, and their outputs against a recompute."""
    ids = ttft.text_tokens(loaded, spec.hit_tokens)
    with tempfile.TemporaryDirectory(prefix="bench-precision-") as tmp, RedisServer.start() as redis:

        def node(name: str, *, disk: bool, remote: bool) -> Config:
            tree = config.model_dump()
            tree["data_dir"] = str(Path(tmp) / name)
            tree["cache"] = {
                **tree["cache"],
                "secret_file": str(Path(tmp) / "deployment.secret"),
                "write_mode": "write_through",
            }
            tree["disk"] = {**tree["disk"], "enabled": disk, "path": None, "capacity_bytes": 2 * 1024**3}
            tree["remote"] = {**tree["remote"], "enabled": remote, "urls": [redis.url], "timeout_ms": 5000}
            return Config.model_validate(tree)

        writer_cfg, reader_cfg = node("writer", disk=True, remote=True), node("reader", disk=False, remote=True)
        (cold,) = make_engine(loaded, writer_cfg, cache=None, keep_resident=False).generate([ids], CONTINUATION)
        with open_cache(loaded, writer_cfg) as writer, open_cache(loaded, reader_cfg) as reader:
            stores = make_engine(loaded, writer_cfg, cache=writer, keep_resident=False)
            stores.generate([ids], FIRST_TOKEN)
            stores.drain_stores()
            assert writer.remote is not None and writer.remote.flush(120)
            from_redis = make_engine(loaded, reader_cfg, cache=reader, keep_resident=False)
            remote_s, disk_s, same, cold_disk = [], [], [], []
            for rep in range(spec.reps + 1):  # repetition 0 warms up
                reader.clear(TierKind.HOST)
                (hit,) = from_redis.generate([ids], CONTINUATION)
                writer.clear(TierKind.HOST)
                cold_disk.append(writer.disk is not None and writer.disk.drop_page_cache())
                (disk_hit,) = stores.generate([ids], CONTINUATION)
                same += [hit.token_ids == cold.token_ids, disk_hit.token_ids == cold.token_ids]
                served = hit.served_from.get(TierKind.REMOTE, 0), disk_hit.served_from.get(TierKind.DISK, 0)
                if min(served) < spec.hit_tokens - config.cache.block_size:
                    raise RuntimeError(f"a hit was not served from its tier (remote, disk tokens: {served})")
                if rep:
                    remote_s.append(hit.ttft_s)
                    disk_s.append(disk_hit.ttft_s)
            fetch_s = remote_fetch_s(reader, ids, spec.reps)
    return {
        "remote_hit_s_4k": round(statistics.median(remote_s), 4),
        "remote_fetch_s_4k": fetch_s,
        "disk_hit_s_4k": round(statistics.median(disk_s), 4),
        "recompute_s_4k": round(cold.ttft_s, 4),
        "tier_same_output": all(same),
        "disk_cold": all(cold_disk[1:]),
    }


def remote_fetch_s(reader: Cache, ids: list[int], reps: int) -> float:
    """The remote tier's own part of that hit: its pipelined GETs of the prompt's blocks, framed and
    authenticated, into payload buffers (no lookup, no engine); median of ``reps``."""
    remote = reader.remote
    assert remote is not None
    keys = reader.keyed(ids).keys
    outs = [torch.empty(reader.layout.block_bytes, dtype=torch.uint8) for _ in keys]
    if not all(r is not None for r in remote.probe(keys)):
        raise RuntimeError("the prompt's blocks are not all in Redis")
    times = []
    for _ in range(reps + 1):  # the first warms up
        start = time.perf_counter()
        for at in range(0, len(keys), PROMOTE_BATCH):
            if not all(remote.get_many(keys[at : at + PROMOTE_BATCH], outs[at : at + PROMOTE_BATCH])):
                raise RuntimeError("a block could not be read back from Redis")
        times.append(time.perf_counter() - start)
    return round(statistics.median(times[1:]), 4)


@dataclass(frozen=True)
class Baseline:
    """What every row is held against: float32 KV's teacher-forced argmax and NLL, and its long context."""

    argmax: np.ndarray
    nll: np.ndarray
    decode: LongContext


def measure(
    config: Config, row: Precision, spec: PrecisionSpec, baseline: Baseline | None
) -> tuple[dict[str, Any], Baseline]:
    """One row against ``baseline`` (None: this row is float32, and what it returns is the baseline)."""
    tree = config.model_dump()
    tree["engine"] = {**tree["engine"], "dtype": row.dtype, "kv_dtype": row.kv_dtype}
    cfg = Config.model_validate(tree)
    loaded = load_model(cfg, progress=False)
    layout = loaded.model.kv_layout(cfg.cache.block_size)
    argmax, nll = scores(loaded, text_windows(loaded, spec.positions, spec.window))
    want_argmax, want_nll = (baseline.argmax, baseline.nll) if baseline is not None else (argmax, nll)
    hits = tier_hits(loaded, cfg, spec)
    same = host_reuse(loaded, cfg, ModelsSpec(tokens=2048, reps=1))["same_output"] and hits.pop("tier_same_output")
    long = LongContext.prefill(loaded, cfg, spec)
    decode, decode_fp32 = decode_rates(long, baseline.decode if baseline is not None else None, spec.reps)
    out = {
        "dtype": row.dtype,
        "kv_dtype": dtype_name(layout.dtype),
        "bytes_per_token": layout.bytes_per_token,
        "host_capacity_tokens": int(cfg.host.capacity_bytes) // layout.block_bytes * layout.block_size,
        "agreement_vs_fp32": round(float((argmax == want_argmax).mean()), 4),
        "nll_delta": round(float(nll.mean() - want_nll.mean()), 5),
        "nll": round(float(nll.mean()), 5),
        "positions": len(argmax),
        "same_output": same,
        "decode_tok_s_8k": decode,
        "decode_fp32_alternating_tok_s_8k": decode_fp32 or decode,
        **hits,
    }
    return out, baseline if baseline is not None else Baseline(argmax, nll, long)


def run(config: Config, spec: PrecisionSpec) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    baseline = None
    for row in spec.rows:
        rows[row.name], baseline = measure(config, row, spec, baseline)
    base = rows["float32"]
    ratios = {
        name: {
            "bytes_per_token": round(r["bytes_per_token"] / base["bytes_per_token"], 4),
            # against float32 KV's requests alternating with this row's (decode_rates)
            "decode_tok_s_8k": round(r["decode_tok_s_8k"] / r["decode_fp32_alternating_tok_s_8k"], 3),
            "remote_hit_s_4k": round(r["remote_hit_s_4k"] / base["remote_hit_s_4k"], 3),
            "remote_fetch_s_4k": round(r["remote_fetch_s_4k"] / base["remote_fetch_s_4k"], 3),
            "disk_hit_s_4k": round(r["disk_hit_s_4k"] / base["disk_hit_s_4k"], 3),
        }
        for name, r in rows.items()
    }
    return {
        "dtypes": rows,
        "ratios_vs_fp32": ratios,
        "setup": {
            "model": str(config.engine.model_path or "embedded smollm2-135m"),
            "isa": " ".join(cpu_isa()),
            "threads": torch.get_num_threads(),
            "reps": spec.reps,
            "statistic": "median",
            "window": spec.window,
            "texts": [str(p) for p in TEXTS if p.exists()],
            "decode_context": spec.long,
            "decode_steps": DECODE_STEPS,
            "hit_tokens": spec.hit_tokens,
            "host_capacity_bytes": int(config.host.capacity_bytes),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
    }


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    path = results.write(result, out_dir, "precision")
    plt = results.pyplot()
    if plt is None:
        return path, None
    names = list(result["ratios_vs_fp32"])
    metrics = ["bytes_per_token", "decode_tok_s_8k", "remote_hit_s_4k", "disk_hit_s_4k"]
    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [result["ratios_vs_fp32"][name][m] for m in metrics]
        ax.bar([m + i * width for m in range(len(metrics))], values, width, label=name)
    ax.set_xticks([m + width * (len(names) - 1) / 2 for m in range(len(metrics))], metrics)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("x float32 KV")
    ax.set_title("KV precision against float32 KV, one run, medians")
    ax.legend()
    fig.tight_layout()
    png = out_dir / "precision-latest.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return path, png


def table(result: dict[str, Any]) -> str:
    lines = [f"kvtier precision: against float32 KV ({result['setup']['isa']}, median of {result['setup']['reps']})"]
    for name, r in result["dtypes"].items():
        x = result["ratios_vs_fp32"][name]
        lines.append(
            f"  {name:9s} {r['bytes_per_token']:6d} B/token ({x['bytes_per_token']:.2f}x)  "
            f"host holds {r['host_capacity_tokens']:,} tokens  agreement {r['agreement_vs_fp32']:.4f}  "
            f"nll {r['nll_delta']:+.4f}  same output {r['same_output']}"
        )
        lines.append(
            f"  {'':9s} decode at {result['setup']['decode_context']:,}: {r['decode_tok_s_8k']:.1f} tok/s "
            f"({x['decode_tok_s_8k']:.2f}x)  remote hit {r['remote_hit_s_4k']:.3f} s ({x['remote_hit_s_4k']:.2f}x; "
            f"its GETs {r['remote_fetch_s_4k']:.3f} s, {x['remote_fetch_s_4k']:.2f}x)  "
            f"disk hit {r['disk_hit_s_4k']:.3f} s ({x['disk_hit_s_4k']:.2f}x)"
        )
    return "\n".join(lines)


__all__ = ["PrecisionSpec", "run", "save", "table"]
