"""`kvtier bench precision` on the embedded model, small: float32 KV against int8, every field measured for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench import precision
from kvtier.config import load_config


def test_the_report_measures_bytes_quality_reuse_and_hits(tmp_path: Path) -> None:
    config = load_config(environ={"KVTIER_DATA_DIR": str(tmp_path / "data")})
    float32, int8 = (r for r in precision.ROWS if r.name in ("float32", "int8"))
    spec = precision.PrecisionSpec(reps=1, positions=256, long=300, window=256, hit_tokens=512, rows=(float32, int8))
    result = precision.run(config, spec)
    base, kv8 = result["dtypes"]["float32"], result["dtypes"]["int8"]
    assert base["agreement_vs_fp32"] == 1.0 and base["nll_delta"] == 0.0  # itself
    assert kv8["kv_dtype"] == "int8" and kv8["dtype"] == "float32"
    assert result["ratios_vs_fp32"]["int8"]["bytes_per_token"] == pytest.approx(68 / 256, abs=1e-4)
    assert kv8["host_capacity_tokens"] > 3.7 * base["host_capacity_tokens"]
    assert 0.9 <= kv8["agreement_vs_fp32"] < 1.0  # rounded KV moves some choices, not most
    assert kv8["positions"] == base["positions"] == 256
    assert base["same_output"] is kv8["same_output"] is True  # host, disk and Redis hits against recomputes
    assert kv8["disk_cold"] is True and kv8["remote_fetch_s_4k"] > 0 and kv8["decode_tok_s_8k"] > 0
    alternating = kv8["decode_fp32_alternating_tok_s_8k"]  # float32's requests between int8's, for the ratio
    assert result["ratios_vs_fp32"]["int8"]["decode_tok_s_8k"] == pytest.approx(
        kv8["decode_tok_s_8k"] / alternating, abs=1e-3
    )
    path, _ = precision.save(result, tmp_path / "out")
    assert json.loads(path.read_text())["dtypes"]["int8"]["same_output"] is True
    assert "int8" in precision.table(result)
