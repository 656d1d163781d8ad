"""`kvtier bench models` on the embedded model: the report's fields, measured for real (llama.cpp left out)."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.bench import models
from kvtier.config import load_config
from kvtier.engine import quant
from kvtier.model import default_gguf_path


def test_the_report_has_every_field_and_the_hit_is_exact(tmp_path: Path) -> None:
    config = load_config(environ={"KVTIER_DATA_DIR": str(tmp_path / "data")})
    spec = models.ModelsSpec(tokens=128, reps=1, llamacpp_python=None)
    result = models.run(config, spec, {"smollm2-135m": default_gguf_path()})
    row = result["models"]["smollm2-135m"]
    assert row["arch"] == "llama" and row["tokenizer"] == "gpt2/smollm"
    assert row["weights"] == {"Q4_1": 210, "Q8_0": 1}  # 30 layers x 7 projections; the tied embedding
    assert row["same_output"] is True and row["hit_tokens"] == 128
    assert row["swa_bytes_ratio"] is None  # no sliding-window layers
    assert row["hit_speedup"] > 0 and row["ttft_s"]["recompute"] > 0
    assert row["tokenizer_match"] is row["next_token_agreement"] is None  # no llama.cpp given
    assert row["decode_tok_s"]["blocks"] > 0 and row["decode_tok_s"]["dense"] > 0
    assert (row["decode_tok_s"]["q8"] is None) == (not quant.Q8)  # int8 products where the CPU has VNNI
    assert result["setup"]["tokens"] == 128 and result["setup"]["isa"] is not None
    path, _ = models.save(result, tmp_path / "out")
    assert json.loads(path.read_text())["models"]["smollm2-135m"]["same_output"] is True
    assert "smollm2-135m" in models.table(result)
