"""`kvtier bench remote`'s tier-vs-raw half on a tiny run against a real redis-server (no model load)."""

from __future__ import annotations

from kvtier.bench.remote import RemoteSpec, table, tier_vs_raw
from kvtier.cli import build_parser


def test_tier_vs_raw_reports_both_sides_of_each_ratio(redis_server) -> None:
    out = tier_vs_raw(redis_server.url, RemoteSpec(blocks=3, reps=1))
    for name in ("get_gbps", "raw_get_gbps", "put_gbps", "raw_put_gbps", "get_vs_raw", "put_vs_raw", "probe_ms"):
        assert out[name] > 0, name
    assert out["blocks"] == 3 and out["block_bytes"] == 737_280
    assert "raw GET" in table(out)


def test_the_cli_takes_a_url_and_can_skip_the_model() -> None:
    args = build_parser().parse_args(["bench", "remote", "--url", "redis://127.0.0.1:1", "--no-cross-node", "--json"])
    assert (args.url, args.no_cross_node, args.json) == ("redis://127.0.0.1:1", True, True)
