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


# -- kvtier cache check --------------------------------------------------------------------------------------------
def stored_tier(tmp_path: Path, n_blocks: int = 3) -> Path:
    """A config file, and a disk tier under it holding ``n_blocks`` blocks written through a real manager."""
    from kvtier.config import load_config
    from kvtier.manager import CacheManager
    from tests.helpers import BLOCK, payload, prompt, toy_layout

    config = tmp_path / "kvtier.yaml"
    config.write_text(
        f"data_dir: {tmp_path / 'data'}\ncache: {{block_size: {BLOCK}, write_mode: write_through}}\n"
        "disk: {capacity_bytes: 65536}\nhost: {capacity_bytes: 65536}\n"
    )
    layout = toy_layout()
    with CacheManager(load_config(config, environ={}), layout, model_fingerprint="toy-model") as m:
        assert m.store(m.keyed(prompt(n_blocks * BLOCK)), [payload(layout, i) for i in range(n_blocks)]) == n_blocks
    return config


def check(config: Path, *extra: str) -> int:
    from kvtier.cli import main

    return main(["cache", "check", "--config", str(config), *extra])


def test_cache_check_passes_a_sound_tier(tmp_path: Path, capsys) -> None:
    config = stored_tier(tmp_path)
    assert check(config, "--read") == 0
    out = capsys.readouterr().out
    assert "3 records in 1 slab files; index ok" in out and "3 blocks read, 0 failed" in out and "healthy" in out


def test_cache_check_finds_a_damaged_index(tmp_path: Path, capsys) -> None:
    config = stored_tier(tmp_path)
    data = tmp_path / "data" / "disk" / "index.lmdb" / "data.mdb"
    with open(data, "r+b") as f:
        f.write(bytes(2 * os.sysconf("SC_PAGE_SIZE")))  # both meta pages
    assert check(config) == 1
    assert "DAMAGED index" in capsys.readouterr().out
    assert data.exists()  # checking moves nothing


def test_cache_check_read_finds_a_block_whose_bytes_changed(tmp_path: Path, capsys) -> None:
    config = stored_tier(tmp_path)
    with open(tmp_path / "data" / "disk" / "slab-0000.bin", "r+b") as f:
        f.seek(4096 + 9)  # slot 1
        f.write(b"\xff")
    assert check(config) == 0  # the index and the slab sizes are sound
    assert check(config, "--read") == 1
    assert "3 blocks read, 1 failed" in capsys.readouterr().out


def test_cache_check_finds_records_past_a_missing_slab(tmp_path: Path, capsys) -> None:
    config = stored_tier(tmp_path)
    (tmp_path / "data" / "disk" / "slab-0000.bin").unlink()
    assert check(config) == 1
    assert "3 records point past a missing or short file" in capsys.readouterr().out


def test_a_tier_in_use_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    from kvtier.config import load_config
    from kvtier.tiers.disk import DiskTier
    from tests.helpers import toy_layout

    config = stored_tier(tmp_path)
    cfg = load_config(config, environ={})
    tier = DiskTier(cfg.disk_path, toy_layout(), 65536, model_fingerprint="toy-model")
    try:
        assert check(config) == 2
    finally:
        tier.close()
    err = capsys.readouterr().err.strip()
    assert f"in use by pid {os.getpid()}" in err and "\n" not in err and "Traceback" not in err


# -- kvtier cache stats --------------------------------------------------------------------------------------------
def toy_hf_model(root: Path) -> Path:
    """A Hugging Face directory of toy_layout's shape: all a service's identity reads is config.json and the weights."""
    root.mkdir()
    shape = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}
    (root / "config.json").write_text(json.dumps(shape | {"head_dim": 8}))
    (root / "model.safetensors").write_bytes(bytes(range(256)) * 16)
    return root


def cache_stats(tmp_path: Path, socket: Path, model: Path) -> int:
    from kvtier.cli import main
    from tests.helpers import BLOCK

    config = tmp_path / "stats.yaml"
    config.write_text(f"data_dir: {tmp_path / 'stats-data'}\n")
    flags = ["--socket", str(socket), "--model", str(model), "--dtype", "float32", "--block-size", str(BLOCK)]
    return main(["cache", "stats", "--config", str(config), *flags])


def test_cache_stats_prints_a_running_services_stats_as_json(tmp_path: Path, monkeypatch, capsys) -> None:
    import torch

    from kvtier.bench.engines import ServiceProcess
    from kvtier.identity import kv_identity_for
    from kvtier.service import CacheClient
    from tests.helpers import BLOCK, payload, prompt

    monkeypatch.setenv("KVTIER_HOST__CAPACITY_BYTES", "64KiB")
    monkeypatch.setenv("KVTIER_DISK__CAPACITY_BYTES", "64KiB")
    model, socket = toy_hf_model(tmp_path / "model"), tmp_path / "cache.sock"
    with ServiceProcess(socket, tmp_path / "data", model=model, dtype="float32", block_size=BLOCK):
        layout, fingerprint = kv_identity_for(model, torch.float32, BLOCK, tmp_path / "ids")
        with CacheClient(socket, layout, model_fingerprint=fingerprint) as client:
            assert client.store(prompt(2 * BLOCK), [payload(layout, i) for i in range(2)], "default") == 2
        assert cache_stats(tmp_path, socket, model) == 0
    stats = json.loads(capsys.readouterr().out)
    host = stats["tiers"]["host"]  # CacheStats itself, as the service sent it
    assert host["blocks"] == 2 and host["capacity_bytes"] == 64 * 1024 and host["load_latency"]["count"] >= 0


def test_cache_stats_without_a_service_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    model = toy_hf_model(tmp_path / "model")
    assert cache_stats(tmp_path, tmp_path / "nobody.sock", model) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert str(tmp_path / "nobody.sock") in err and "\n" not in err and "Traceback" not in err


def test_a_service_socket_in_a_missing_directory_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    from kvtier.cli import main

    config = tmp_path / "serve.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\n")
    socket = tmp_path / "no" / "such" / "dir" / "cache.sock"
    model = toy_hf_model(tmp_path / "model")
    flags = ["--socket", str(socket), "--model", str(model), "--dtype", "float32"]
    assert main(["cache", "serve", "--config", str(config), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert str(socket.parent) in err and "\n" not in err and "Traceback" not in err
