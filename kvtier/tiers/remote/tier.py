"""The remote tier: blocks in a Redis or Valkey (standalone or cluster) that every node of a deployment shares.

One key per block: ``remote.key_prefix`` + the block key in hex. A block key
is already a keyed hash of the model, layout, namespace and tokens
(:mod:`kvtier.keys`), so a key name reveals no token, and two namespaces
never meet under one name. Values are framed and authenticated
(:mod:`kvtier.tiers.remote.frame`) and treated as hostile until checked.

Shape of the calls, each bounded by ``remote.timeout_ms`` and behind a
per-node circuit breaker (:mod:`kvtier.tiers.remote.nodes`):

* :meth:`RemoteTier.probe` (at lookup): one pipelined ``GETRANGE`` of the
  header per key and node. An authentic header is remembered as the block's
  :class:`BlockRecord`, so the manager confirms it against the request's
  tokens like any other tier's record, before a payload byte moves.
* :meth:`RemoteTier.get_many` (on a fetch): pipelined ``GET`` per node;
  each value's header is checked before its payload lands in its host
  slot, and the payload is authenticated as it lands
  (:mod:`kvtier.tiers.remote.receiver`). Hits have their TTL refreshed
  behind the request.
* :meth:`RemoteTier.put_many`: never on the caller's time. Payloads are
  copied onto a bounded queue and framed and written (``SET .. PX ttl``) by
  the tier's writer thread (:mod:`kvtier.tiers.remote.writer`); a full queue
  drops the block, counted.

A failure of any kind is a miss, counted in :attr:`RemoteTier.stats`; nothing
here raises into a request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

import torch

from kvtier.config import RemoteConfig
from kvtier.keys import BlockDigest, BlockKey, Secret
from kvtier.layout import KVLayout
from kvtier.stats import RemoteSnapshot, RemoteStats
from kvtier.tiers.base import BlockRecord, TierKind
from kvtier.tiers.remote.frame import HEADER_BYTES, FrameError, Framer, layout_id
from kvtier.tiers.remote.nodes import Nodes, RespReader, is_error
from kvtier.tiers.remote.receiver import MAC_STEP, Receiver
from kvtier.tiers.remote.writer import STOP_WAIT_S, Writer

PROBE_FIRST = 4  # keys in the first probe of a run; each next probe asks for 4x more
SEEN_MAX = 65_536  # authentic headers remembered from probes (~100 B each)
READ_CHUNK = 8  # blocks per round trip of a read: Redis streams a few large replies faster than many


class RemoteTier:
    kind = TierKind.REMOTE

    def __init__(
        self, config: RemoteConfig, layout: KVLayout, framer: Framer, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.layout = layout
        self.stats = RemoteStats()
        self.write_on = config.write_on
        self._framer = framer
        self._prefix = config.key_prefix.encode()
        self._nodes = Nodes(config, self.stats, clock)
        self._seen: OrderedDict[BlockKey, BlockRecord] = OrderedDict()
        self._seen_lock = threading.Lock()
        self._receiver = Receiver(framer, self.stats)
        self._writer = Writer(config, self._nodes, framer, self.stats, self.name, layout.block_bytes)

    @classmethod
    def open(
        cls,
        config: RemoteConfig,
        layout: KVLayout,
        secret: Secret,
        model_fingerprint: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> RemoteTier:
        """The tier for one deployment (``secret``: its MAC key) and one model and KV layout."""
        lid = layout_id(model_fingerprint, layout.descriptor, layout.block_bytes)
        return cls(config, layout, Framer(secret.remote_mac_key, lid, layout.block_bytes), clock=clock)

    def name(self, key: BlockKey) -> bytes:
        """The Redis key of block ``key``: the prefix and the key's hex (a keyed hash: it reveals no token)."""
        return self._prefix + key.hex().encode()

    # -- sizes: a shared store has no capacity of ours to report ---------------------------------
    @property
    def capacity_blocks(self) -> int:
        return 0

    @property
    def slot_bytes(self) -> int:
        return self._framer.value_bytes

    def __len__(self) -> int:
        with self._seen_lock:
            return len(self._seen)

    def free_blocks(self) -> int:
        return 0

    # -- what the last probes saw ------------------------------------------------------
    def contains(self, key: BlockKey) -> bool:
        with self._seen_lock:
            return key in self._seen

    def record(self, key: BlockKey) -> BlockRecord | None:
        """The authentic header a probe saw for ``key`` (a hint: the value may have expired since)."""
        with self._seen_lock:
            return self._seen.get(key)

    def keys(self) -> list[BlockKey]:
        """The keys the last probes found: what other nodes hold is theirs to report."""
        with self._seen_lock:
            return list(self._seen)

    def confirm(self, key: BlockKey, digest: BlockDigest) -> bool | None:
        record = self.record(key)
        return None if record is None else record.matches(digest)

    def _remember(self, key: BlockKey, record: BlockRecord | None) -> None:
        with self._seen_lock:
            if record is None:
                self._seen.pop(key, None)
                return
            self._seen[key] = record
            self._seen.move_to_end(key)
            while len(self._seen) > SEEN_MAX:
                self._seen.popitem(last=False)

    # -- probe (lookup) ----------------------------------------------------------------
    def probe(self, keys: Sequence[BlockKey]) -> list[BlockRecord | None]:
        """Read the headers of ``keys`` (one round trip per node): the authentic records, None where absent or bad."""
        names = [self.name(k) for k in keys]
        out: list[BlockRecord | None] = [None] * len(keys)
        for node, at in self._nodes.route(names).items():
            # EXISTS beside each read, in the same round trip: GETRANGE answers b"" for an absent key and
            # for an empty value alike, and only the second is a value to refuse (and count)
            asks = [c for i in at for c in (("GETRANGE", names[i], 0, HEADER_BYTES - 1), ("EXISTS", names[i]))]
            replies = self._nodes.pipeline(node, asks)
            for j, i in enumerate(at):
                head, exists = (None, 0) if replies is None else (replies[2 * j], replies[2 * j + 1])
                out[i] = self._header(keys[i], head, exists == 1)
        self.stats.add(probes=len(keys))
        for key, record in zip(keys, out, strict=True):
            self._remember(key, record)
        return out

    def probe_run(self, keys: Sequence[BlockKey]) -> int:
        """Probe ``keys`` in order, in chunks of 4, 16, 64 ... keys, until one is absent; how many lead.

        A prompt the remote has never seen (the common case) costs one round
        trip of four small reads, while a long cached prefix still needs only
        a few round trips.
        """
        at, size = 0, PROBE_FIRST
        while at < len(keys):
            found = self.probe(keys[at : at + size])
            lead = next((i for i, r in enumerate(found) if r is None), len(found))
            at += lead
            if lead < len(found):
                break
            size *= 4
        return at

    def _header(self, key: BlockKey, reply: object, exists: bool) -> BlockRecord | None:
        """The authentic record in ``reply``, the first bytes of the value under ``key``'s name; None if none.

        An empty ``reply`` is an absent key, or an empty value (a refusal, counted) where ``exists``.
        """
        if reply is None or is_error(reply) or (not reply and not exists):  # failed, another type, or absent
            return None
        try:
            return self._framer.header(key, reply).record  # type: ignore[arg-type]
        except FrameError as err:
            self.stats.add(**{err.why.value: 1})
            return None

    # -- reads -------------------------------------------------------------------------
    def get(self, key: BlockKey, out: torch.Tensor) -> bool:
        return self.get_many([key], [out])[0]

    def get_many(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[bool]:
        """Read, check and copy each block into its ``out``; False (counted) for any that cannot be served.

        A block is served only if a probe saw its authentic header (whose
        digest the manager confirmed against the request's tokens) and the
        value read now carries the same digest and a payload that matches
        its header's tag. Payloads go from the socket straight into ``outs``
        (:meth:`Nodes.get_into`) and are authenticated as they land (:meth:`Receiver.receive`).
        """
        expect = [self.record(k) for k in keys]
        names = [self.name(k) for k in keys]
        ok = [False] * len(keys)
        want = [i for i, r in enumerate(expect) if r is not None]
        for node, at in self._nodes.route([names[i] for i in want]).items():
            idx = [want[a] for a in at]
            for c in range(0, len(idx), READ_CHUNK):
                part = idx[c : c + READ_CHUNK]

                def sink(pos: int, length: int, reader: RespReader, part: list[int] = part) -> bool:
                    i = part[pos]
                    ok[i] = self._receiver.receive(keys[i], length, reader, expect[i], outs[i])
                    return ok[i]

                if self._nodes.get_into(node, [names[i] for i in part], sink) is None:
                    break  # the node failed (counted): its later chunks would too
        for i in want:
            if not ok[i]:
                self._remember(keys[i], None)
        hits = [names[i] for i in range(len(keys)) if ok[i]]
        self.stats.add(bytes_read=len(hits) * self.layout.block_bytes)
        if hits:
            self._writer.touch(hits)
        return ok

    # -- writes (behind the request) -------------------------------------------------------
    def put(self, key: BlockKey, payload: torch.Tensor, record: BlockRecord) -> bool:
        return self.put_many([key], [payload], [record])[0]

    def put_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[torch.Tensor], records: Sequence[BlockRecord]
    ) -> list[bool]:
        """Queue copies of the blocks for the writer thread; False (counted as dropped) where the queue is full.

        True means queued, not written: a write that fails later is counted
        in ``dropped_writes`` too. A block a probe just saw there with the same
        tokens is not written again (its TTL is refreshed on hit instead).
        """
        out = []
        for key, payload, record in zip(keys, payloads, records, strict=True):
            seen = self.record(key)
            if seen is not None and seen.matches(record.digest):
                out.append(True)
                continue
            out.append(self._writer.put(key, payload, record))
        return out

    def flush(self, timeout_s: float = STOP_WAIT_S) -> bool:
        """Wait until everything queued so far went out (or failed, counted); False on timeout."""
        return self._writer.flush(timeout_s)

    # -- removal -----------------------------------------------------------------------
    def remove(self, key: BlockKey) -> bool:
        return self.remove_many([key]) == 1

    def remove_many(self, keys: Sequence[BlockKey]) -> int:
        names = [self.name(k) for k in keys]
        for k in keys:
            self._remember(k, None)
        removed = 0
        for node, at in self._nodes.route(names).items():
            replies = self._nodes.pipeline(node, [("DEL", names[i]) for i in at])
            removed += 0 if replies is None else sum(r == 1 for r in replies)
        return removed

    def entries(self) -> Iterator[tuple[BlockKey, BlockRecord]]:
        """None: a shared store is never enumerated (it holds other nodes' blocks, and may hold millions)."""
        return iter(())

    def breakers(self) -> dict[str, str]:
        """Each node's circuit breaker state, by node name."""
        return self._nodes.breakers()

    def snapshot(self) -> RemoteSnapshot:
        return self.stats.snapshot(
            breakers=self.breakers(),
            breaker_opens=sum(n.breaker.opened for n in self._nodes.all),
            write_queue=self._writer.waiting(),
        )

    def close(self) -> None:
        """Let queued writes drain for a bounded time, stop the writer, close the connections."""
        self._writer.close()
        self._nodes.close()


__all__ = ["MAC_STEP", "RemoteTier"]  # MAC_STEP is the receiver's, still importable from here
