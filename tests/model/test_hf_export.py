"""``kvtier export-hf``: the embedded GGUF as a Hugging Face directory, run for real and read back with transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.model import default_gguf_path, load_tokenizer, read_gguf_metadata

TEXT = "def lookup(keys):\n    return [k for k in keys if k in index]  # café, 東京"


def export(out: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\n")
    cmd = [sys.executable, "-m", "kvtier.cli", "export-hf", str(out), "--config", str(config)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file: its first 8 bytes are the header's length, little-endian."""
    with path.open("rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


@pytest.mark.slow
def test_export_hf_writes_a_directory_transformers_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "smollm2-hf"
    done = export(out, tmp_path)
    assert done.returncode == 0, done.stderr
    assert str(out) in done.stdout
    assert (out / "model.safetensors").is_file() and not out.with_name(out.name + ".partial").exists()
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert not hasattr(config, "quantization_config")  # plain weights: vLLM must not load it as a GGUF
    assert {
        t["dtype"] for name, t in safetensors_header(out / "model.safetensors").items() if name != "__metadata__"
    } == {"F32"}
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ours = load_tokenizer(read_gguf_metadata(default_gguf_path()))
    assert hf_tok.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT, add_special_tokens=False)


def test_export_hf_never_replaces_a_directory(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    done = export(out, tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"{out} exists; remove it or choose another directory"
    assert (out / "notes.txt").read_text() == "keep me"
