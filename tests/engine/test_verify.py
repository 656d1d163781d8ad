"""Shadow verification on the real model: honest hits match their recompute, and every corrupted block is caught.

The corruption is done where no checksum sees it: in the host tier's slots,
after the blocks were stored (the disk tier would turn flipped bytes into a
checksum failure, a miss, before anything is served).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvtier.engine.engine import Engine
from kvtier.engine.runtime import LoadedModel, make_engine, open_cache
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.verify import Verdict
from kvtier.keys import BlockKey
from kvtier.manager import CacheManager
from kvtier.tiers.base import TierKind
from kvtier.tiers.host import HostTier
from tests.helpers import BLOCK, make_config, prompt

PARAMS = SamplingParams(max_tokens=2)


def _config(tmp: Path, **verify: object):
    return make_config(
        tmp,
        engine={"keep_resident": False, "pool_bytes": 128 * 46080 * BLOCK},  # every repeat is served by kvtier
        cache={"write_mode": "write_through"},
        host={"capacity_bytes": 64 * 1024**2},
        disk={"enabled": False},
        verify={"shadow_fraction": 1.0, **verify},
    )


def corrupt(host: HostTier, keys: list[BlockKey]) -> None:
    """The test hook: flip bit 6 of the first 64 bytes of each block's slot (exponent bits in float32 and bf16)."""
    for key in keys:
        view = host.view(key)
        assert view is not None
        view[:64] ^= 0x40


def _serve(engine: Engine, ids: list[int]) -> dict[TierKind, int]:
    (done,) = engine.generate([ids], PARAMS)
    engine.drain_stores()
    return done.served_from


@pytest.fixture
def setup(loaded_model: LoadedModel, tmp_path: Path):
    cfg = _config(tmp_path)
    with open_cache(loaded_model, cfg) as cache:
        assert isinstance(cache, CacheManager)
        yield make_engine(loaded_model, cfg, cache=cache), cache


def test_an_honest_hit_matches_its_recompute(setup) -> None:
    engine, _ = setup
    ids = prompt(61, seed=1).tolist()
    _serve(engine, ids)
    assert _serve(engine, ids) == {TierKind.HOST: 60}
    verdicts = engine.verifier.drain()
    assert [v.verdict for v in verdicts] == [Verdict.MATCH] * 15
    c = engine.verifier.counters
    assert (c.sampled, c.verified, c.blocks_verified, c.mismatched_blocks, c.dropped) == (1, 1, 15, 0, 0)


def test_every_corrupted_block_is_caught_and_logged_by_key(setup, caplog: pytest.LogCaptureFixture) -> None:
    engine, cache = setup
    ids = prompt(61, seed=2).tolist()
    _serve(engine, ids)
    keys = cache.hasher.keys(ids, engine.namespace)
    bad = [1, 6, 7, 14]
    corrupt(cache.host, [keys[i] for i in bad])
    assert _serve(engine, ids) == {TierKind.HOST: 60}  # served: no checksum in host memory
    with caplog.at_level(logging.WARNING, logger="kvtier.engine.verify"):
        verdicts = engine.verifier.drain()
    assert [v.block for v in verdicts if v.verdict is Verdict.MISMATCH] == bad
    c = engine.verifier.counters
    assert (c.verified, c.mismatched_hits, c.mismatched_blocks) == (1, 1, len(bad))
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert all(keys[i].hex() in logged for i in bad)
    assert all(str(t) not in logged for t in ids[:8])  # the key and position, never the tokens


def test_a_fraction_samples_every_nth_hit_and_a_full_queue_drops(loaded_model: LoadedModel, tmp_path: Path) -> None:
    cfg = _config(tmp_path, shadow_fraction=0.5, queue_size=1)
    with open_cache(loaded_model, cfg) as cache:
        engine = make_engine(loaded_model, cfg, cache=cache)
        ids = prompt(33, seed=3).tolist()
        for _ in range(5):  # the first computes; four hits, every second one sampled: two, one queued, one dropped
            _serve(engine, ids)
        c = engine.verifier.counters
        assert (c.sampled, c.dropped) == (1, 1)
        engine.verifier.drain()
        assert (c.verified, c.mismatched_blocks) == (1, 0)
