"""kvtier bench scale at tiny N: the JSON's shape, sane values, and a filled tier that is a real one."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvtier.bench import scale
from kvtier.keys import KeyHasher, Secret
from kvtier.tiers.disk import DiskTier

SPEC = scale.ScaleSpec(points=(1000,), lookups=20, stores=256, host_blocks=200, backends=2)


def test_scale_bench_reports_every_field_of_every_point_and_sane_values(tmp_path: Path) -> None:
    result = scale.run(SPEC, workdir=tmp_path)
    summary = json.loads(json.dumps(scale.summary(result)))
    assert [p["blocks"] for p in summary["points"]] == [1000]
    for p in summary["points"]:
        assert set(scale.FIELDS) <= set(p)
        for field in scale.FIELDS[1:]:
            assert p[field] > 0, field
        assert p["lookup_p99_us"] >= p["lookup_p50_us"] and p["absent_p99_us"] >= p["absent_p50_us"] > 0
        assert p["host_ram_blocks"] == min(p["blocks"], SPEC.host_blocks)
        assert p["ram_bytes_per_block"] == max(p["disk_ram_bytes_per_block"], p["host_ram_bytes_per_block"])
        assert 0 < p["host_native_bytes_per_block"] < p["host_ram_bytes_per_block"]
        assert p["startup_after_crash_s"] > 0  # the unsealed open, measured before the one after a clean close
    setup = result["setup"]
    assert setup["date"].endswith("Z") and "isa" in setup["machine"]
    assert set(setup["ram_method"]) >= {"ram_bytes_per_block", "router_bytes_per_block"}
    assert list(tmp_path.iterdir()) == []  # each point's tier is removed once measured
    path, _ = scale.save(result, tmp_path / "out")
    assert json.loads(path.read_text())["points"] == result["points"]
    assert "lookup p50/p99" in scale.table(result)


def test_a_filled_tier_opens_with_every_block_and_serves_it_confirmed(tmp_path: Path) -> None:
    """The bench's N blocks are a real tier's: their records open, confirm against the tokens, and read back."""
    scale.fill(tmp_path, 300, 128)
    lay = scale.layout()
    cfg = scale.config(tmp_path, 300, 128)
    hasher = KeyHasher(
        Secret.load_or_create(tmp_path),
        model_fingerprint=scale.FINGERPRINT,
        layout_descriptor=lay.descriptor,
        block_size=scale.BLOCK_SIZE,
    )
    tier = DiskTier(cfg.disk_path, lay, int(cfg.disk.capacity_bytes), model_fingerprint=scale.FINGERPRINT)
    try:
        assert len(tier) == 300 and tier.free_blocks() == 128
        prompt = hasher.keyed(scale.prompt_tokens(2), scale.NAMESPACE)  # blocks 256..299 are prompt 2's first 44
        assert [tier.slot_of(k) for k in prompt.keys[:44]] == list(range(256, 300))
        assert not tier.contains(prompt.keys[44])
        record = tier.record(prompt.keys[3])
        assert record is not None and record.matches(prompt.digests[3]) and record.parent == prompt.keys[2]
        out = torch.ones(lay.block_bytes, dtype=torch.uint8)
        assert tier.get(prompt.keys[3], out) and not out.any()  # a sparse slot: zeros, which pass their checksum
    finally:
        tier.close()


def test_a_sealed_tier_of_a_hundred_thousand_blocks_opens_within_200_bytes_a_block(tmp_path: Path) -> None:
    """Issue 32's RAM target, held at a size where the start-up's freed buffers once doubled it (221 B a block)."""
    blocks, spec = 100_000, scale.ScaleSpec(points=(100_000,), lookups=20, stores=256)
    scale.fill(tmp_path, blocks, spec.stores)
    spec_json = json.dumps({**scale.asdict(spec), "points": list(spec.points)})
    assert scale._child("reopen", str(tmp_path), str(blocks), spec_json)["startup_after_crash_s"] > 0  # seals it
    opened = scale._child("manager", str(tmp_path), str(blocks), spec_json)
    assert opened["disk_ram_bytes_per_block"] <= 200, opened
