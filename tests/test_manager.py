from __future__ import annotations

import gc
import logging
import os
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.config import WriteMode
from kvtier.events import HeldKeys
from kvtier.index import MissReason
from kvtier.manager import CacheManager
from kvtier.policy import PolicyName, make_policy, registered
from kvtier.policy.lru import LRUPolicy
from kvtier.tiers.base import TierKind
from kvtier.transfer import JobStatus
from tests.helpers import BLOCK, as_bytes, make_config, make_hasher, payload, prompt, read_only, toy_layout

H, D = TierKind.HOST, TierKind.DISK


def manager(tmp: Path, host_blocks: int = 8, disk_blocks: int = 16, **kw) -> CacheManager:
    cache = {"write_mode": kw.pop("write_mode", WriteMode.WRITE_BACK)}
    cfg = make_config(
        tmp,
        host={"capacity_bytes": host_blocks * 4096, **kw.pop("host", {})},
        disk={"capacity_bytes": disk_blocks * 4096, **kw.pop("disk", {})},
        cache=cache,
    )
    layout = kw.pop("layout", toy_layout())
    return CacheManager(cfg, layout, model_fingerprint="toy-model", **kw)


def kv(n_blocks: int, seed: int, layout=None) -> list[torch.Tensor]:
    layout = layout or toy_layout()
    return [payload(layout, seed * 1000 + i) for i in range(n_blocks)]


def loaded_bytes(m: CacheManager, tokens: np.ndarray) -> list[torch.Tensor]:
    with m.load(m.lookup(m.keyed(tokens))) as handle:
        return [b.clone() for b in handle.blocks]


def test_store_then_lookup_and_load_round_trip(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        tokens = prompt(5 * BLOCK + 3)
        blocks = kv(5, seed=1)
        assert m.lookup(m.keyed(tokens)).cached_tokens == 0
        assert m.store(m.keyed(tokens), blocks) == 5
        result = m.lookup(m.keyed(tokens))
        assert (result.cached_tokens, result.tiers, result.miss_reason) == (20, (H,) * 5, MissReason.NONE)
        got = loaded_bytes(m, tokens)
        assert all(torch.equal(g, as_bytes(b)) for g, b in zip(got, blocks, strict=True))
        longer = np.concatenate([tokens[:12], prompt(9, seed=7)])
        partial = m.lookup(m.keyed(longer))
        assert (partial.cached_tokens, partial.miss_reason, partial.first_miss_block) == (12, MissReason.ABSENT, 3)
        assert m.lookup(m.keyed(tokens, "other-tenant")).cached_tokens == 0
        stats = m.stats().tiers["host"]
        assert stats.hit_tokens == 20 + 20 + 12 and stats.blocks == 5


def test_write_back_demotes_lru_victims_to_disk(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=3) as m:
        tokens = prompt(5 * BLOCK)
        blocks = kv(5, seed=2)
        assert m.store(m.keyed(tokens), blocks) == 5
        assert m.lookup(m.keyed(tokens)).tiers == (D, D, H, H, H)
        assert m.stats().tiers["host"].evictions == 2 and m.stats().tiers["host"].demotions == 2
        # Loading promotes 0 and 1 (evicting and demoting 2, 3), then 2 back (evicting 4);
        # block 3 finds every host slot pinned by this load, so the load stops there.
        handle = m.load(m.lookup(m.keyed(tokens)))
        assert handle.served_from == [D, D, D]
        assert all(torch.equal(g, as_bytes(b)) for g, b in zip(handle.blocks, blocks, strict=False))
        m.complete_load(handle)
        assert m.lookup(m.keyed(tokens)).tiers == (H, H, H, D, D)


def test_load_stops_at_first_block_it_cannot_place(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=2) as m:
        tokens = prompt(4 * BLOCK)
        m.store(m.keyed(tokens), kv(4, seed=3))
        assert m.lookup(m.keyed(tokens)).tiers == (D, D, H, H)
        handle = m.load(m.lookup(m.keyed(tokens)))
        # both host slots end up pinned by this load (0 and 1 promoted); 2 and 3 cannot be placed
        assert handle.served_from == [D, D] and handle.num_tokens == 2 * BLOCK
        assert m.lookup(m.keyed(tokens)).tiers == (H, H, D, D)
        m.complete_load(handle)
        assert m.pinned(handle.keys[0]) == 0


def test_write_through_stores_to_disk_at_once_and_survives_restart(tmp_path: Path) -> None:
    tokens = prompt(6 * BLOCK)
    blocks = kv(6, seed=4)
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        m.store(m.keyed(tokens), blocks)
        assert len(m.disk) == 6
    with manager(tmp_path) as m:  # a new manager over the same data_dir: host is empty
        result = m.lookup(m.keyed(tokens))
        assert result.tiers == (D,) * 6
        got = loaded_bytes(m, tokens)
        assert all(torch.equal(g, as_bytes(b)) for g, b in zip(got, blocks, strict=True))
        assert m.lookup(m.keyed(tokens)).tiers == (H,) * 6


def test_pinned_blocks_are_never_evicted(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=2, disk={"enabled": False}) as m:
        a, b = prompt(2 * BLOCK, seed=1), prompt(2 * BLOCK, seed=2)
        m.store(m.keyed(a), kv(2, seed=5))
        handle = m.load(m.lookup(m.keyed(a)))
        assert m.store(m.keyed(b), kv(2, seed=6)) == 0  # no room: both slots are pinned
        assert m.lookup(m.keyed(a)).cached_tokens == 2 * BLOCK
        m.complete_load(handle)
        assert m.store(m.keyed(b), kv(2, seed=6)) == 2
        assert m.lookup(m.keyed(a)).cached_tokens == 0 and m.lookup(m.keyed(b)).cached_tokens == 2 * BLOCK


def test_failed_store_is_never_indexed(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        tokens = prompt(3 * BLOCK)
        plan = m.prepare_store(m.keyed(tokens))
        assert len(plan.buffers) == 3 and m.lookup(m.keyed(tokens)).cached_tokens == 0
        for buf, block in zip(plan.buffers, kv(3, seed=7), strict=True):
            buf.copy_(as_bytes(block))
        assert m.complete_store(plan, success=False) == 0
        assert m.lookup(m.keyed(tokens)).cached_tokens == 0
        assert m.host.free_blocks() == m.host.capacity_blocks
        with pytest.raises(RuntimeError, match="twice"):
            m.complete_store(plan, success=True)


def test_async_store_reports_by_job_id(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        tokens = prompt(4 * BLOCK)
        job = m.worker.submit(lambda: m.store(m.keyed(tokens), kv(4, seed=8)))
        assert m.wait(job) == 4
        wrong = m.keyed(prompt(4 * BLOCK, seed=99))
        bad = m.worker.submit(lambda: m.store(wrong, [torch.zeros(3)] * 4))  # wrong payload size: the job fails
        m.worker.drain()
        assert m.poll(bad) is JobStatus.FAILED
        with pytest.raises(ValueError, match="layout wants"):
            m.wait(bad)
        assert m.lookup(m.keyed(tokens)).cached_tokens == 4 * BLOCK


def test_only_new_blocks_are_stored(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        turn1 = prompt(3 * BLOCK + 1)
        m.store(m.keyed(turn1), kv(3, seed=9))
        turn2 = np.concatenate([turn1, prompt(2 * BLOCK, seed=11)])
        plan = m.prepare_store(m.keyed(turn2))
        assert plan.already_cached == 3 and plan.block_indices == [3, 4]
        m.complete_store(plan, success=False)
        assert m.store(m.keyed(turn2), kv(2, seed=10), first_block=3) == 2
        assert m.lookup(m.keyed(turn2)).cached_tokens == 5 * BLOCK


def test_forced_collision_never_serves_foreign_bytes(tmp_path: Path) -> None:
    layout = toy_layout()
    colliding = make_hasher(tmp_path, layout, hash128=lambda data, seed: b"\x00" * 16)
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH, hasher=colliding) as m:
        a, b = prompt(BLOCK, seed=1), prompt(BLOCK, seed=2)
        assert m.keys(a) == m.keys(b)  # the hook made every key the same
        a_kv, b_kv = kv(1, seed=12), kv(1, seed=13)
        m.store(m.keyed(a), a_kv)
        miss = m.lookup(m.keyed(b))
        assert (miss.cached_tokens, miss.miss_reason) == (0, MissReason.CONFIRM_MISMATCH)
        assert m.stats().tiers["host"].confirm_mismatches == 1
        assert m.store(m.keyed(b), b_kv) == 0  # refused: the key holds a's tokens
        m.clear(TierKind.HOST)  # a now lives on disk only: the disk tier must confirm too
        assert m.lookup(m.keyed(b)).miss_reason is MissReason.CONFIRM_MISMATCH
        assert m.stats().tiers["disk"].confirm_mismatches == 1
        assert m.lookup(m.keyed(a)).tiers == (D,)
        assert torch.equal(loaded_bytes(m, a)[0], as_bytes(a_kv[0]))


def test_concurrent_readers_and_writer_keep_pins_sound(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=6, disk_blocks=64) as m:
        prompts = [prompt(3 * BLOCK, seed=s) for s in range(6)]
        blocks = {s: kv(3, seed=100 + s) for s in range(6)}
        errors: list[BaseException] = []
        stop = threading.Event()

        def reader(seed: int) -> None:
            try:
                for _ in range(150):
                    s = (seed * 7 + _) % 6
                    with m.load(m.lookup(m.keyed(prompts[s]))) as handle:
                        for i, view in enumerate(handle.blocks):
                            assert m.pinned(handle.keys[i]) > 0
                            assert torch.equal(view, as_bytes(blocks[s][i])), "a pinned slot changed under a reader"
            except BaseException as err:  # surfaced below; a thread cannot fail the test itself
                errors.append(err)

        def writer() -> None:
            try:
                while not stop.is_set():
                    for s in range(6):
                        m.store(m.keyed(prompts[s]), blocks[s])
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=reader, args=(r,)) for r in range(3)]
        w = threading.Thread(target=writer)
        w.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        w.join()
        assert errors == []
        assert m.stats().pinned_blocks == 0
        assert len(m.host) <= 6 and m.host.used_bytes <= m.host.capacity_bytes
        assert m.stats().tiers["host"].evictions > 0


@pytest.mark.parametrize("policy", registered())
def test_host_eviction_under_pressure_follows_the_policy_exactly(tmp_path: Path, policy: PolicyName) -> None:
    """The manager evicts exactly the victims a twin policy, fed the same events, predicts."""
    with manager(tmp_path, host_blocks=4, host={"policy": policy}, disk={"enabled": False}) as m:
        twin = make_policy(policy)
        prompts = [prompt(BLOCK, seed=s) for s in range(10)]
        resident: list = []
        for step, s in enumerate([0, 1, 2, 3, 1, 1, 4, 2, 5, 6, 1, 7, 8, 3, 9]):
            key = m.keys(prompts[s])[0]
            if key in resident:
                assert m.lookup(m.keyed(prompts[s])).cached_tokens == BLOCK
                twin.on_access(key)
                continue
            if len(resident) == 4:
                (victim,) = twin.victims(1)
                twin.on_remove(victim)
                resident.remove(victim)
            assert m.store(m.keyed(prompts[s]), kv(1, seed=s)) == 1, f"step {step}"
            twin.on_insert(key, None)
            resident.append(key)
            assert sorted(k for k, _ in m.host.entries()) == sorted(resident), f"step {step}"
            assert m.host.used_bytes <= m.host.capacity_bytes


def test_write_back_blocks_survive_a_clean_shutdown(tmp_path: Path) -> None:
    tokens = prompt(3 * BLOCK)
    blocks = kv(3, seed=21)
    with manager(tmp_path) as m:
        m.store(m.keyed(tokens), blocks)
        assert len(m.disk) == 0  # write-back: host only, until evicted or flushed
    with manager(tmp_path) as m:  # close() flushed host to disk
        assert m.lookup(m.keyed(tokens)).tiers == (D, D, D)
        assert all(torch.equal(g, as_bytes(b)) for g, b in zip(loaded_bytes(m, tokens), blocks, strict=True))


def test_disk_io_mode_comes_from_the_config(tmp_path: Path) -> None:
    from kvtier.tiers.disk import IOMode

    with manager(tmp_path / "a") as m:
        assert m.disk.io_mode is IOMode.BUFFERED  # the measured default
    with manager(tmp_path / "b", disk={"io": "auto"}) as m:
        assert m.disk.io_mode in (IOMode.DIRECT, IOMode.BUFFERED)  # whatever the filesystem allows


def test_no_token_ids_reach_the_data_directory(tmp_path: Path) -> None:
    """The disk index keeps a keyed digest of each block's tokens; hits are still confirmed after a restart."""
    tokens = prompt(6 * BLOCK, seed=31)
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        assert m.store(m.keyed(tokens), kv(6, seed=31)) == 6
    files = [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
    assert {"data.mdb", "slab-0000.bin"} <= {p.name for p in files}
    runs = [block.astype("<i4").tobytes() for block in tokens.reshape(6, BLOCK)]
    runs.append(tokens[BLOCK // 2 : BLOCK // 2 + BLOCK].astype("<i4").tobytes())  # across a block boundary too
    for path in files:
        data = path.read_bytes()
        assert not [run for run in runs if run in data], f"token ids in {path}"
    with manager(tmp_path) as m:
        assert m.lookup(m.keyed(tokens)).tiers == (D,) * 6  # confirmed against the digests alone
        other = tokens.copy()
        other[5 * BLOCK] += 1
        assert m.lookup(m.keyed(other)).cached_tokens == 5 * BLOCK


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_the_data_directory_is_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
            m.store(m.keyed(prompt(2 * BLOCK)), kv(2, seed=32))
    finally:
        os.umask(old)
    data = tmp_path / "data"
    found = {str(p.relative_to(data)): stat.S_IMODE(p.stat().st_mode) for p in (data, *data.rglob("*"))}
    assert {"secret", "disk/index.lmdb/data.mdb", "disk/slab-0000.bin"} <= set(found)
    assert found == {name: 0o700 if (data / name).is_dir() else 0o600 for name in found}


def test_files_loosened_since_are_tightened_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """What ``kvtier serve`` and ``kvtier cache serve`` do at start: fingerprint the model, then open the cache."""
    from kvtier import errors
    from kvtier.model import file_sha256

    weights, data = tmp_path / "weights.bin", tmp_path / "data"
    weights.write_bytes(b"kvtier" * 100)
    file_sha256(weights, data)
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        m.store(m.keyed(prompt(2 * BLOCK)), kv(2, seed=35))
    for path in (data, *data.rglob("*")):
        path.chmod(0o777 if path.is_dir() else 0o666)
    monkeypatch.setattr(errors, "_seen", set())
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        file_sha256(weights, data)
        manager(tmp_path).close()
    found = {str(p.relative_to(data)): stat.S_IMODE(p.stat().st_mode) for p in (data, *data.rglob("*"))}
    assert {"secret", "model_fingerprints.json", "disk/index.lmdb/data.mdb", "disk/slab-0000.bin"} <= set(found)
    assert found == {name: 0o700 if (data / name).is_dir() else 0o600 for name in found}
    assert len([r for r in caplog.records if "tightened" in r.getMessage()]) == 1


def test_a_read_only_data_directory_runs_on_host_memory_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tokens = prompt(3 * BLOCK)
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        m.store(m.keyed(tokens), kv(3, seed=33))
        keys = m.keys(tokens)
    with read_only(tmp_path / "data"), caplog.at_level(logging.WARNING, logger="kvtier"), manager(tmp_path) as m:
        assert m.disk is None and [t.kind for t in m.tiers] == [H]
        assert m.keys(tokens) == keys  # the secret could still be read
        assert m.lookup(m.keyed(tokens)).cached_tokens == 0
        assert m.store(m.keyed(tokens), kv(3, seed=33)) == 3 and m.lookup(m.keyed(tokens)).tiers == (H,) * 3
        assert "disk" not in m.stats().tiers
    said = [r.getMessage() for r in caplog.records if "without the disk tier" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path / "data" / "disk") in said[0]


def test_an_empty_read_only_data_directory_gets_a_process_local_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvtier import errors

    monkeypatch.setattr(errors, "_seen", set())
    (tmp_path / "data").mkdir(mode=0o700)
    with read_only(tmp_path / "data"), caplog.at_level(logging.WARNING, logger="kvtier"), manager(tmp_path) as m:
        assert m.disk is None and not m.hasher._secret.persistent
        tokens = prompt(2 * BLOCK)
        assert m.store(m.keyed(tokens), kv(2, seed=34)) == 2 and m.lookup(m.keyed(tokens)).cached_tokens == 2 * BLOCK
    assert sum("process-local" in r.getMessage() for r in caplog.records) == 1
    assert not list((tmp_path / "data").iterdir())


def test_a_second_manager_on_one_data_directory_is_refused(tmp_path: Path) -> None:
    from kvtier.errors import DiskLockedError

    with manager(tmp_path), pytest.raises(DiskLockedError, match=f"pid {os.getpid()}"):
        manager(tmp_path)  # not "unavailable": running without disk would hide a misconfiguration
    with manager(tmp_path) as m:
        assert m.disk is not None


def test_disk_hits_count_blocks_read_and_verified(tmp_path: Path) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        tokens = prompt(4 * BLOCK)
        m.store(m.keyed(tokens), kv(4, seed=35))
        m.clear(TierKind.HOST)
        result = m.lookup(m.keyed(tokens))
        assert result.tiers == (D,) * 4
        assert (m.stats().tiers["disk"].hit_tokens, m.stats().tiers["disk"].miss_tokens) == (0, 0)  # index hits only
        path, offset = m.disk.slab_path(m.disk.slot_of(result.keys[2]))
        with open(path, "r+b") as f:
            f.seek(offset + 5)
            byte = f.read(1)
            f.seek(offset + 5)
            f.write(bytes([byte[0] ^ 1]))
        with m.load(result) as handle:
            assert handle.served_from == [D, D]  # block 2 fails its checksum: the load stops there
        disk = m.stats().tiers["disk"]
        assert (disk.hit_tokens, disk.miss_tokens, disk.checksum_failures) == (2 * BLOCK, BLOCK, 1)
        assert m.lookup(m.keyed(tokens)).tiers == (H, H)  # block 3 is on disk, but after the gap
        assert m.stats().tiers["host"].hit_tokens == 2 * BLOCK  # host hits still count at lookup


def test_a_quarantined_disk_tier_shows_in_the_stats(tmp_path: Path) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        m.store(m.keyed(prompt(2 * BLOCK)), kv(2, seed=36))
    data = tmp_path / "data" / "disk" / "index.lmdb" / "data.mdb"
    with open(data, "r+b") as f:
        f.write(bytes(2 * os.sysconf("SC_PAGE_SIZE")))  # both meta pages
    with manager(tmp_path) as m:
        assert m.stats().tiers["disk"].quarantined == 1 and m.stats().tiers["disk"].blocks == 0


# -- named blocks ----------------------------------------------------------------------------------
NS = "default"


def names(n: int, tag: str = "obj") -> list[bytes]:
    return [f"{tag}/{i}".encode() for i in range(n)]


def filler(blocks: list[torch.Tensor], calls: list[int] | None = None):
    def fill(i: int, out: torch.Tensor) -> None:
        if calls is not None:
            calls.append(i)
        out.copy_(as_bytes(blocks[i]))

    return fill


def test_named_blocks_round_trip_and_a_held_name_is_not_written_again(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        data = kv(3, seed=40)
        assert m.named_exists(names(3), NS) == [False] * 3
        assert m.named_store_from(names(3), filler(data), NS) == 3
        calls: list[int] = []
        assert m.named_store_from([*names(3), b"obj/new"], filler([*data, data[0]], calls), NS) == 1
        assert calls == [3]  # only the absent name was reserved and filled
        assert m.named_exists([b"obj/1", b"missing", b"obj/new"], NS) == [True, False, True]
        assert m.named_exists(names(3), "other-tenant") == [False] * 3  # the namespace is in the key
        with m.named_load(names(3), NS) as handle:
            assert [torch.equal(b, as_bytes(d)) for b, d in zip(handle.blocks, data, strict=True)] == [True] * 3
            assert handle.served_from == [H] * 3 and m.stats().pinned_blocks == 3
        assert m.stats().pinned_blocks == 0
        assert m.lookup(m.keyed(prompt(3 * BLOCK))).cached_blocks == 0  # named blocks are no token chain's


def test_a_named_load_stops_at_the_first_absent_name(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        data = kv(4, seed=41)
        m.named_store_from(names(4), filler(data), NS)
        with m.named_load([b"obj/0", b"obj/1", b"gone", b"obj/3"], NS) as handle:
            assert len(handle.blocks) == 2 and torch.equal(handle.blocks[1], as_bytes(data[1]))
        assert m.named_load([b"gone", *names(4)], NS).blocks == []


def test_named_blocks_larger_than_host_land_whole_and_load_back_from_disk(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=4, disk_blocks=16) as m:
        data = kv(10, seed=42)
        assert m.named_store_from(names(10), filler(data), NS) == 10
        assert m.named_exists(names(10), NS) == [True] * 10
        with m.named_load(names(10)[:3], NS) as handle:  # demoted to disk by the later ones
            assert handle.served_from == [D, D, D]
            assert all(torch.equal(b, as_bytes(d)) for b, d in zip(handle.blocks, data[:3], strict=True))


def test_named_blocks_survive_a_restart(tmp_path: Path) -> None:
    data = kv(3, seed=43)
    with manager(tmp_path) as m:  # write-back: the clean shutdown flushes them to disk
        m.named_store_from(names(3), filler(data), NS)
    with manager(tmp_path) as m:
        assert m.named_exists(names(3), NS) == [True] * 3
        with m.named_load(names(3), NS) as handle:
            assert handle.served_from == [D] * 3
            assert all(torch.equal(b, as_bytes(d)) for b, d in zip(handle.blocks, data, strict=True))


def test_a_named_block_corrupted_on_disk_is_a_counted_miss_never_wrong_bytes(tmp_path: Path) -> None:
    with manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH) as m:
        data = kv(3, seed=44)
        m.named_store_from(names(3), filler(data), NS)
        m.clear(TierKind.HOST)
        held = HeldKeys()
        m.observe(held)
        damaged = m.hasher.named(b"obj/1", NS)
        assert damaged in held.snapshot()[D]
        path, offset = m.disk.slab_path(m.disk.slot_of(m.hasher.named(b"obj/1", NS)))
        with open(path, "r+b") as f:
            f.seek(offset + 9)
            byte = f.read(1)
            f.seek(offset + 9)
            f.write(bytes([byte[0] ^ 1]))
        with m.named_load(names(3), NS) as handle:
            assert handle.served_from == [D]  # obj/1 fails its checksum: the load stops there
            assert torch.equal(handle.blocks[0], as_bytes(data[0]))
        assert m.stats().tiers["disk"].checksum_failures == 1
        assert m.named_exists(names(3), NS) == [True, False, True]  # the damaged record is dropped
        assert damaged not in held.snapshot()[D]  # and a router following the events hears it left
        assert len(held.snapshot()[D]) == 2


def test_a_keyed_prompt_is_never_hashed_again_on_its_way(tmp_path: Path) -> None:
    with manager(tmp_path, host_blocks=2, disk_blocks=16) as m:
        tokens = prompt(6 * BLOCK, seed=4)
        p = m.keyed(tokens)
        calls = []
        keys = m.hasher.keys
        m.hasher.keys = lambda *a, **kw: calls.append(a) or keys(*a, **kw)  # type: ignore[method-assign]
        assert m.store(p, kv(6, seed=4)) == 6  # host holds two: four go down to disk
        result = m.lookup(p)
        with m.load(result) as handle:  # disk blocks promoted, every one confirmed by its digest
            assert [b.tolist() for b in handle.blocks] == [as_bytes(b).tolist() for b in kv(2, seed=4)]
        assert m.probe(p).cached_tokens == 6 * BLOCK and m.pin_for(p, 10.0) == len(p.keys)
        assert calls == [], "lookup, load, store, probe and pin hashed the prompt again"


def test_keys_of_another_hasher_are_refused_not_missed(tmp_path: Path) -> None:
    with manager(tmp_path) as m:
        foreign = make_hasher(tmp_path / "elsewhere", toy_layout()).keyed(prompt(2 * BLOCK), "default")
        with pytest.raises(ValueError, match="another hasher"):
            m.lookup(foreign)
        with pytest.raises(ValueError, match="another hasher"):
            m.store(foreign, kv(2, seed=1))


def test_a_namespaces_clear_drops_its_chains_in_every_local_tier_and_nothing_else(tmp_path: Path) -> None:
    """Block 0's record names the namespace's root, so a tenant's blocks are the trees hanging from it: found
    through any local tier (a disk block whose parent is in host memory), and no other tenant's is touched,
    even where the two share token ids."""
    with manager(tmp_path, host_blocks=4, disk_blocks=32) as m:
        shared = prompt(3 * BLOCK, seed=5)
        theirs = m.keyed(shared, "else")
        chains = {}
        for name in ("acme", "beta"):
            m.store(m.keyed(shared, name), kv(3, seed=1))
            chains[name] = m.keyed(np.concatenate([shared, prompt(2 * BLOCK, seed=6)]), name)
            m.store(chains[name], [*kv(3, seed=1), *kv(2, seed=3)])
        m.store(theirs, kv(3, seed=2))
        for name, chain in chains.items():
            assert m.eviction.descendants(m.hasher.root(name)) == set(chain.keys)
        assert {t for name in chains for t in m.lookup(chains[name]).tiers} == {H, D}  # chains span both tiers

        on_disk = [k for k in chains["acme"].keys if m.disk.contains(k)]
        assert on_disk and m.clear(D, "acme") == len(on_disk)
        assert not any(m.disk.contains(k) for k in chains["acme"].keys)

        copies = sum(m.host.contains(k) + m.disk.contains(k) for k in chains["beta"].keys)
        assert copies >= len(chains["beta"].keys) and m.clear(None, "beta") == copies
        assert not any(m.host.contains(k) or m.disk.contains(k) for k in chains["beta"].keys)
        assert m.lookup(chains["beta"]).cached_tokens == 0
        assert m.lookup(theirs).cached_tokens == 3 * BLOCK
        with m.load(m.lookup(theirs)) as handle:
            assert all(torch.equal(g, as_bytes(b)) for g, b in zip(handle.blocks, kv(3, seed=2), strict=True))


@pytest.mark.parametrize("enabled", [True, False])
def test_start_up_pauses_the_garbage_collector_and_leaves_it_as_it_found_it(
    tmp_path: Path, enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The collector is off while the policies rebuild from the reopened tiers, then restored as it was."""
    first = manager(tmp_path, write_mode=WriteMode.WRITE_THROUGH)
    first.store(first.keyed(prompt(4 * BLOCK, seed=1)), kv(4, 1))
    first.close()
    seen: list[bool] = []
    load = LRUPolicy.load
    monkeypatch.setattr(
        LRUPolicy, "load", lambda p, held, recency=None: (seen.append(gc.isenabled()), load(p, held, recency))
    )
    was = gc.isenabled()
    try:
        _collector(enabled)
        again = manager(tmp_path)
        assert seen == [False] * 2 and gc.isenabled() is enabled  # host's policy, then disk's
        assert again.lookup(again.keyed(prompt(4 * BLOCK, seed=1))).cached_blocks == 4
        again.close()
    finally:
        _collector(was)


def _collector(on: bool) -> None:
    if on:
        gc.enable()
    else:
        gc.disable()
