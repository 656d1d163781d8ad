"""A session's transcript copied into the engine's pool ahead of its next turn (prefetch's last hop).

The device tier (:mod:`kvtier.engine.resident`) keeps finished requests'
blocks in the pool; a turn that finds its transcript there shares those
blocks with no copy at all. Prefetch promotes a session's blocks to host
memory during its tool call; this moves them on into the pool, so the next
turn pays neither the lower-tier read nor the host-to-pool copy.

Runs on the engine thread (``EngineLoop.call``), between two steps: the pool
and the resident index are the engine's and change only there. It only
takes free pool blocks or ones the resident index can give up (never a
running request's), and stops short rather than wait.
"""

from __future__ import annotations

from kvtier.engine.engine import Engine
from kvtier.keys import KeyedTokens


def warm(engine: Engine, transcript: KeyedTokens) -> int:
    """Make the leading full blocks of ``transcript`` resident in the pool, as far as the tiers hold them.

    Returns the leading tokens resident now (what the next turn shares).
    """
    resident, cache = engine.resident, engine.cache
    if resident is None or cache is None:
        return 0
    bs = engine.pool.block_size
    keys, blocks, n = transcript.keys, transcript.blocks, transcript.num_blocks
    window = engine.admission.window  # partial blocks inside the next turn's window are loaded again, whole
    have = resident.peek(keys, blocks, window)
    if have == n:
        return have * bs
    with cache.load(cache.lookup(transcript, first_block=have)) as handle:
        want = len(handle.blocks)
        short = want - engine.pool.num_free
        if short > 0:
            resident.release(short)
        take = min(want, engine.pool.num_free)
        if take == 0:
            return have * bs
        pool_ids = engine.pool.allocate(take)
        for block_id, payload in zip(pool_ids, handle.blocks[:take], strict=True):
            engine.pool.write_block_from_payload(block_id, payload)
        resident.keep(
            keys[have : have + take], pool_ids, blocks[have : have + take], cache.generation, root=transcript.root
        )
        engine.pool.free(pool_ids)  # the resident index holds its own reference now
    return resident.peek(keys, blocks, window) * bs  # making room may have given up some of the leading run
