"""Key completeness: change anything that changes the KV (model, dtype, layout, block size, namespace) and nothing hits.

The root of every key chain binds all five (:meth:`kvtier.keys.KeyHasher.root`).
Each tier is checked twice: its own index probed with the changed identity's
keys (0 records, not even a confirm mismatch: the keys differ), and the way a
changed identity really meets the tier (a second node on the shared Redis, a
restart over the same disk directory, a client of the cache service).
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvtier.config import WriteMode
from kvtier.errors import KVTierError
from kvtier.index import longest_prefix
from kvtier.keys import KeyHasher, Secret
from kvtier.layout import KVLayout, LayoutOrder
from kvtier.manager import CacheManager
from kvtier.service import CacheClient, CacheService, ServiceUnavailable
from kvtier.tiers.base import Tier, TierKind
from tests.helpers import BLOCK, make_config, payload, prompt, toy_layout
from tests.remote import remote_section

FINGERPRINT = "toy-model"
NAMESPACE = "default"
BLOCKS = 6


class Change(enum.Enum):
    MODEL = "model fingerprint"
    DTYPE = "dtype"
    LAYOUT = "layout"
    BLOCK_SIZE = "block size"
    NAMESPACE = "namespace"


@dataclass(frozen=True)
class Identity:
    fingerprint: str
    layout: KVLayout
    namespace: str


BASE = Identity(FINGERPRINT, toy_layout(), NAMESPACE)
CHANGED = {
    Change.MODEL: Identity("another-model", toy_layout(), NAMESPACE),
    Change.DTYPE: Identity(FINGERPRINT, toy_layout(torch.bfloat16), NAMESPACE),
    Change.LAYOUT: Identity(
        FINGERPRINT,
        KVLayout(
            num_layers=3,
            num_kv_heads=2,
            head_dim=8,
            block_size=BLOCK,
            dtype=torch.float32,
            order=LayoutOrder.HEAD_MAJOR,
        ),
        NAMESPACE,
    ),
    Change.BLOCK_SIZE: Identity(FINGERPRINT, toy_layout(block_size=2 * BLOCK), NAMESPACE),
    Change.NAMESPACE: Identity(FINGERPRINT, toy_layout(), "tenant/other"),
}
TOKENS = prompt(BLOCKS * BLOCK + 1, seed=5)


def hasher(secret: Secret, who: Identity) -> KeyHasher:
    return KeyHasher(
        secret,
        model_fingerprint=who.fingerprint,
        layout_descriptor=who.layout.descriptor,
        block_size=who.layout.block_size,
    )


def node(tmp: Path, who: Identity, redis_url: str, **disk: object) -> CacheManager:
    """A node of the deployment (its own data dir, the shared secret file and Redis) serving ``who``'s model."""
    cfg = make_config(
        tmp,
        host={"capacity_bytes": 16 * 4096},
        disk={"capacity_bytes": 32 * 4096, **disk},
        cache={
            "write_mode": WriteMode.WRITE_THROUGH,
            "block_size": who.layout.block_size,
            "secret_file": str(tmp.parent / "deployment.secret"),
        },
        remote=remote_section(redis_url),
    )
    return CacheManager(cfg, who.layout, model_fingerprint=who.fingerprint)


def stored(m: CacheManager) -> None:
    assert m.store(m.keyed(TOKENS, NAMESPACE), [payload(BASE.layout, i) for i in range(BLOCKS)]) == BLOCKS
    assert m.remote is not None and m.remote.flush()


def hits_in(tier: Tier, m: CacheManager, who: Identity) -> int:
    """Blocks of ``TOKENS`` that ``tier`` holds under ``who``'s keys (confirmed or not)."""
    keys = hasher(m.hasher.secret, who).keys(TOKENS, who.namespace)
    if tier.kind is TierKind.REMOTE:
        tier.probe_run(keys)  # type: ignore[attr-defined]
    held = sum(tier.record(k) is not None for k in keys)
    run = longest_prefix(keys, hasher(m.hasher.secret, who).digests(keys, TOKENS), [tier])
    return held + len(run.tiers)


@pytest.mark.parametrize("change", list(Change))
def test_a_changed_identity_finds_nothing_in_any_tier_index(tmp_path: Path, redis_server, change: Change) -> None:
    with node(tmp_path / "a", BASE, redis_server.url) as a:
        stored(a)
        tiers = [a.host, a.disk, a.remote]
        assert [hits_in(t, a, BASE) for t in tiers] == [2 * BLOCKS] * 3  # the control: the base identity hits
        assert [hits_in(t, a, CHANGED[change]) for t in tiers] == [0, 0, 0]


@pytest.mark.parametrize("change", list(Change))
def test_a_node_serving_a_changed_identity_gets_no_remote_hit(tmp_path: Path, redis_server, change: Change) -> None:
    who = CHANGED[change]
    with node(tmp_path / "a", BASE, redis_server.url) as a, node(tmp_path / "b", who, redis_server.url) as b:
        stored(a)
        assert b.lookup(b.keyed(TOKENS, who.namespace)).cached_blocks == 0
        assert b.stats().tiers["remote"].hit_tokens == 0


@pytest.mark.parametrize("change", [c for c in Change if c is not Change.NAMESPACE])
def test_a_restart_with_a_changed_identity_never_reads_the_old_disk(
    tmp_path: Path, redis_server, change: Change
) -> None:
    """Over the same disk directory: refused by default (``disk.on_mismatch: error``), wiped with ``wipe``."""
    who = CHANGED[change]
    with node(tmp_path / "a", BASE, redis_server.url) as a:
        stored(a)
    redis_server.restart()  # empty: only the disk could answer now
    with pytest.raises(KVTierError):
        node(tmp_path / "a", who, redis_server.url)
    with node(tmp_path / "a", who, redis_server.url, on_mismatch="wipe") as b:
        assert b.lookup(b.keyed(TOKENS, who.namespace)).cached_blocks == 0
        assert b.disk is not None and len(b.disk) == 0


@pytest.mark.parametrize("change", list(Change))
def test_the_cache_service_serves_a_changed_identity_nothing(tmp_path: Path, change: Change) -> None:
    """A client of another model, dtype, layout or block size is refused at the handshake; another namespace misses."""
    cfg = make_config(tmp_path, host={"capacity_bytes": 16 * 4096}, disk={"capacity_bytes": 32 * 4096})
    svc = CacheService(
        cfg, BASE.layout, model_fingerprint=FINGERPRINT, socket_path=tmp_path / "s.sock", slab_dir=tmp_path
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    who = CHANGED[change]
    try:
        with CacheClient(svc.socket_path, BASE.layout, model_fingerprint=FINGERPRINT) as c:
            assert c.store(TOKENS, [payload(BASE.layout, i) for i in range(BLOCKS)], NAMESPACE) == BLOCKS
            assert c.lookup(TOKENS, NAMESPACE).cached_blocks == BLOCKS
        if change is Change.NAMESPACE:
            with CacheClient(svc.socket_path, BASE.layout, model_fingerprint=FINGERPRINT) as c:
                assert c.lookup(TOKENS, who.namespace).cached_blocks == 0
                with c.load(TOKENS, who.namespace) as load:
                    assert load.blocks == []
        else:
            with pytest.raises(ServiceUnavailable):
                CacheClient(svc.socket_path, who.layout, model_fingerprint=who.fingerprint)
        assert svc.manager.stats().tiers["host"].hit_tokens == BLOCKS * BLOCK  # the control lookup only
    finally:
        svc.close()
        thread.join(timeout=30)
