"""`kvtier bench ttft`: time to first token for an N-token prefix + 64 new tokens, four ways, one run.

The request is an agent's next turn: an ``N``-token transcript the engine has
seen before plus 64 new tokens. Measured back to back on the same loaded
weights:

* ``miss``: nothing cached, the full ``N + 64`` tokens are prefilled;
* ``host_hit``: the prefix's blocks are in kvtier's host tier, copied into
  the pool layer by layer under the forward (the default);
* ``host_hit_sync``: the same with ``transfer.layerwise: false``: every block
  is copied into the pool before the forward starts (what the overlap saves);
* ``disk_hit``: only on disk, with the slab's page cache dropped
  (``posix_fadvise(DONTNEED)``; ``"cold": false`` in the JSON if that failed);
* ``resident_hit``: the prefix is still in the engine's own pool (device tier).

``raw_prefill`` is the hardware's own speed for the same work: the
forward's matrix products (same shapes, dtype and thread count, one
``torch.mm`` each) plus causal SDPA over the same ``N + 64`` tokens, with
none of the engine around them: how close the full recompute runs to what
this machine can do at all.

Each repetition appends a different 64-token tail, and each cached case has
tails of its own, so no measurement can hit the blocks of an earlier one's
tail. Repetitions interleave the cases (see :func:`run`); medians over ``reps``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvtier import openmp
from kvtier.bench import results
from kvtier.config import Config
from kvtier.demo.session import load_session
from kvtier.engine.engine import Engine
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.hardware import compute_dtype
from kvtier.tiers.base import TierKind

NEW_TOKENS = 64
FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class TTFTSpec:
    tokens: int = 4096
    reps: int = 3


def text_tokens(loaded: LoadedModel, n: int) -> list[int]:
    """``n`` token ids of real text (the demo session's files, repeated as needed)."""
    session = load_session()
    text = "\n\n".join(t["tool"]["content"] for t in session["turns"])
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _ttft(engine: Engine, ids: list[int]) -> float:
    (done,) = engine.generate([ids], FIRST_TOKEN)
    engine.drain_stores()
    return done.ttft_s


CACHED_CASES = 3  # host hit, host hit copy-first, disk hit: each needs tails no other case has stored


def case_prompts(loaded: LoadedModel, spec: TTFTSpec, case: int = 0) -> tuple[list[int], list[list[int]]]:
    """The prefix, and ``reps + 1`` prompts (prefix + a 64-token tail) for cached case ``case``.

    Every cached case stores its tails' blocks (write-through, so on disk
    too); a later case on the same prompts would find its tail cached and
    measure a shorter prefill. So each case gets tails of its own, from
    further along the same text. Case 0 (the host hit, and the peers'
    prompts) comes first in the text.
    """
    per_case = NEW_TOKENS * (spec.reps + 1)
    ids = text_tokens(loaded, spec.tokens + per_case * CACHED_CASES)
    prefix = ids[: spec.tokens]
    at = spec.tokens + per_case * case
    tails = [ids[at + NEW_TOKENS * r : at + NEW_TOKENS * (r + 1)] for r in range(spec.reps + 1)]
    return prefix, [prefix + t for t in tails]  # the first prompt warms up; the rest are measured


def run(loaded: LoadedModel, config: Config, spec: TTFTSpec) -> dict[str, Any]:
    """Every case once per repetition, in turn: a neighbour's load that comes and goes hits all cases alike.

    On a shared machine the speed drifts by tens of percent over minutes;
    timing each case's repetitions back to back would put that drift into
    the ratios. So every case is warmed up first, then each repetition
    runs miss, bare matmuls, host hit, copy-first host hit, cold disk hit
    and resident hit in that order.
    """
    prefix, prompts = case_prompts(loaded, spec, 0)
    sync_prompts, disk_prompts = case_prompts(loaded, spec, 1)[1], case_prompts(loaded, spec, 2)[1]
    cold: list[bool] = []
    with tempfile.TemporaryDirectory(prefix="bench-ttft-", dir=_mkdir(config.data_dir)) as tmp:
        tree = config.model_dump()
        tree["data_dir"] = tmp
        tree["disk"] = {**tree["disk"], "path": None, "enabled": True, "capacity_bytes": 2 * 1024**3}
        tree["cache"] = {**tree["cache"], "write_mode": "write_through"}  # so the disk holds the prefix too
        cfg = Config.model_validate(tree)
        sync_cfg = Config.model_validate(tree | {"transfer": {**tree["transfer"], "layerwise": False}})
        with open_cache(loaded, cfg) as cache:
            recompute = make_engine(loaded, cfg, cache=None, keep_resident=False)
            tiered = make_engine(loaded, cfg, cache=cache, keep_resident=False)
            sync = make_engine(loaded, sync_cfg, cache=cache, keep_resident=False)
            resident = make_engine(loaded, cfg, cache=None, keep_resident=True, hasher=cache.hasher)

            def from_disk(p: list[int]) -> float:
                cache.clear(TierKind.HOST)
                cold.append(cache.disk is not None and cache.disk.drop_page_cache())
                seconds = _ttft(tiered, p)
                _ttft(tiered, prefix)  # the whole prefix back in host for the next repetition's host hits
                return seconds

            cases: dict[str, tuple[Callable[[list[int]], float], list[list[int]]]] = {
                "miss_s": (lambda p: _ttft(recompute, p), prompts),
                "raw_prefill_s": (lambda p: raw_prefill_s(loaded, len(p)), prompts),
                "host_hit_s": (lambda p: _ttft(tiered, p), prompts),
                "host_hit_sync_s": (lambda p: _ttft(sync, p), sync_prompts),
                "disk_hit_s": (from_disk, disk_prompts),
                "resident_hit_s": (lambda p: _ttft(resident, p), prompts),
            }
            _ttft(tiered, prefix)  # stores the prefix, in host and (write-through) on disk
            _ttft(resident, prefix)
            times: dict[str, list[float]] = {name: [] for name in cases}
            total = len(cases) * (spec.reps + 1)
            with tqdm(total=total, desc="bench ttft", unit="run", leave=False) as bar:
                for rep in range(spec.reps + 1):  # repetition 0 warms every case up: allocator, page tables
                    for name, (fn, case_prompts_) in cases.items():
                        seconds = fn(case_prompts_[rep])
                        if rep:
                            times[name].append(seconds)
                        bar.update()
            cold = cold[1:]  # the warm-up's
    out: dict[str, Any] = {"tokens": spec.tokens, "new_tokens": NEW_TOKENS}
    out.update({k: round(statistics.median(v), 4) for k, v in times.items()})
    out["cold"] = all(cold)
    out["setup"] = {
        "dtype": compute_dtype(config).value,
        "device": _device_name(loaded.model.device),
        "omp_wait_policy": openmp.wait_policy,
        "block_size": config.cache.block_size,
        "reps": spec.reps,
        "statistic": "median",
        "order": "interleaved: each repetition runs every case once, in the order of all_s",
        "all_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return out


def raw_prefill_s(loaded: LoadedModel, tokens: int) -> float:
    """Seconds for a prefill's bare matrix products and attention: the floor an engine can approach."""
    model = loaded.model
    c = model.config
    like = {"dtype": model.dtype, "device": model.device}
    x = torch.randn(tokens, c.hidden_size, **like)
    attn_out = torch.randn(tokens, c.num_heads * c.head_dim, **like)  # wider than hidden in Gemma 3
    mlp_in = torch.randn(tokens, c.intermediate_size, **like)
    q = torch.randn(1, c.num_heads, tokens, c.head_dim, **like)
    kv = torch.randn(1, c.num_kv_heads, tokens, c.head_dim, **like)
    cuda = model.device.type == "cuda"
    with torch.inference_mode():
        if cuda:  # a GPU runs these asynchronously: time from an idle device to the last product's end
            torch.cuda.synchronize(model.device)
        started = time.perf_counter()
        for layer in model.layers:
            torch.mm(x, layer.wqkv.T)
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
            torch.mm(attn_out, layer.wo.T)
            torch.mm(x, layer.w_gate_up.T)
            torch.mm(mlp_in, layer.w_down.T)
        torch.mm(x[-1:], model.lm_head.T)
        if cuda:
            torch.cuda.synchronize(model.device)
        return time.perf_counter() - started


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def ratios(result: dict[str, Any]) -> dict[str, float]:
    miss = result["miss_s"]
    return {
        "miss_vs_host_hit": round(miss / result["host_hit_s"], 1),
        "miss_vs_disk_hit": round(miss / result["disk_hit_s"], 1),
        "host_hit_vs_resident": round(result["host_hit_s"] / result["resident_hit_s"], 2),
        "layerwise_vs_sync": round(result["host_hit_s"] / result["host_hit_sync_s"], 2),
        "miss_vs_raw_prefill": round(miss / result["raw_prefill_s"], 2),
    }


def table(result: dict[str, Any]) -> str:
    r = ratios(result)
    return "\n".join(
        [
            f"kvtier TTFT: {result['tokens']:,}-token prefix + {result['new_tokens']} new tokens, "
            f"{result['setup']['dtype']}, median of {result['setup']['reps']}",
            f"  full recompute      {result['miss_s']:8.3f} s   bare matmuls + SDPA {result['raw_prefill_s']:.3f} s "
            f"(recompute / raw = {r['miss_vs_raw_prefill']:.2f})",
            f"  host-tier hit       {result['host_hit_s']:8.3f} s   {r['miss_vs_host_hit']:6.1f}x faster",
            f"  host hit, no overlap{result['host_hit_sync_s']:8.3f} s   layer-wise / copy-first = "
            f"{r['layerwise_vs_sync']:.2f}",
            f"  disk-tier hit       {result['disk_hit_s']:8.3f} s   {r['miss_vs_disk_hit']:6.1f}x faster"
            f"   (cold page cache: {result['cold']})",
            f"  resident in pool    {result['resident_hit_s']:8.3f} s   host hit / resident = "
            f"{r['host_hit_vs_resident']:.2f}",
        ]
    )


def save(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path | None]:
    """Write the JSON (dated and ``-latest``) and a PNG plot beside it when matplotlib is present."""
    path = results.write({**result, "ratios": ratios(result)}, out_dir, f"ttft-{result['tokens']}")
    return path, plot(result, path.with_suffix(".png"))


def plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = results.pyplot()
    if plt is None:
        return None
    names = ["full recompute", "host hit", "host hit,\ncopy first", "disk hit (cold)", "resident"]
    values = [result[k] for k in ("miss_s", "host_hit_s", "host_hit_sync_s", "disk_hit_s", "resident_hit_s")]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=["#999999", "#4c72b0", "#8fa8d6", "#dd8452", "#55a868"])
    ax.bar_label(bars, labels=[f"{v:.3f}s" for v in values])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title(
        f"TTFT, {result['tokens']:,} cached + {result['new_tokens']} new tokens "
        f"({result['setup']['dtype']}, {result['setup']['date']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
