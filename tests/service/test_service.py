"""The cache service over a real Unix socket and a real shared-memory slab: clients in this and other processes.

The service runs on a thread of the test process; "another engine process"
is a real subprocess with its own client and its own mapping of the slab.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from kvtier.errors import DiskLockedError, KVTierError
from kvtier.service import CacheClient, CacheService, ServiceUnavailable, protocol
from kvtier.service.cache import ServiceCache
from kvtier.service.client import ServiceRefused
from kvtier.service.server import ServiceRunningError, group_id
from kvtier.tiers import native
from kvtier.tiers.base import TierKind
from tests.helpers import BLOCK, as_bytes, make_config, payload, prompt, toy_layout

ROOT = Path(__file__).resolve().parents[2]
FINGERPRINT = "toy-model"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[CacheService]:
    cfg = make_config(tmp_path, host={"capacity_bytes": 16 * 4096}, disk={"capacity_bytes": 32 * 4096})
    svc = CacheService(
        cfg, toy_layout(), model_fingerprint=FINGERPRINT, socket_path=tmp_path / "cache.sock", slab_dir=tmp_path
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    yield svc
    svc.close()
    thread.join(timeout=30)


def client(svc: CacheService) -> CacheClient:
    return CacheClient(svc.socket_path, toy_layout(), model_fingerprint=FINGERPRINT)


def blocks(n: int, seed: int) -> list[torch.Tensor]:
    return [payload(toy_layout(), seed * 100 + i) for i in range(n)]


# A second engine process: loads the prompt's blocks through its own client and mapping, prints their bytes' sums.
OTHER_PROCESS = """
import json, sys
import numpy as np
from kvtier.service import CacheClient
from tests.helpers import toy_layout
tokens = np.array(json.loads(sys.argv[2]), dtype=np.int32)
with CacheClient(sys.argv[1], toy_layout(), model_fingerprint="toy-model") as c:
    with c.load(tokens, "default") as load:
        print(json.dumps({"sums": [int(b.sum()) for b in load.blocks], "tiers": [t.value for t in load.served_from]}))
    if len(sys.argv) > 3:  # pin them again and wait to be killed
        held = c.load(tokens, "default")
        print("pinned", len(held.blocks), flush=True)
        sys.stdin.read()
"""


def test_blocks_stored_by_one_process_load_in_another_byte_for_byte(service: CacheService) -> None:
    tokens = prompt(4 * BLOCK + 1)
    data = blocks(4, seed=1)
    with client(service) as a:
        assert a.store(tokens, data, "default") == 4
        assert a.store(tokens, data, "default") == 0  # already held: nothing reserved or written again
        assert a.lookup(tokens, "default").cached_blocks == 4
    out = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, str(service.socket_path), json.dumps(tokens.tolist())],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    got = json.loads(out.stdout)
    assert got["sums"] == [int(as_bytes(b).sum()) for b in data]
    assert got["tiers"] == ["host"] * 4
    assert service.manager.stats().pinned_blocks == 0


def test_a_load_is_a_view_of_the_shared_slab_and_release_unpins(service: CacheService) -> None:
    tokens = prompt(2 * BLOCK + 1, seed=2)
    data = blocks(2, seed=2)
    with client(service) as c:
        c.store(tokens, data, "default")
        with c.load(tokens, "default") as load:
            assert [torch.equal(v, as_bytes(b)) for v, b in zip(load.blocks, data, strict=True)] == [True, True]
            assert load.served_from == [TierKind.HOST, TierKind.HOST]
            assert service.manager.stats().pinned_blocks == 2
        assert service.manager.stats().pinned_blocks == 0
        assert c.load(tokens, "other-tenant").blocks == []  # the namespace is in the key


def test_a_client_killed_while_holding_pins_loses_them(service: CacheService) -> None:
    tokens = prompt(3 * BLOCK + 1, seed=3)
    with client(service) as c:
        c.store(tokens, blocks(3, seed=3), "default")
    child = subprocess.Popen(
        [sys.executable, "-c", OTHER_PROCESS, str(service.socket_path), json.dumps(tokens.tolist()), "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()  # the first load's sums
        assert child.stdout.readline().split() == ["pinned", "3"]
        assert service.manager.stats().pinned_blocks == 3
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert service.wait_connections(0, timeout=60)  # the killed client's connection ended, its pins with it
    assert service.manager.stats().pinned_blocks == 0


def test_an_abandoned_reservation_is_given_back(service: CacheService) -> None:
    tokens = prompt(2 * BLOCK + 1, seed=4)
    c = client(service)

    def fill(i: int, out: torch.Tensor) -> None:
        raise RuntimeError("the engine died half-way")

    with pytest.raises(RuntimeError):
        c.store_from(tokens, fill, "default", num_blocks=2)
    assert c.lookup(tokens, "default").cached_blocks == 0
    assert service.manager.host.free_blocks() == service.manager.host.capacity_blocks
    c.close()


def test_bytes_that_do_not_match_their_checksum_are_never_published(service: CacheService) -> None:
    tokens = prompt(2 * BLOCK + 1, seed=6)
    c = client(service)
    reserved = c._ask(protocol.Reserve(tokens.astype("<i4").tobytes(), "default", 0, 2))
    assert isinstance(reserved, protocol.Reserved) and len(reserved.offsets) == 2
    data = blocks(2, seed=6)
    for offset, block in zip(reserved.offsets, data, strict=True):
        c._view(offset).copy_(as_bytes(block))
    sums = [native.BACKEND.crc32c(as_bytes(b).numpy()) for b in data]  # what the client meant to write
    c._view(reserved.offsets[1])[7] ^= 0xFF  # and a byte that changed under it
    assert c._ask(protocol.Commit(reserved.lease, crc32c=sums)) is None  # refused (a counted failure)
    assert c.failures == 1
    assert c.lookup(tokens, "default").cached_blocks == 0
    assert service.manager.host.free_blocks() == service.manager.host.capacity_blocks
    c.close()


def test_the_handshake_refuses_another_model_or_layout_naming_both(service: CacheService) -> None:
    with pytest.raises(ServiceUnavailable, match=r"model fingerprint: client 'other-model', service 'toy-model'"):
        CacheClient(service.socket_path, toy_layout(), model_fingerprint="other-model")
    with pytest.raises(ServiceUnavailable, match="KV layout"):
        CacheClient(service.socket_path, toy_layout(torch.bfloat16), model_fingerprint=FINGERPRINT)
    with pytest.raises(ServiceUnavailable, match="cache service at"):
        CacheClient(service.socket_path.with_name("none.sock"), toy_layout(), model_fingerprint=FINGERPRINT)


def test_the_socket_and_slab_are_private_and_other_users_are_refused(service: CacheService, tmp_path: Path) -> None:
    assert stat.S_IMODE(service.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(service.slab_path.stat().st_mode) == 0o600
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    os.chmod(service.socket_path, 0o666)  # even past the file mode, the peer's uid is checked
    with tempfile.TemporaryDirectory() as reachable:  # pytest's own temp tree is closed to other users
        os.chmod(reachable, 0o711)
        link = Path(reachable) / "cache.sock"
        os.link(service.socket_path, link)  # the same socket, by a path nobody can traverse to
        assert refusal_as_nobody(link).startswith("uid 65534 may not use this cache service")


def refusal_as_nobody(path: Path) -> str:
    """Connect as uid 65534 from a forked child (which needs nothing it has not imported) and return the reply."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, say Hello, report what came back, never return into pytest
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(str(path))
                reply = protocol.recv_reply(sock)
            os.write(write, (reply.reason if isinstance(reply, protocol.Refused) else repr(reply)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_a_service_that_went_away_is_a_miss(service: CacheService) -> None:
    tokens = prompt(2 * BLOCK + 1, seed=5)
    c = client(service)
    c.store(tokens, blocks(2, seed=5), "default")
    service.close()
    assert c.lookup(tokens, "default").cached_blocks == 0
    assert c.load(tokens, "default").blocks == []
    assert c.store(tokens, blocks(2, seed=5), "default") == 0
    assert c.failures >= 3
    c.close()


def test_a_session_turn_protects_its_transcript_in_the_services_host_tier(service: CacheService) -> None:
    """Host holds 16 blocks; a live session's 4 outlast 20 anonymous ones stored after them (LRU would drop them)."""
    agent = prompt(4 * BLOCK + 3, seed=1)
    with client(service) as c:
        c.store(agent, blocks(4, seed=1), "default")
        c.session_turn("default", "agent-1", agent)
        for s in range(2, 7):
            c.store(prompt(4 * BLOCK, seed=s), blocks(4, seed=s), "default")
        assert c.probe(agent, "default").tiers == [protocol.Tier.HOST] * 4
        assert c.probe(agent, "other-tenant").cached_blocks == 0  # its namespace is part of what was protected
    assert service.agent_sessions is not None and service.agent_sessions.protected_blocks == 4


def test_session_prefetch_promotes_the_transcript_from_disk_and_says_how_much(service: CacheService) -> None:
    agent = prompt(3 * BLOCK, seed=1)
    with client(service) as c:
        c.store(agent, blocks(3, seed=1), "default")
        for s in range(2, 7):  # no session yet: plain LRU sends the transcript down to disk
            c.store(prompt(4 * BLOCK, seed=s), blocks(4, seed=s), "default")
        assert c.probe(agent, "default").tiers == [protocol.Tier.DISK] * 3
        reply = c.session_prefetch("default", "agent-1", agent)
        assert reply.promoted == {protocol.Tier.DISK: 3 * BLOCK} and reply.host_blocks == 3
        assert c.probe(agent, "default").tiers == [protocol.Tier.HOST] * 3
        with c.load(agent, "default") as load:  # the promoted bytes are the stored ones
            assert [int(b.sum()) for b in load.blocks] == [int(as_bytes(b).sum()) for b in blocks(3, seed=1)]
    assert service.agent_sessions is not None and service.agent_sessions.get("default", "agent-1") is not None


def test_explain_is_answered_from_the_services_eviction_log(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, host={"capacity_bytes": 8 * 4096}, disk={"enabled": False})
    svc = CacheService(
        cfg, toy_layout(), model_fingerprint=FINGERPRINT, socket_path=tmp_path / "cache.sock", slab_dir=tmp_path
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    agent = prompt(2 * BLOCK + 1, seed=1)
    with client(svc) as c:
        c.store(agent, blocks(2, seed=1), "default")
        whole = c.explain(agent, "default")
        assert whole is not None and whole.reason == "partial_tail" and whole.first_miss_token == 2 * BLOCK
        c.store(prompt(8 * BLOCK, seed=2), blocks(8, seed=2), "default")  # a whole tier: the agent's go
        why = c.explain(agent, "default", diverged_at=3)
        assert why is not None and why.reason == "evicted" and why.first_miss_token == 0
        assert (why.eviction_tier, why.eviction_policy) == (protocol.Tier.HOST, protocol.Policy.LRU)
        assert why.eviction_age_s is not None and why.eviction_age_s >= 0
        never = c.explain(prompt(BLOCK, seed=9), "default")
        assert never is not None and never.reason == "never_stored"
        svc.close()
        thread.join(timeout=30)
        assert c.explain(agent, "default") is None  # nothing to answer from: the server says 503, not a guess


def test_a_reservation_left_uncommitted_is_withdrawn_and_its_late_commit_refused(tmp_path: Path) -> None:
    now = [100.0]
    cfg = make_config(tmp_path, host={"capacity_bytes": 8 * 4096}, disk={"capacity_bytes": 16 * 4096})
    svc = CacheService(
        cfg,
        toy_layout(),
        model_fingerprint=FINGERPRINT,
        socket_path=tmp_path / "c.sock",
        slab_dir=tmp_path,
        reservation_ttl_s=10.0,
        clock=lambda: now[0],
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    try:
        c = client(svc)
        tokens = prompt(2 * BLOCK + 1, seed=7)
        reserved = c._ask(protocol.Reserve(tokens.astype("<i4").tobytes(), "default", 0, 2))
        assert isinstance(reserved, protocol.Reserved) and svc.manager.host.free_blocks() == 6
        now[0] += 9.9
        svc.expire_reservations()
        assert svc.manager.host.free_blocks() == 6  # not yet
        now[0] += 0.1
        svc.expire_reservations()
        assert c._ask(protocol.Commit(reserved.lease)) is None  # the hung engine's late commit is refused
        assert c.lookup(tokens, "default").cached_blocks == 0
        assert svc.manager.stats().tiers["host"].withheld_blocks == 2  # unpublished; the engine may still write there
        with client(svc) as other:  # the keys are free for anyone else, in other slots
            assert other.store(tokens, blocks(2, seed=7), "default") == 2
        assert svc.manager.host.free_blocks() == 4
        c.close()
        assert svc.wait_connections(0, timeout=60)
        assert svc.manager.host.free_blocks() == 6  # the withheld slots came back with the connection's end
    finally:
        svc.close()
        thread.join(timeout=30)


def test_a_late_fill_after_its_reservation_expired_never_changes_anothers_committed_block(tmp_path: Path) -> None:
    """Client A's fill stalls past its reservation's expiry; B stores other blocks meanwhile; A's fill then
    lands. Every committed block a third client loads is B's, byte for byte: A's slots were never B's."""
    now = [100.0]
    cfg = make_config(tmp_path, host={"capacity_bytes": 16 * 4096}, disk={"capacity_bytes": 32 * 4096})
    svc = CacheService(
        cfg,
        toy_layout(),
        model_fingerprint=FINGERPRINT,
        socket_path=tmp_path / "c.sock",
        slab_dir=tmp_path,
        reservation_ttl_s=10.0,
        clock=lambda: now[0],
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    a, b, c = client(svc), client(svc), client(svc)
    try:
        tokens_a, tokens_b = prompt(6 * BLOCK + 1, seed=30), prompt(6 * BLOCK + 1, seed=31)
        data_a, data_b = blocks(6, seed=30), blocks(6, seed=31)
        reserved, go = threading.Event(), threading.Event()

        def stalled_fill(i: int, out: torch.Tensor) -> None:
            reserved.set()
            go.wait()  # the engine hangs here, its slots reserved
            out.copy_(as_bytes(data_a[i]))

        stored_a: list[int] = []
        filler = threading.Thread(target=lambda: stored_a.append(a.store_from(tokens_a, stalled_fill, "default")))
        filler.start()
        assert reserved.wait(60)
        now[0] += 10.0
        assert svc.expire_reservations() == 1  # one reservation of six blocks
        assert b.store(tokens_b, data_b, "default") == 6  # other slots: A's are still A's to write
        go.set()
        filler.join(60)
        assert stored_a == [0]  # A's late commit is refused
        with c.load(tokens_b, "default") as load:
            assert len(load.blocks) == 6
            assert [torch.equal(v, as_bytes(d)) for v, d in zip(load.blocks, data_b, strict=True)] == [True] * 6
        assert c.lookup(tokens_a, "default").cached_blocks == 0
        assert svc.manager.stats().tiers["host"].withheld_blocks == 6  # until A's connection ends
        a.close()
        assert svc.wait_connections(2, timeout=60)
        assert svc.manager.stats().tiers["host"].withheld_blocks == 0
        assert svc.manager.host.free_blocks() == 10
    finally:
        b.close()
        c.close()
        svc.close()
        thread.join(timeout=30)


def test_a_client_closed_under_a_running_fill_keeps_its_connection_until_the_fill_ends(
    service: CacheService,
) -> None:
    """The service frees a client's reservations when its connection ends: never before the fill writing them."""
    c = client(service)
    tokens = prompt(3 * BLOCK + 1, seed=40)
    in_fill, go = threading.Event(), threading.Event()

    def fill(i: int, out: torch.Tensor) -> None:
        in_fill.set()
        go.wait()
        out.copy_(as_bytes(payload(toy_layout(), i)))

    stored: list[int] = []
    filler = threading.Thread(target=lambda: stored.append(c.store_from(tokens, fill, "default")))
    filler.start()
    assert in_fill.wait(60)
    c.close()  # say, the link dropping it after a failed call on another thread
    assert c._sock.fileno() != -1  # still open: the service still counts those slots as this fill's
    assert c.lookup(tokens, "default").cached_blocks == 0  # but nothing more is asked on it
    go.set()
    filler.join(60)
    assert stored == [0] and c._sock.fileno() == -1  # the fill is over: now the connection ends, uncommitted
    assert service.wait_connections(0, timeout=60)
    assert service.manager.host.free_blocks() == service.manager.host.capacity_blocks


def test_a_client_closed_while_a_load_is_copied_keeps_its_pins_until_released(service: CacheService) -> None:
    tokens = prompt(2 * BLOCK + 1, seed=41)
    data = blocks(2, seed=41)
    c = client(service)
    c.store(tokens, data, "default")
    load = c.load(tokens, "default")
    c.close()
    assert c._sock.fileno() != -1 and service.manager.stats().pinned_blocks == 2
    assert [torch.equal(v, as_bytes(b)) for v, b in zip(load.blocks, data, strict=True)] == [True, True]
    load.release()
    assert c._sock.fileno() == -1
    assert service.wait_connections(0, timeout=60)
    assert service.manager.stats().pinned_blocks == 0


def test_requests_out_of_bounds_are_refused_in_one_line_and_the_connection_goes_on(service: CacheService) -> None:
    tokens = prompt(3 * BLOCK + 1, seed=42)
    raw = tokens.astype("<i4").tobytes()
    c = client(service)
    c.store(tokens, blocks(3, seed=42), "default")
    hostile = [
        protocol.Pin(raw, "default", float("nan")),  # pinned forever, once
        protocol.Pin(raw, "default", float("inf")),
        protocol.Pin(raw, "default", -1.0),  # a thread traceback and the end of the connection, once
        protocol.Lookup(raw, "default", 10**15),  # answered cached_blocks = 10**15, once
        protocol.Lookup(raw, "default", -1),
        protocol.Lookup(raw[:-1], "default"),  # not whole int32s: a thread traceback, once
        protocol.Load(raw, "default", start=4),
        protocol.Load(raw, "default", start=0, deadline_s=float("nan")),
        protocol.Reserve(raw, "default", first_block=5),
        protocol.Reserve(raw, "default", num_blocks=-2),
    ]
    for n, message in enumerate(hostile, start=1):
        assert c._ask(message) is None, message  # a Failure: a miss for the client, counted
        assert c.failures == n
    assert service.manager.ttl_pinned() == 0
    assert service.manager.stats().pinned_blocks == 0
    assert c.lookup(tokens, "default", first_block=3).cached_blocks == 3  # the end of the prompt is a place
    assert c.lookup(tokens, "default").cached_blocks == 3  # the same connection still answers
    c.close()


def test_a_disk_pin_crosses_the_socket_and_holds_in_the_services_disk_tier(
    service: CacheService, tmp_path: Path
) -> None:
    """The server's cache (ServiceCache) -> CacheClient -> Pin(tier=disk) -> the service's manager."""
    cfg = make_config(tmp_path / "engine", cache={"service": f"unix://{service.socket_path}"})
    cache = ServiceCache(service.socket_path, cfg, toy_layout(), model_fingerprint=FINGERPRINT)
    try:
        system = cache.keyed(prompt(2 * BLOCK, seed=50))
        assert cache.store(system, blocks(2, seed=50)) == 2
        assert cache.pin_for(system, 60.0, tier=TierKind.DISK) == 2
        assert service.manager.ttl_pinned() == 2
        for seed in range(60, 100):  # 80 blocks through a 16-block host and a 32-block disk
            cache.store(cache.keyed(prompt(2 * BLOCK, seed), "other"), blocks(2, seed))
        held = service.manager.keyed(system.tokens)
        assert service.manager.probe(held).tiers == (TierKind.DISK, TierKind.DISK)
        assert cache.pin_for(system, 0, tier=TierKind.DISK) == 2 and service.manager.ttl_pinned() == 0
    finally:
        cache.close()


def test_a_host_pin_is_framed_as_before_the_tier_field_and_an_old_pin_is_a_host_pin() -> None:
    """The tier field came without a version bump: either side may still be the older one."""
    raw = prompt(BLOCK, seed=51).astype("<i4").tobytes()
    host = msgspec.msgpack.decode(msgspec.msgpack.encode(protocol.Pin(raw, "default", 5.0)))
    assert host == {"type": "Pin", "tokens": raw, "namespace": "default", "ttl_s": 5.0}  # what an old service takes
    old = msgspec.msgpack.encode({"type": "Pin", "tokens": raw, "namespace": "default", "ttl_s": 5.0})
    assert msgspec.msgpack.decode(old, type=protocol.Request) == protocol.Pin(raw, "default", 5.0, protocol.Tier.HOST)
    disk = msgspec.msgpack.encode(protocol.Pin(raw, "default", 5.0, protocol.Tier.DISK))
    assert msgspec.msgpack.decode(disk)["tier"] == "disk"


def test_clients_past_max_clients_are_turned_away_and_admitted_once_one_leaves(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, host={"capacity_bytes": 16 * 4096}, service={"max_clients": 2})
    svc = CacheService(cfg, toy_layout(), model_fingerprint=FINGERPRINT, socket_path=tmp_path / "c.sock")
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    try:
        first, second = client(svc), client(svc)
        with pytest.raises(ServiceUnavailable, match="at most 2 clients") as refused:
            client(svc)
        assert not isinstance(refused.value, ServiceRefused)  # busy, not another model: the link tries again
        assert svc.connections == 2
        first.close()
        assert svc.wait_connections(1, timeout=60)
        with client(svc) as third:
            assert third.stats().tiers["host"].blocks == 0
        second.close()
    finally:
        svc.close()
        thread.join(timeout=30)


def test_a_connection_that_never_says_hello_is_ended(service: CacheService, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.service import server

    monkeypatch.setattr(server, "HELLO_TIMEOUT_S", 0.2)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.settimeout(60)
        idle.connect(str(service.socket_path))
        assert idle.recv(1) == b""  # closed by the service, holding no thread
    assert service.wait_connections(0, timeout=60)


def test_a_load_after_its_lookup_counts_the_hit_once(service: CacheService) -> None:
    """vLLM's scheduler looks up and its worker loads: one request, one hit, in the service's figures."""
    tokens = prompt(3 * BLOCK + 1, seed=43)
    with client(service) as scheduler, client(service) as worker:
        scheduler.store(tokens, blocks(3, seed=43), "default")
        assert scheduler.lookup(tokens, "default").cached_blocks == 3
        with worker.load(tokens, "default") as load:
            assert len(load.blocks) == 3
    host = service.manager.stats().tiers["host"]
    assert host.hit_tokens == 3 * BLOCK and host.lookups == 1


def raw_exchange(path: Path, payload: bytes) -> bytes:
    """Send raw bytes as a client would, read until the service closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(path))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(4096):
            out += chunk
        return out


def test_malformed_frames_end_that_connection_only(service: CacheService) -> None:
    oversized = struct.pack("<I", protocol.MAX_FRAME + 1)
    assert raw_exchange(service.socket_path, oversized) == b""  # closed: no frame of that size is read
    garbage = struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1"
    assert raw_exchange(service.socket_path, garbage) == b""
    stats = msgspec.msgpack.encode(protocol.Stats())
    reply = raw_exchange(service.socket_path, struct.pack("<I", len(stats)) + stats)  # no Hello first
    refused = msgspec.msgpack.decode(reply[4:], type=protocol.Reply)
    assert isinstance(refused, protocol.Refused) and "Hello" in refused.reason
    assert service.wait_connections(0, timeout=60)
    with client(service) as c:  # the service is unharmed
        assert c.stats().tiers["host"].blocks == 0


def test_a_second_service_on_a_live_socket_or_disk_refuses_and_leaves_nothing(
    service: CacheService, tmp_path: Path
) -> None:
    slabs = set(tmp_path.glob("*.slab"))
    cfg = make_config(tmp_path, host={"capacity_bytes": 16 * 4096}, disk={"capacity_bytes": 32 * 4096})
    with pytest.raises(ServiceRunningError, match="already answers"):
        CacheService(cfg, toy_layout(), model_fingerprint=FINGERPRINT, socket_path=service.socket_path)
    with pytest.raises(DiskLockedError):  # the same disk tier under another socket
        CacheService(
            cfg, toy_layout(), model_fingerprint=FINGERPRINT, socket_path=tmp_path / "b.sock", slab_dir=tmp_path
        )
    assert set(tmp_path.glob("*.slab")) == slabs  # the refused one's shared-memory slab is gone
    with client(service) as c:  # the first one still answers on its socket
        assert c.stats().tiers["host"].blocks == 0


def test_socket_group_shares_socket_and_slab_and_admits_its_members(tmp_path: Path) -> None:
    """Modes and group of both files as created; admission by the peer's credentials, with the system's own users.

    (Another user's process cannot run this venv's interpreter here, so admission is asked of the check itself.)
    """
    group = os.getgid()
    cfg = make_config(tmp_path, host={"capacity_bytes": 16 * 4096}, disk={"enabled": False})
    svc = CacheService(
        cfg,
        toy_layout(),
        model_fingerprint=FINGERPRINT,
        socket_path=tmp_path / "cache.sock",
        slab_dir=tmp_path,
        socket_group=group,
    )
    try:
        for path in (svc.socket_path, svc.slab_path):
            st = path.stat()
            assert (st.st_mode & 0o777, st.st_gid) == (0o660, group)
        other_uid = os.getuid() + 12345  # no such user: admitted only through the group, as its primary gid
        assert svc.admits(other_uid, group)
        assert not svc.admits(other_uid, group + 1)
        assert svc.admits(os.getuid(), group + 1)  # the service's own user, whatever its group
    finally:
        svc.close()
    plain = CacheService(
        cfg, toy_layout(), model_fingerprint=FINGERPRINT, socket_path=tmp_path / "plain.sock", slab_dir=tmp_path
    )
    try:
        assert plain.socket_path.stat().st_mode & 0o777 == 0o600
        assert not plain.admits(os.getuid() + 12345, os.getgid())
    finally:
        plain.close()


def test_socket_group_by_name_or_number() -> None:
    import grp

    name = grp.getgrgid(os.getgid()).gr_name
    assert group_id(name) == group_id(str(os.getgid())) == os.getgid()
    with pytest.raises(KVTierError, match="no group named"):
        group_id("no-such-group-kvtier")


def test_the_service_publishes_its_tiers_events_in_vllms_format(tmp_path: Path) -> None:
    """A node whose tiers live in the service: what a client stores is published with the keys it computed."""
    from tests.test_publisher import replay, state

    cfg = make_config(
        tmp_path,
        host={"capacity_bytes": 16 * 4096},
        kv_events={"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"},
    )
    svc = CacheService(
        cfg, toy_layout(), model_fingerprint=FINGERPRINT, socket_path=tmp_path / "cache.sock", slab_dir=tmp_path
    )
    thread = threading.Thread(target=svc.serve_forever, daemon=True)
    thread.start()
    try:
        assert svc.publisher is not None and svc.publisher.replay_endpoint is not None
        tokens = prompt(3 * BLOCK + 1, seed=5)
        with client(svc) as c:
            assert c.store(tokens, blocks(3, seed=5), "default") == 3
        want = {bytes(k) for k in svc.manager.hasher.keys(tokens, "default")}
        batches = replay(svc.publisher.replay_endpoint, 0)
        assert state(batches) == {"CPU": want}
        assert {b.root for _, b in batches} == {bytes(svc.manager.hasher.root("default"))}
    finally:
        svc.close()
        thread.join(timeout=30)
