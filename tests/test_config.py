from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvtier.config import Config, ConfigError, FsyncMode, OnCorrupt, WriteMode, default_data_dir, load_config
from kvtier.policy import PolicyName

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_and_data_dir_outside_the_source_tree() -> None:
    cfg = load_config(environ={})
    assert cfg.data_dir == default_data_dir()
    assert ROOT not in cfg.data_dir.resolve().parents and cfg.data_dir.resolve() != ROOT
    assert cfg.disk_path == cfg.data_dir / "disk"


def test_yaml_then_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("host:\n  capacity_bytes: 1GiB\n  policy: lfu\ndisk:\n  fsync: always\n")
    env = {"KVTIER_DATA_DIR": str(tmp_path / "d"), "KVTIER_DISK__FSYNC": "never", "OTHER": "x"}
    cfg = load_config(path, environ=env)
    assert cfg.host.capacity_bytes == 1024**3 and cfg.host.policy is PolicyName.LFU
    assert cfg.disk.fsync is FsyncMode.NEVER  # the environment wins over the file
    assert cfg.data_dir == tmp_path / "d"


@pytest.mark.parametrize(
    ("text", "env", "named"),
    [
        ("hots:\n  capacity_bytes: 1\n", {}, "hots"),
        ("host:\n  capacity: 1\n", {}, "host.capacity"),
        ("", {"KVTIER_DISK__FSYNK": "never"}, "disk.fsynk"),
    ],
)
def test_unknown_keys_are_errors_naming_the_key(tmp_path: Path, text: str, env: dict, named: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"{named}: unknown key"):
        load_config(path, environ=env)


def test_bad_values_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cache\.write_mode"):
        load_config(environ={"KVTIER_CACHE__WRITE_MODE": "sometimes"})
    with pytest.raises(ConfigError, match=r"cache\.block_size"):
        load_config(environ={"KVTIER_CACHE__BLOCK_SIZE": "0"})


def test_a_damaged_disk_index_is_quarantined_unless_told_to_refuse() -> None:
    assert load_config(environ={}).disk.on_corrupt is OnCorrupt.QUARANTINE
    assert load_config(environ={"KVTIER_DISK__ON_CORRUPT": "error"}).disk.on_corrupt is OnCorrupt.ERROR
    with pytest.raises(ConfigError, match=r"disk\.on_corrupt"):
        load_config(environ={"KVTIER_DISK__ON_CORRUPT": "wipe"})


def test_example_config_documents_every_key_with_its_default() -> None:
    example = yaml.safe_load((ROOT / "config.example.yaml").read_text())
    defaults = Config().model_dump(mode="json")
    defaults.pop("data_dir")
    example.pop("data_dir")

    def walk(expected: dict, got: dict, where: str = "") -> None:
        assert set(got) == set(expected), f"{where or 'top level'}: keys differ"
        for k, v in expected.items():
            if isinstance(v, dict):
                walk(v, got[k], f"{where}{k}.")
            else:
                assert got[k] == v or _same_size(got[k], v), f"{where}{k}: example says {got[k]!r}, default is {v!r}"

    walk(defaults, example)
    loaded = load_config(ROOT / "config.example.yaml", environ={})
    assert loaded.cache.write_mode is WriteMode.WRITE_BACK
    assert loaded.data_dir == Path("~/.cache/kvtier").expanduser()


def _same_size(a: object, b: object) -> bool:
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return TypeAdapter(ByteSize).validate_python(a) == TypeAdapter(ByteSize).validate_python(b)
    except ValidationError:
        return False


def test_the_cache_service_socket_comes_from_cache_service_else_the_data_dir(tmp_path: Path) -> None:
    embedded = load_config(environ={"KVTIER_DATA_DIR": str(tmp_path)})
    assert embedded.cache.service_socket is None and embedded.service_socket == tmp_path / "cache.sock"
    shared = load_config(environ={"KVTIER_DATA_DIR": str(tmp_path), "KVTIER_CACHE__SERVICE": "unix:///run/k.sock"})
    assert shared.service_socket == Path("/run/k.sock")
    with pytest.raises(ConfigError, match=r"cache\.service"):
        load_config(environ={"KVTIER_CACHE__SERVICE": "tcp://x:1"})
