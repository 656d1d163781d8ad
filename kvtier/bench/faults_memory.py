"""Memory faults: eviction under a pinned reader, 64 writers of one key, host memory pinned full by a flood.

The promises: a block being read is pinned and cannot be evicted or
overwritten, and every pin is given back (``pinned_blocks`` returns to 0);
of many writers storing one key exactly one copy is committed, and a
writer whose tokens differ (a key collision) never gets its bytes served
for the others' tokens, nor theirs for its own (every hit is confirmed
against the tokens); a host tier pinned full answers a flood of stores and
loads at once with "nothing stored" / a miss, never a wait or a retry
loop, and its memory stays flat (the slab is preallocated: nothing grows).

Writers are real threads on one manager and, for the same-key fault, real
processes with their own :class:`~kvtier.service.CacheClient` against a
real cache service (its Unix socket and shared-memory slab).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvtier.bench.faultkit import (
    BLOCK,
    FINGERPRINT,
    GUARD_S,
    LAYOUT,
    Threads,
    as_bytes,
    kv,
    rss_bytes,
    serve,
    tokens,
    toy_cache,
    toy_config,
)
from kvtier.bench.faults import Fault, FaultOutcome, fault
from kvtier.config import WriteMode
from kvtier.keys import BlockKey, KeyHasher, Secret, xxh3_128
from kvtier.manager import CacheManager


def _pins_left(cache: CacheManager) -> int:
    return int(cache.stats().pinned_blocks)


def _host_reserved(cache: CacheManager) -> int:
    """Host slots neither free nor holding a committed block: reservations nobody completed."""
    return cache.host.capacity_blocks - cache.host.free_blocks() - len(cache.host)


# -- evict while reading -----------------------------------------------------------------------------------------------
HOST_BLOCKS = 32
DISK_BLOCKS = 32
WRITERS = 4
READERS = 2
PROMPT_BLOCKS = 4
CHURN = 10  # times the two tiers' capacity written while a reader holds its pins


@fault(Fault.EVICT_WHILE_READING)
def evict_while_reading(workdir: Path) -> FaultOutcome:
    """A reader pins a prompt while writers churn 10x host + disk and other readers load what they can."""
    cfg = toy_config(
        workdir, host_blocks=HOST_BLOCKS, disk_blocks=DISK_BLOCKS, write_mode=WriteMode.WRITE_BACK, file_blocks=8
    )
    prompts = CHURN * (HOST_BLOCKS + DISK_BLOCKS) // PROMPT_BLOCKS
    per_writer = prompts // WRITERS
    with toy_cache(cfg) as cache:
        pinned_prompt = prompts  # stored before the churn, outside the writers' range
        cache.store(cache.keyed(tokens(pinned_prompt, PROMPT_BLOCKS)), kv(pinned_prompt, PROMPT_BLOCKS))
        held = cache.load(cache.lookup(cache.keyed(tokens(pinned_prompt, PROMPT_BLOCKS))))
        written = [0] * WRITERS
        checked = [[0, 0] for _ in range(READERS)]  # blocks read, blocks wrong
        done = threading.Event()

        def writer(w: int) -> None:
            for p in range(w * per_writer, (w + 1) * per_writer):
                written[w] += cache.store(cache.keyed(tokens(p, PROMPT_BLOCKS)), kv(p, PROMPT_BLOCKS))

        def reader(r: int) -> None:
            p = r
            while not done.is_set():
                got = serve(cache, p % prompts, PROMPT_BLOCKS)
                checked[r][0] += got.blocks
                checked[r][1] += got.wrong
                p += READERS

        readers = Threads([lambda r=r: reader(r) for r in range(READERS)]).start()
        writers = Threads([lambda w=w: writer(w) for w in range(WRITERS)])
        writers.start()
        try:
            writers.join()
        finally:
            done.set()
            readers.join()
        want = kv(pinned_prompt, PROMPT_BLOCKS)
        pinned_intact = sum(torch.equal(v, as_bytes(want[i])) for i, v in enumerate(held.blocks))
        pins_during = _pins_left(cache)
        held.release()
        after = [serve(cache, p, PROMPT_BLOCKS) for p in range(prompts)]  # what survived, read back
        evicted = cache.host.stats.evictions + (cache.disk.stats.evictions if cache.disk else 0)
        pins, reserved = _pins_left(cache), _host_reserved(cache)
    blocks = sum(written)
    read = sum(c[0] for c in checked) + sum(a.blocks for a in after)
    wrong = sum(c[1] for c in checked) + sum(a.wrong for a in after)
    figures = {
        "blocks_written": blocks,
        "capacity_blocks": HOST_BLOCKS + DISK_BLOCKS,
        "pinned_blocks_intact": pinned_intact,
        "pins_held_during": pins_during,
        "blocks_read_back": read,
        "evictions": evicted,
        "pins_after": pins,
        "reservations_after": reserved,
    }
    held_ok = (
        blocks == prompts * PROMPT_BLOCKS
        and pinned_intact == len(held.blocks) == PROMPT_BLOCKS
        and pins_during == PROMPT_BLOCKS
        and evicted >= blocks - (HOST_BLOCKS + DISK_BLOCKS)
        and pins == reserved == wrong == 0
    )
    return FaultOutcome(
        Fault.EVICT_WHILE_READING,
        injected=(
            f"{WRITERS} writer threads stored {blocks} blocks ({CHURN}x host + disk) while a reader held "
            f"{PROMPT_BLOCKS} blocks pinned and {READERS} readers loaded and checked blocks throughout"
        ),
        outcome=(
            f"the pinned blocks kept their bytes through {evicted} evictions; {read} blocks read back, "
            "every byte equal to what was written; pins and reservations back to 0"
        ),
        held=held_ok,
        wrong_bytes_served=wrong,
        figures=figures,
    )


# -- same-hash writers -------------------------------------------------------------------------------------------------
SAME_KEY_WRITERS = 64
SAME_KEY_BLOCKS = 4
HONEST, FOREIGN = 1, 2  # prompt seeds: the foreign prompt differs only in each block's last token


def blind_to_last_token(data: bytes | memoryview, seed: int) -> bytes:
    """A forced collision: xxh3-128 of a block's chain input without its last token (4 bytes).

    Two prompts that differ only in each block's last token then share every
    key, as a hash collision would make them: only the token confirmation
    tells them apart. For faults and tests only; config cannot reach it.
    """
    return xxh3_128(bytes(data)[:-4], seed)


def colliding_hasher(data_dir: Path) -> KeyHasher:
    return KeyHasher(
        Secret.load_or_create(data_dir),
        model_fingerprint=FINGERPRINT,
        layout_descriptor=LAYOUT.descriptor,
        block_size=BLOCK,
        hash128=blind_to_last_token,
    )


def same_key_tokens(which: int) -> np.ndarray:
    """The honest prompt, or the foreign one: the same tokens but each block's last, so the same keys."""
    out = tokens(HONEST, SAME_KEY_BLOCKS)
    if which == FOREIGN:
        out = out.copy()
        out[BLOCK - 1 :: BLOCK] += 1
    return out


def _copies(cache: CacheManager, keys: list[BlockKey]) -> dict[str, int]:
    """For each side, how many of ``keys`` hold its tokens and its bytes; and how many hold a mix."""
    sides = {HONEST: 0, FOREIGN: 0}
    crossed = 0
    for b, key in enumerate(keys):
        record, view = cache.host.record(key), cache.host.view(key)
        if record is None or view is None:
            continue
        for side in sides:
            digest = cache.hasher.digests(keys, same_key_tokens(side))[b]
            if record.matches(digest):
                sides[side] += 1
                crossed += not torch.equal(view, as_bytes(kv(side, SAME_KEY_BLOCKS)[b]))
    return {"honest": sides[HONEST], "foreign": sides[FOREIGN], "crossed": crossed}


def _served_both(cache: CacheManager) -> tuple[dict[int, int], int]:
    """Blocks each side's lookup is served, and blocks whose bytes are not that side's."""
    served, wrong = {}, 0
    for side in (HONEST, FOREIGN):
        with cache.load(cache.lookup(cache.keyed(same_key_tokens(side)))) as handle:
            want = kv(side, SAME_KEY_BLOCKS)
            served[side] = len(handle.blocks)
            wrong += sum(not torch.equal(v, as_bytes(want[i])) for i, v in enumerate(handle.blocks))
    return served, wrong


def _same_key_threads(workdir: Path) -> tuple[dict[str, int], int]:
    cfg = toy_config(workdir / "threads", host_blocks=16, disk_blocks=16)
    foreign_writer = SAME_KEY_WRITERS // 2

    def write(w: int) -> Callable[[], object]:
        side = FOREIGN if w == foreign_writer else HONEST
        return lambda: cache.store(cache.keyed(same_key_tokens(side)), kv(side, SAME_KEY_BLOCKS))

    with toy_cache(cfg, hasher=colliding_hasher(workdir / "threads" / "data")) as cache:
        keys = cache.keys(same_key_tokens(HONEST))
        assert keys == cache.keys(same_key_tokens(FOREIGN)), "the forced collision must give both prompts one key"
        Threads([write(w) for w in range(SAME_KEY_WRITERS)]).start().join()
        copies = _copies(cache, keys)
        served, wrong = _served_both(cache)
        figures = {
            **copies,
            "host_blocks": len(cache.host),
            "served_honest": served[HONEST],
            "served_foreign": served[FOREIGN],
            "confirm_mismatch": cache.host.stats.confirm_mismatches,
            "pins_after": _pins_left(cache),
        }
    return figures, wrong


WRITER_PROCESS = """
import sys, threading
from kvtier.bench.faults_memory import writer_process
writer_process(sys.argv[1], [int(s) for s in sys.argv[2:]])
"""


def writer_process(socket_path: str, sides: list[int]) -> None:
    """One engine process: a client per thread, each storing its side's prompt once ``go`` arrives on stdin."""
    from kvtier.service import CacheClient

    clients = [CacheClient(socket_path, LAYOUT, model_fingerprint=FINGERPRINT) for _ in sides]
    stored = [0] * len(sides)
    go = threading.Event()

    def write(i: int, side: int) -> None:
        go.wait(GUARD_S)
        stored[i] = clients[i].store(same_key_tokens(side), kv(side, SAME_KEY_BLOCKS), "default")

    threads = [threading.Thread(target=write, args=(i, s)) for i, s in enumerate(sides)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for t in threads:
        t.join(GUARD_S)
    for c in clients:
        c.close()
    print(json.dumps({"stored": sum(stored)}), flush=True)


PROCESSES = 2


def _same_key_processes(workdir: Path) -> tuple[dict[str, int], int]:
    from kvtier.service import CacheService

    root = workdir / "processes"
    cfg = toy_config(root, host_blocks=16, disk_blocks=16)
    service = CacheService(
        cfg,
        LAYOUT,
        model_fingerprint=FINGERPRINT,
        socket_path=root / "cache.sock",
        slab_dir=root,
        hasher=colliding_hasher(root / "data"),
    )
    serving = threading.Thread(target=service.serve_forever, daemon=True)
    serving.start()
    per = SAME_KEY_WRITERS // PROCESSES
    children: list[subprocess.Popen[str]] = []
    try:
        for n in range(PROCESSES):
            sides = [FOREIGN if (n, i) == (PROCESSES - 1, per - 1) else HONEST for i in range(per)]
            children.append(
                subprocess.Popen(
                    [sys.executable, "-c", WRITER_PROCESS, str(service.socket_path), *map(str, sides)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for child in children:  # every client connected before any writes
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for child in children:
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        outs = [child.communicate(timeout=GUARD_S)[0] for child in children]
        cache = service.manager
        keys = cache.keys(same_key_tokens(HONEST))
        copies = _copies(cache, keys)
        served, wrong = _served_both(cache)
        figures = {
            **copies,
            "host_blocks": len(cache.host),
            "stored_by_clients": sum(json.loads(o.splitlines()[-1])["stored"] for o in outs),
            "served_honest": served[HONEST],
            "served_foreign": served[FOREIGN],
            "pins_after": _pins_left(cache),
        }
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=GUARD_S)
        service.close()
        serving.join(GUARD_S)
    return figures, wrong


def _one_copy(f: dict[str, int]) -> bool:
    """Each key holds one side's tokens with that side's bytes, and each side is served only its own blocks."""
    return (
        f["honest"] + f["foreign"] == f["host_blocks"] == SAME_KEY_BLOCKS
        and f["crossed"] == 0
        and f["served_honest"] <= f["honest"]
        and f["served_foreign"] <= f["foreign"]
        and f["served_honest"] + f["served_foreign"] >= 1
        and f["pins_after"] == 0
    )


@fault(Fault.SAME_HASH_WRITERS)
def same_hash_writers(workdir: Path) -> FaultOutcome:
    """64 writer threads on one manager, then 64 writers in 4 processes on one cache service: one key, two contents."""
    threads, wrong_t = _same_key_threads(workdir)
    processes, wrong_p = _same_key_processes(workdir)
    figures = {f"threads_{k}": v for k, v in threads.items()} | {f"processes_{k}": v for k, v in processes.items()}
    held = _one_copy(threads) and _one_copy(processes) and wrong_t == wrong_p == 0
    return FaultOutcome(
        Fault.SAME_HASH_WRITERS,
        injected=(
            f"{SAME_KEY_WRITERS} writers (threads on one manager; then {PROCESSES} processes x "
            f"{SAME_KEY_WRITERS // PROCESSES} clients on one cache service) stored one {SAME_KEY_BLOCKS}-block "
            "prompt at once, one of them a prompt whose keys collide but whose tokens differ"
        ),
        outcome=(
            "one committed copy per key, its bytes its writer's; each prompt served only blocks its own tokens "
            "confirm, the other's a counted confirm mismatch; no pins left"
        ),
        held=held,
        wrong_bytes_served=wrong_t + wrong_p,
        figures=figures,
    )


# -- memory flood ------------------------------------------------------------------------------------------------------
FLOOD_HOST_BLOCKS = 16
FLOOD_THREADS = 8
FLOOD_CALLS = 50  # per thread, per round
FLOOD_ROUNDS = 4
# Kept refused payloads would grow RSS by (rounds - 1) x threads x calls x 4 blocks x 1,536 B = 7.4 MB.
RSS_BOUND = 4 * 1024**2


@fault(Fault.MEMORY_FLOOD)
def memory_flood(workdir: Path) -> FaultOutcome:
    """Host memory pinned full by held loads, then threads flood it with stores and loads of disk blocks."""
    cfg = toy_config(workdir, host_blocks=FLOOD_HOST_BLOCKS, disk_blocks=64, write_mode=WriteMode.WRITE_THROUGH)
    with toy_cache(cfg) as cache:
        resident = FLOOD_HOST_BLOCKS // PROMPT_BLOCKS
        on_disk = range(resident, resident + 8)
        for p in on_disk:  # stored first: written through to disk, then pushed out of host by the resident ones
            cache.store(cache.keyed(tokens(p, PROMPT_BLOCKS)), kv(p, PROMPT_BLOCKS))
        for p in range(resident):
            cache.store(cache.keyed(tokens(p, PROMPT_BLOCKS)), kv(p, PROMPT_BLOCKS))
        holds = [cache.load(cache.lookup(cache.keyed(tokens(p, PROMPT_BLOCKS)))) for p in range(resident)]
        pinned = _pins_left(cache)
        counts = {"stored": 0, "loaded": 0, "calls": 0}
        lock = threading.Lock()

        def flood(t: int, round_: int) -> None:
            stored = loaded = 0
            for n in range(FLOOD_CALLS):
                p = 1000 + (round_ * FLOOD_THREADS + t) * FLOOD_CALLS + n  # always a new prompt
                stored += cache.store(cache.keyed(tokens(p, PROMPT_BLOCKS)), kv(p, PROMPT_BLOCKS))
                loaded += serve(cache, on_disk[n % len(on_disk)], PROMPT_BLOCKS).blocks
            with lock:
                counts["stored"] += stored
                counts["loaded"] += loaded
                counts["calls"] += 2 * FLOOD_CALLS

        rss = []
        for round_ in range(FLOOD_ROUNDS):
            Threads([lambda t=t, r=round_: flood(t, r) for t in range(FLOOD_THREADS)]).start().join()
            rss.append(rss_bytes())
        for h in holds:
            h.release()
        pins, reserved = _pins_left(cache), _host_reserved(cache)
        recovered = serve(cache, on_disk[0], PROMPT_BLOCKS)  # with the pins gone, disk blocks load again
    growth = rss[-1] - rss[0]  # after the first round: allocator and caches warmed up
    figures = {
        "host_blocks_pinned": pinned,
        "calls": counts["calls"],
        "stored": counts["stored"],
        "loaded": counts["loaded"],
        "rss_growth_bytes": growth,
        "pins_after": pins,
        "reservations_after": reserved,
        "loaded_after_release": recovered.blocks,
    }
    held = (
        pinned == FLOOD_HOST_BLOCKS
        and counts["calls"] == 2 * FLOOD_THREADS * FLOOD_CALLS * FLOOD_ROUNDS
        and counts["stored"] == counts["loaded"] == 0
        and growth < RSS_BOUND
        and pins == reserved == recovered.wrong == 0
        and recovered.blocks == PROMPT_BLOCKS
    )
    return FaultOutcome(
        Fault.MEMORY_FLOOD,
        injected=(
            f"host memory ({FLOOD_HOST_BLOCKS} blocks) pinned full by held loads; {FLOOD_THREADS} threads x "
            f"{FLOOD_ROUNDS} rounds x {FLOOD_CALLS} stores of new prompts and loads of disk-resident ones"
        ),
        outcome=(
            f"all {counts['calls']} calls answered at once: nothing stored, every load a miss (no slot to land "
            f"in), no retry; RSS grew {growth} B over the last {FLOOD_ROUNDS - 1} rounds; once released, "
            "disk blocks loaded again"
        ),
        held=held,
        wrong_bytes_served=recovered.wrong,
        figures=figures,
    )


__all__ = ["blind_to_last_token", "evict_while_reading", "memory_flood", "same_hash_writers", "writer_process"]
