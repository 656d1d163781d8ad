"""How one step's token budget is shared between prompts being prefilled (policy only: no state, no tensors).

A step runs one forward over at most ``budget`` new tokens. Decoding
requests take one token each and always run (a decode cannot be split, and
stalling it would stall a stream a client is reading). What is left goes to
prompt chunks:

* **Shortest remaining prefill first.** A 2-token request that arrives while
  an 8,000-token prompt is being prefilled is served in the next step instead
  of after the whole long prefill; a burst of equal prompts is served in
  arrival order (ties go to the earlier admission), so the first one's first
  token comes after about its own prefill, not the burst's.
* **A step that owes first tokens stays short.** When some prompts finish in
  this step, the others get at most as many tokens as those prompts take:
  the step costs about twice what the finishing prompts would cost alone,
  where filling the budget would make a 2-token request wait a whole long
  chunk for its first token.
* **The oldest prompt always progresses.** If it got less than a quarter of
  the budget in the previous step, it gets that quarter before anyone else,
  so a steady stream of short prompts cannot starve a long one.
* **No tiny last chunk for a prompt alone.** A lone prompt whose rest is at
  most a quarter of the budget over it takes it in one step: a second
  forward for a few dozen tokens would cost its fixed overhead for nothing,
  and nobody else is waiting for the step to end.
* **Chunks end on block boundaries** when they are not a prompt's last: the
  blocks a chunk completes can be stored and shared at once, instead of
  waiting for the next chunk to fill a half-done block.
"""

from __future__ import annotations

from collections.abc import Sequence

OLDEST_SHARE = 4  # a starved oldest prefill is granted budget // OLDEST_SHARE tokens


def prefill_budget(budget: int, decodes: int, block_size: int) -> int:
    """Tokens left for prompt chunks once every decoding request has its one token (never below a block)."""
    return max(budget - decodes, block_size)


def oldest_share(budget: int) -> int:
    """What the oldest prompt is owed per step; less than this in one step makes it starved in the next."""
    return max(1, budget // OLDEST_SHARE)


def prefill_chunks(
    remaining: Sequence[int], starts: Sequence[int], budget: int, block_size: int, *, oldest_starved: bool = False
) -> list[int]:
    """Tokens each prefilling request computes this step; requests in admission order, oldest first.

    ``remaining[i]`` prompt tokens are left to compute, from position
    ``starts[i]``. The grants add up to at most ``budget``; a request may get 0.
    """
    n = len(remaining)
    grant = [0] * n
    if n == 0 or budget <= 0:
        return grant
    if n == 1 and remaining[0] <= budget + oldest_share(budget):
        return [remaining[0]]
    if oldest_starved:
        grant[0] = min(remaining[0], oldest_share(budget))
    left = budget - grant[0]
    order = sorted(range(n), key=lambda i: (remaining[i] - grant[i], i))
    for i in order:  # prompts that can finish in this step, shortest first
        need = remaining[i] - grant[i]
        if need > left:
            break
        grant[i] += need
        left -= need
    finishing = sum(g for g, r in zip(grant, remaining, strict=True) if g == r)
    rest = min(left, finishing) if finishing else left
    for i in order:  # the others, shortest first, within what a step owing first tokens allows
        take = min(remaining[i] - grant[i], rest)
        grant[i] += take
        rest -= take
    return [_align(g, r, s, block_size) for g, r, s in zip(grant, remaining, starts, strict=True)]


def _align(grant: int, remaining: int, start: int, block_size: int) -> int:
    """Cut a chunk that does not finish its prompt back to the last block boundary it crosses."""
    if grant >= remaining:
        return grant
    end = (start + grant) // block_size * block_size
    return end - start if end > start else grant
