"""``engine.kv_dtype: int8``, ``fp8_e4m3`` and ``float16`` under a float32 model, on the real model: greedy
output with the cache is the output without it.

An 8-bit pool rounds a token's KV once, when the engine writes it, and every
token is attended to as the pool holds it, so a block read back from a tier
is the very bytes a recompute writes. Four chat turns cold, in one chunk per
prompt, against cached runs (host and disk, resident blocks or not) cut into
uneven chunks.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from pathlib import Path

import pytest
import redis
import torch

from kvtier.bench.redis_server import RedisServer
from kvtier.config import Config
from kvtier.engine.runtime import LoadedModel, cache_decoded, kv_dtype, make_engine, open_cache
from kvtier.layout import KVLayout
from kvtier.service import CacheService
from tests.engine.test_bf16_reuse import prefill_in_chunks
from tests.engine.test_engine import check_reuse, config, converse
from tests.remote import remote_section

KV8 = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "float16": torch.float16}
BYTES_VS_FP32 = {"int8": 68 / 256, "fp8_e4m3": 68 / 256, "float16": 1 / 2}  # at head_dim 64, scales included


@pytest.fixture(scope="module", params=list(KV8))
def kv8(request: pytest.FixtureRequest) -> str:
    """``engine.kv_dtype``: each setting narrower than the model's float32."""
    return str(request.param)


@pytest.fixture(scope="module")
def kv8_model(loaded_model: LoadedModel, kv8: str) -> LoadedModel:
    """The session's float32 model over a narrower KV pool (the same weights, shared)."""
    model = copy.copy(loaded_model.model)
    model.kv_dtype = KV8[kv8]
    return dataclasses.replace(loaded_model, model=model)


def test_the_setting_resolves_and_binds_the_layout(loaded_model: LoadedModel, tmp_path: Path) -> None:
    cfg = config(tmp_path, kv_dtype="int8")
    assert kv_dtype(cfg) == torch.int8 and not cache_decoded(cfg)  # auto caches decoded KV in float32 KV only
    assert kv_dtype(config(tmp_path, kv_dtype="fp8_e4m3")) == torch.float8_e4m3fn
    assert kv_dtype(config(tmp_path, kv_dtype="float16")) == torch.float16
    assert kv_dtype(config(tmp_path)) == torch.float32 and cache_decoded(config(tmp_path))
    with pytest.raises(ValueError, match="a float32 or bfloat16 KV pool holds the compute dtype"):
        kv_dtype(config(tmp_path, kv_dtype="bfloat16"))
    with open_cache(loaded_model, config(tmp_path / "fp32")) as fp32:
        fp32_root = fp32.hasher.root("default")
    kv8 = dataclasses.replace(loaded_model, model=copy.copy(loaded_model.model))
    kv8.model.kv_dtype = torch.int8
    with open_cache(kv8, config(tmp_path / "int8", kv_dtype="int8")) as int8:
        assert int8.layout.descriptor.endswith(":int8")
        assert int8.hasher.root("default") != fp32_root  # a block of one precision never serves another
        int8_root = int8.hasher.root("default")
    kv8.model.kv_dtype = torch.float8_e4m3fn
    with open_cache(kv8, config(tmp_path / "e4m3", kv_dtype="fp8_e4m3")) as e4m3:
        assert e4m3.layout.descriptor.endswith(":fp8_e4m3:row_scales")
        assert e4m3.hasher.root("default") not in (fp32_root, int8_root)
        e4m3_root = e4m3.hasher.root("default")
    kv8.model.kv_dtype = torch.float16
    with open_cache(kv8, config(tmp_path / "f16", kv_dtype="float16")) as f16:
        assert f16.layout.descriptor.endswith(":float16")
        assert f16.hasher.root("default") not in (fp32_root, int8_root, e4m3_root)


def test_a_prompts_kv_is_the_same_bytes_in_one_forward_or_in_uneven_chunks(kv8_model: LoadedModel) -> None:
    model = kv8_model.model
    ids = kv8_model.chat_ids([{"role": "user", "content": "Name the planets, then the moons of each. " * 20}])[:200]

    one, one_logits = prefill_in_chunks(model, ids, [0, len(ids)])
    cut, cut_logits = prefill_in_chunks(
        model, ids, [0, 37, 130, len(ids)]
    )  # (a one-token chunk is a decode step: other kernels)
    assert torch.equal(one.view(torch.uint8), cut.view(torch.uint8)) and torch.equal(one_logits, cut_logits)


def test_greedy_output_with_the_cache_is_the_output_without_it(
    kv8: str, kv8_model: LoadedModel, tmp_path: Path
) -> None:
    cold_engine = make_engine(kv8_model, config(tmp_path / "cold", kv_dtype=kv8), cache=None, keep_resident=False)
    cold = converse(cold_engine, kv8_model)
    for keep_resident in (False, True):
        cfg = config(tmp_path / str(keep_resident), kv_dtype=kv8, keep_resident=keep_resident, max_step_tokens=48)
        with open_cache(kv8_model, cfg) as cache:
            engine = make_engine(kv8_model, cfg, cache=cache, keep_resident=keep_resident)
            assert engine.pool.layout.dtype == KV8[kv8] and not engine.publisher.cache_decoded
            turns = converse(engine, kv8_model)
            stats = cache.stats()
        check_reuse(turns, cold, replies_cached=False)
        assert stats.tiers["host"].hit_tokens > 0 or keep_resident


def with_sections(cfg: Config, **sections: dict[str, object]) -> Config:
    tree = cfg.model_dump()
    for name, values in sections.items():
        tree[name] = {**tree[name], **values}
    return Config.model_validate(tree)


def test_8bit_blocks_through_the_cache_service_and_redis_give_the_same_output(
    kv8: str, kv8_model: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    """The service's slab and Redis carry the blocks as the pool holds them, in a quarter or half float32's bytes."""
    cold_engine = make_engine(kv8_model, config(tmp_path / "cold", kv_dtype=kv8), cache=None, keep_resident=False)
    cold = converse(cold_engine, kv8_model)
    layout = kv8_model.model.kv_layout(16)
    fp32 = KVLayout(30, 3, 64, 16, torch.float32)
    assert layout.bytes_per_token == fp32.bytes_per_token * BYTES_VS_FP32[kv8]
    sock = tmp_path / "cache.sock"
    service_cfg = config(tmp_path / "service", kv_dtype=kv8)
    svc = CacheService(
        service_cfg, layout, model_fingerprint=kv8_model.fingerprint, socket_path=sock, slab_dir=tmp_path
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    try:
        cfg = with_sections(
            config(tmp_path / "client", kv_dtype=kv8, keep_resident=False), cache={"service": f"unix://{sock}"}
        )
        cache = open_cache(kv8_model, cfg)
        try:
            check_reuse(converse(make_engine(kv8_model, cfg, cache=cache), kv8_model), cold, replies_cached=False)
            assert cache.stats().tiers["host"].hit_tokens > 0  # the service's own tier served them
        finally:
            cache.close()
    finally:
        svc.close()
        thread.join(timeout=30)

    secret = {"secret_file": str(tmp_path / "deployment.secret")}
    remote = remote_section(redis_server.url, timeout_ms=5000)
    writer = with_sections(config(tmp_path / "a", kv_dtype=kv8, keep_resident=False), cache=secret, remote=remote)
    reader = with_sections(
        config(tmp_path / "b", kv_dtype=kv8, keep_resident=False),
        cache=secret,
        remote=remote,
        disk={"enabled": False},
    )
    with open_cache(kv8_model, writer) as a:
        converse(make_engine(kv8_model, writer, cache=a), kv8_model)
        assert a.remote is not None and a.remote.flush(120)
    client = redis.Redis(port=redis_server.port)
    stored = client.dbsize()
    sizes = {client.strlen(name) for name in client.scan_iter(count=1000)}
    assert all(layout.block_bytes <= n < layout.block_bytes + 512 for n in sizes)  # the payload and its frame
    with open_cache(kv8_model, reader) as b:
        turns = converse(make_engine(kv8_model, reader, cache=b), kv8_model)
        served = b.stats().tiers["remote"].hit_tokens
    assert [out for _, out, _ in turns] == [out for _, out, _ in cold]
    assert stored > 0 and served > 0
