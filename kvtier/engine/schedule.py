"""How one step's token budget is shared between prompts being prefilled (policy only: no state, no tensors).

A step runs one forward over at most ``budget`` new tokens. Decoding
requests take one token each and always run (a decode cannot be split, and
stalling it would stall a stream a client is reading). What is left goes to
prompt chunks:

* **Shortest remaining prefill first.** A 2-token request that arrives while
  an 8,000-token prompt is being prefilled gets its first token in the next
  step instead of after the whole long prefill; a burst of equal prompts is
  served in arrival order (ties go to the earlier admission), so the first
  one's first token comes after about its own prefill, not the burst's.
* **The oldest prompt always progresses.** It is granted a quarter of the
  budget before anyone else, so a steady stream of short prompts cannot
  starve a long one.
* **Chunks end on block boundaries** when they are not a prompt's last: the
  blocks a chunk completes can be stored and shared at once, instead of
  waiting for the next chunk to fill a half-done block.
"""

from __future__ import annotations

from collections.abc import Sequence

OLDEST_SHARE = 4  # the oldest prefill is guaranteed budget // OLDEST_SHARE tokens per step


def prefill_budget(budget: int, decodes: int, block_size: int) -> int:
    """Tokens left for prompt chunks once every decoding request has its one token (never below a block)."""
    return max(budget - decodes, block_size)


def prefill_chunks(remaining: Sequence[int], starts: Sequence[int], budget: int, block_size: int) -> list[int]:
    """Tokens each prefilling request computes this step; requests in admission order, oldest first.

    ``remaining[i]`` prompt tokens are left to compute, from position
    ``starts[i]``. The grants add up to at most ``budget``; a request may get 0.
    """
    n = len(remaining)
    grant = [0] * n
    if n == 0 or budget <= 0:
        return grant
    grant[0] = min(remaining[0], max(1, budget // OLDEST_SHARE))
    left = budget - grant[0]
    for i in sorted(range(n), key=lambda i: (remaining[i] - grant[i], i)):
        if left <= 0:
            break
        take = min(remaining[i] - grant[i], left)
        grant[i] += take
        left -= take
    return [_align(g, r, s, block_size) for g, r, s in zip(grant, remaining, starts, strict=True)]


def _align(grant: int, remaining: int, start: int, block_size: int) -> int:
    """Cut a chunk that does not finish its prompt back to the last block boundary it crosses."""
    if grant >= remaining:
        return grant
    end = (start + grant) // block_size * block_size
    return end - start if end > start else grant
