"""The remote tier's write-behind path: blocks go out on the tier's own thread, never on a request's time.

A block to store is copied onto a bounded queue (the host slot it came from
may be reused at once) and a full queue drops it, counted: a request never
waits on the remote to store. The writer thread takes what is queued in
batches, frames each value (:mod:`kvtier.tiers.remote.frame`) and writes it
(``SET .. PX ttl``), one pipeline per node (:mod:`kvtier.tiers.remote.nodes`).
The TTL refresh of blocks just read (``PEXPIRE``) rides the same queue, so a
hit costs its request no round trip either.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.config import RemoteConfig
from kvtier.keys import BlockKey
from kvtier.stats import RemoteStats
from kvtier.tiers.base import BlockRecord
from kvtier.tiers.remote.frame import Framer
from kvtier.tiers.remote.nodes import Command, Nodes

log = logging.getLogger("kvtier")

WRITE_BATCH = 8  # blocks one writer round trip carries at most
STOP_WAIT_S = 5.0  # how long close() lets queued writes drain


@dataclass(frozen=True)
class _Write:
    key: BlockKey
    record: BlockRecord
    value: bytearray  # the payload copied in (the host slot it came from may be reused at once); header to seal


@dataclass(frozen=True)
class _Touch:
    names: list[bytes]  # keys just read: their TTL starts again


@dataclass(frozen=True)
class _Marker:
    done: threading.Event  # set by the writer once everything queued before it went out


_Item = _Write | _Touch | _Marker


class Writer:
    """The queue of blocks and TTL refreshes bound for the remote, and the one thread that sends them."""

    def __init__(
        self,
        config: RemoteConfig,
        nodes: Nodes,
        framer: Framer,
        stats: RemoteStats,
        name: Callable[[BlockKey], bytes],
        block_bytes: int,
    ) -> None:
        self._nodes = nodes
        self._framer = framer
        self._stats = stats
        self._name = name  # the tier's naming of a block's Redis key, the one the reads use
        self._block_bytes = block_bytes
        self._ttl_ms = max(1, round(config.ttl_s * 1000))
        self._queue: queue.Queue[_Item | None] = queue.Queue(config.write_queue_blocks)
        self._thread = threading.Thread(target=self._write_loop, name="kvtier-remote-writer", daemon=True)
        self._thread.start()

    def put(self, key: BlockKey, payload: torch.Tensor, record: BlockRecord) -> bool:
        """Queue a copy of the block; False (counted as dropped) where the queue is full."""
        value = self._framer.blank()  # the payload's one copy, already where the value will have it
        np.copyto(self._framer.payload_of(value), payload.reshape(-1).view(torch.uint8).numpy())
        queued = self._enqueue(_Write(key, record, value))
        if not queued:
            self._stats.add(dropped_writes=1)
        return queued

    def touch(self, names: list[bytes]) -> None:
        """Start again the TTL of the values ``names`` (just read), behind the request; skipped on a full queue."""
        self._enqueue(_Touch(names))

    def waiting(self) -> int:
        """Items queued and not yet taken by the writer thread."""
        return self._queue.qsize()

    def _enqueue(self, item: _Item) -> bool:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        return True

    def _write_loop(self) -> None:
        """The writer thread: up to :data:`WRITE_BATCH` queued items per round trip per node, until closed."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < WRITE_BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._write(batch)
                    return
                batch.append(more)
            self._write(batch)

    def _write(self, batch: list[_Item]) -> None:
        writes = [w for w in batch if isinstance(w, _Write)]
        values = [self._framer.seal(w.key, w.record, w.value) for w in writes]
        names = [self._name(w.key) for w in writes]
        touched = [n for t in batch if isinstance(t, _Touch) for n in t.names]
        ttl = self._ttl_ms
        for node, at in self._nodes.route(names + touched).items():
            sets = [i for i in at if i < len(names)]
            touches = [touched[i - len(names)] for i in at if i >= len(names)]
            commands: list[Command] = [("SET", names[i], values[i], "PX", ttl) for i in sets]
            commands += [("PEXPIRE", n, ttl) for n in touches]
            replies = self._nodes.pipeline(node, commands)
            done = 0 if replies is None else sum(r is True for r in replies[: len(sets)])
            self._stats.add(writes=done, dropped_writes=len(sets) - done, bytes_written=done * self._block_bytes)
        for item in batch:
            if isinstance(item, _Marker):
                item.done.set()

    def flush(self, timeout_s: float = STOP_WAIT_S) -> bool:
        """Wait until everything queued so far went out (or failed, counted); False on timeout."""
        deadline = time.monotonic() + timeout_s
        done = threading.Event()
        try:
            self._queue.put(_Marker(done), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Let queued writes drain for a bounded time, then stop the writer thread (the connections stay open)."""
        try:
            self._queue.put(None, timeout=STOP_WAIT_S)
        except queue.Full:
            log.warning("remote tier: the write queue did not drain in %.0f s; dropping what is left", STOP_WAIT_S)
            self._drain_queue()
            self._queue.put_nowait(None)
        self._thread.join(STOP_WAIT_S)

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Write):
                self._stats.add(dropped_writes=1)
            elif isinstance(item, _Marker):
                item.done.set()
