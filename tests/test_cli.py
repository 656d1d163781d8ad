from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_tiers_json_has_the_promised_fields(tmp_path: Path) -> None:
    env = {**os.environ, "KVTIER_DATA_DIR": str(tmp_path / "data")}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier.cli",
            "bench",
            "tiers",
            "--json",
            "--mib",
            "4",
            "--reps",
            "1",
            "--out",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    result = json.loads(out.stdout)
    assert set(result["host"]) == {"put_gbps", "get_gbps", "memcpy_gbps"}
    assert {"put_gbps", "get_gbps", "raw_read_gbps", "cold"} <= set(result["disk"])
    assert result["keys"]["tokens"] == 131072 and {"keys_ms", "raw_xxh3_ms"} <= set(result["keys"])
    assert all(v > 0 for v in (*result["host"].values(), result["disk"]["get_gbps"], result["keys"]["keys_ms"]))
    saved = json.loads((tmp_path / "results" / "tiers-latest.json").read_text())
    assert saved["host"] == result["host"] and saved["setup"]["reps"] == 1
    assert list((tmp_path / "results").glob("tiers-*.png"))
    assert not list((tmp_path / "data").glob("bench-*")), "the benchmark leaves no scratch files"


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "c.yaml"
    bad.write_text("hots: {}\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "--config", str(bad), "bench", "tiers"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "hots: unknown key" in out.stderr


def test_config_is_taken_before_or_after_the_command(tmp_path: Path) -> None:
    from kvtier.cli import build_parser

    parser = build_parser()
    config = tmp_path / "c.yaml"
    assert parser.parse_args(["--config", str(config), "serve"]).config == config
    assert parser.parse_args(["serve", "--config", str(config)]).config == config
    assert parser.parse_args(["bench", "soak", "--config", str(config)]).config == config
    assert parser.parse_args(["serve"]).config is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("hots: {}\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(bad)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "hots: unknown key" in out.stderr


def test_a_bracketed_ipv6_host_is_the_address() -> None:
    from kvtier.config import load_config
    from kvtier.server.main import is_loopback

    config = load_config(environ={"KVTIER_SERVER__HOST": "[::1]"})
    assert config.server.host == "::1" and is_loopback(config.server.host)
