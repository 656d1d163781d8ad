"""The ``kvtier`` command line.

``kvtier bench tiers [--json]``: host and disk tier bandwidth next to a raw
memcpy / raw disk read of the same bytes, and block-key cost next to one raw
xxh3 pass (see :mod:`kvtier.bench.tiers`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from kvtier.config import ConfigError, load_config


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV cache for LLM inference.")
    parser.add_argument("--config", type=Path, default=None, help="YAML config (see config.example.yaml)")
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks, each a ratio against a raw baseline")
    which = bench.add_subparsers(dest="bench", required=True)
    t = which.add_parser("tiers", help="tier bandwidth vs raw memcpy / disk read; key cost vs raw xxh3")
    t.add_argument("--json", action="store_true", help="print one JSON object")
    t.add_argument("--mib", type=int, default=256, help="bytes moved per repetition (MiB)")
    t.add_argument("--reps", type=int, default=5, help="repetitions; medians are reported")
    t.add_argument(
        "--sweep", type=int, nargs="*", default=[], metavar="BLOCK_SIZE", help="also measure these block sizes"
    )
    t.add_argument("--out", default="bench/results", help="where the JSON and PNG go")
    t.set_defaults(run=_bench_tiers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.run(args)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
