"""Shadow verification: proof, after the fact, that the KV a hit served is the KV its tokens make.

A hit is confirmed against its tokens before it is served (``index``), and
the disk tier checksums every block, so neither a hash collision nor a torn
write is served. What neither catches is a wrong byte that was wrong before
it was checksummed, or that went bad in host memory: a bug in a copy path, a
bad DIMM, a peer that stored garbage under the right tokens. So a fraction
of the hits served from kvtier's tiers are checked again later: the bytes
that were copied into the engine's pool are kept aside, and when the engine
has nothing else to do the hit's tokens are recomputed from scratch in a
pool of the verifier's own and the two are compared block by block.

Ordering and cost: the copy of the served bytes is taken right after the
forward that onboarded them (full blocks are never written again, so those
bytes are exactly what every later step attended to). The recompute runs
one chunk of ``chunk_tokens`` per call, and the server's engine loop calls
it only while no request is waiting or running, taking new requests
between two chunks: a client waits for at most one chunk, never for a
whole verification. Pending checks wait in a bounded queue; a hit offered
when it is full is dropped and counted, so a busy server spends memory on
at most ``queue_size`` checks.

Tolerance: a recompute of the same tokens is not bitwise identical to the
served KV on this CPU (other batch company, other chunk boundaries change
the matmul blocking; bench/README.md quotes how close it is), so a block
matches when its largest absolute difference is within a dtype-dependent
fraction of the block's largest magnitude. A NaN or an infinity anywhere
never matches. Corruption smaller than the recompute's own noise cannot be
told from it; anything that changes an exponent or a sign of a value that
matters is far above it.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from kvtier.engine.llama import LlamaModel, SeqInput
from kvtier.engine.onboard import SlidingWindow
from kvtier.engine.pool import BlockTable, KVPool
from kvtier.engine.request import Request
from kvtier.keys import BlockKey
from kvtier.tiers.base import TierKind

log = logging.getLogger(__name__)

# The largest |recomputed - served| a matching block may show, as a fraction of the block's largest |value|
# (at least 1). Each sits well above the recompute noise measured on the development CPU (bench/README.md,
# "Shadow verification") and far below what a flipped exponent or sign bit of a value that matters makes.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 2**-3,
    torch.float16: 2**-5,
    torch.int8: 2**-4,  # a quant a step off (1/127 of its row's largest) from last-bit differences before rounding
    torch.float8_e4m3fn: 2**-3,  # likewise: an e4m3 step next to its row's largest is 1/14 of it
}


class Verdict(enum.Enum):
    MATCH = "match"
    MISMATCH = "mismatch"


@dataclass(frozen=True)
class Check:
    """One sampled hit: the tokens that make its KV and the bytes that were served for blocks ``first ..``."""

    namespace: str
    tokens: list[int]  # the prompt through the last checked block
    first_block: int
    keys: list[BlockKey]  # of the checked blocks, in order
    served: torch.Tensor  # uint8 ``[len(keys), block_bytes]``, copied out of the engine pool
    tiers: tuple[TierKind, ...]  # where the hit came from (for the log)
    unserved: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> layers never loaded (windowed)


@dataclass(frozen=True)
class BlockVerdict:
    key: BlockKey
    block: int  # the block's index in its prompt
    verdict: Verdict
    error: float  # largest |difference| / the block's largest |value| (nan when the bytes hold a nan)


@dataclass
class VerifyCounters:
    """What shadow verification did since the engine started (the server reports them in /stats)."""

    sampled: int = 0  # hits queued for verification
    dropped: int = 0  # hits sampled while the queue was full (never verified)
    failed: int = 0  # checks whose recompute raised (never verified)
    verified: int = 0  # hits recomputed and compared
    blocks_verified: int = 0
    mismatched_blocks: int = 0  # blocks whose served KV was not what their tokens make
    mismatched_hits: int = 0  # verified hits with at least one mismatched block


@dataclass(frozen=True)
class VerifySettings:
    fraction: float  # of hits served from kvtier's tiers: 0 turns verification off
    queue_size: int
    max_tokens: int  # a hit is checked up to this prompt position (the scratch pool's size)


class _Recompute:
    """One check in progress: the hit's tokens run through the model one chunk at a time in a scratch pool."""

    def __init__(self, check: Check, model: LlamaModel, block_size: int) -> None:
        self.check = check
        self.model = model
        self.pool: KVPool = model.make_pool(block_size, -(-len(check.tokens) // block_size))
        self.table = BlockTable()
        self.pool.grow(self.table, len(check.tokens))

    @property
    def done(self) -> bool:
        return self.table.num_tokens >= len(self.check.tokens)

    def advance(self, chunk_tokens: int) -> None:
        start = self.table.num_tokens
        chunk = self.check.tokens[start : start + chunk_tokens]
        self.model([SeqInput(chunk, start, self.table)], self.pool)
        self.table.num_tokens = start + len(chunk)

    def verdicts(self) -> list[BlockVerdict]:
        check = self.check
        out = torch.empty(self.pool.layout.block_bytes, dtype=torch.uint8, device=self.pool.device)
        tolerance = TOLERANCE[self.pool.layout.dtype]
        found = []
        for i, key in enumerate(check.keys):
            block = check.first_block + i
            self.pool.read_block_to_payload(self.table.block_ids[block], out)
            served = check.served[i].to(out.device)
            recomputed, given = self.pool.layout.as_float(out), self.pool.layout.as_float(served)
            skip = check.unserved.get(block, ())
            if skip:  # compare the layers that were served
                kept = [layer for layer in range(recomputed.shape[0]) if layer not in skip]
                recomputed, given = recomputed[kept], given[kept]
            error = _error(recomputed, given)
            verdict = Verdict.MATCH if error <= tolerance else Verdict.MISMATCH  # a nan compares False
            found.append(BlockVerdict(key, block, verdict, error))
        return found


def _error(recomputed: torch.Tensor, served: torch.Tensor) -> float:
    scale = max(served.abs().max().item(), 1.0)
    return (recomputed - served).abs().max().item() / scale


class ShadowVerifier:
    """Samples hits, queues them, and recomputes them a chunk at a time when told the engine is idle."""

    def __init__(self, model: LlamaModel, block_size: int, settings: VerifySettings, chunk_tokens: int) -> None:
        self.model = model
        window = SlidingWindow.of(model.config)
        self.sliding_layers = tuple(sorted(window.layers)) if window is not None else ()  # what a windowed hit skips
        self.block_size = block_size
        self.settings = settings
        self.chunk_tokens = max(chunk_tokens, block_size)
        self.counters = VerifyCounters()
        self._queue: deque[Check] = deque()
        self._current: _Recompute | None = None
        self._credit = 0.0

    @property
    def max_blocks(self) -> int:
        return self.settings.max_tokens // self.block_size

    def sample(self) -> bool:
        """Whether this hit is checked: every (1/fraction)-th hit, deterministically (no random draw)."""
        self._credit += self.settings.fraction
        if self._credit < 1.0:
            return False
        self._credit -= 1.0
        return True

    def room(self) -> bool:
        """Whether a sampled hit can be queued; False is counted as a drop (asked before copying its bytes)."""
        if len(self._queue) < self.settings.queue_size:
            return True
        self.counters.dropped += 1
        return False

    def offer(self, check: Check) -> None:
        """Queue a sampled hit (after :meth:`room` said yes)."""
        self._queue.append(check)
        self.counters.sampled += 1

    @property
    def pending(self) -> bool:
        return self._current is not None or bool(self._queue)

    def step(self) -> list[BlockVerdict]:
        """Run one chunk of the oldest pending check; its verdicts once its last chunk ran, else []."""
        if self._current is None:
            if not self._queue:
                return []
            try:
                self._current = _Recompute(self._queue.popleft(), self.model, self.block_size)
            except (RuntimeError, MemoryError):
                log.exception("no scratch pool for shadow verification; one hit is dropped")
                self.counters.failed += 1
                return []
        current = self._current
        try:
            current.advance(self.chunk_tokens)
        except (RuntimeError, MemoryError):  # a scratch pool that does not fit, a failed kernel: skip this check
            log.exception("shadow verification of one hit failed; it is dropped")
            self._current = None
            self.counters.failed += 1
            return []
        if not current.done:
            return []
        self._current = None
        verdicts = current.verdicts()
        self._count(current.check, verdicts)
        return verdicts

    def drain(self) -> list[BlockVerdict]:
        """Every pending check to the end (tests and ``kvtier generate``, which have no idle loop)."""
        found: list[BlockVerdict] = []
        while self.pending:
            found += self.step()
        return found

    def _count(self, check: Check, verdicts: list[BlockVerdict]) -> None:
        c = self.counters
        bad = [v for v in verdicts if v.verdict is Verdict.MISMATCH]
        c.verified += 1
        c.blocks_verified += len(verdicts)
        c.mismatched_blocks += len(bad)
        c.mismatched_hits += bool(bad)
        tiers = ",".join(t.value for t in check.tiers)
        for v in bad:  # the key and the position only: never the tokens
            log.warning(
                "shadow verification: block %d (key %s, served from %s) differs from its recompute (error %.3g)",
                v.block,
                v.key.hex(),
                tiers,
                v.error,
            )


__all__ = ["BlockVerdict", "Check", "ShadowVerifier", "Verdict", "VerifyCounters", "VerifySettings"]


def offer_served(verifier: ShadowVerifier, pool: KVPool, batch: list[Request]) -> None:
    """After the forward that onboarded them: copy the sampled hits' pool blocks aside for the verifier.

    Copied now, while the request still holds its pages: what is checked
    later is exactly what the forward read, whatever happens to the pool after.
    """
    bs = pool.layout.block_size
    for req in batch:
        if req.verify_span is None:
            continue
        (first, end), req.verify_span = req.verify_span, None
        if not verifier.room():
            continue
        served = torch.empty((end - first, pool.layout.block_bytes), dtype=torch.uint8)
        for row, block_id in zip(served, req.table.block_ids[first:end], strict=True):
            pool.read_block_to_payload(block_id, row)
        tiers = tuple(kind for kind in req.served_from if kind is not TierKind.DEVICE)
        tokens = req.prompt_ids[: end * bs]
        unserved = {b: verifier.sliding_layers for b in req.partial_blocks if first <= b < end}
        verifier.offer(Check(req.namespace, tokens, first, req.keys[first:end], served, tiers, unserved))
