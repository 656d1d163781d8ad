"""Prompt-lookup drafts: guess the next tokens of a reply by finding its tail earlier in the context.

Agents copy: code they were shown, tool output, earlier turns. When the last
few generated tokens also occur earlier in prompt + output, the tokens that
followed them there are a cheap guess at what comes next (vLLM's ``ngram``
method, HF's ``prompt_lookup_num_tokens``). The engine verifies the guesses
in the same forward that decodes the next token, and keeps only those equal
to the model's own greedy choice, so a wrong guess costs a few extra rows of
one forward and never changes the output.

This module only proposes (policy: no tensors, no pool, no state). The
longest n-gram wins because a longer match is more likely to continue the
same copy; among equal lengths the most recent occurrence wins, because a
reply copying a passage is usually following the latest place it left off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptLookup:
    """How drafts are proposed: up to ``num_draft_tokens`` after a matching ``min_ngram..max_ngram``-token tail."""

    num_draft_tokens: int = 3
    min_ngram: int = 2
    max_ngram: int = 3

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need num_draft_tokens >= 1 and 1 <= min_ngram <= max_ngram, got {self}")

    def propose(self, ids: Sequence[int], limit: int | None = None) -> list[int]:
        """Draft tokens to follow ``ids`` (prompt + output so far); ``[]`` when no tail recurs.

        ``limit`` caps the count below ``num_draft_tokens`` (a request near
        its ``max_tokens``: a verified draft past it would be thrown away).
        """
        want = self.num_draft_tokens if limit is None else min(limit, self.num_draft_tokens)
        if want <= 0 or len(ids) < self.min_ngram + 1:
            return []
        arr = np.asarray(ids, dtype=np.int64)
        for n in range(min(self.max_ngram, len(arr) - 1), self.min_ngram - 1, -1):
            at = _last_match(arr, n)
            if at is not None:
                return arr[at + n : at + n + want].tolist()
        return []

    def adapt(self, width: int, drafted: int, accepted: int) -> int:
        """A request's next draft count: wider while every draft lands, narrower after a miss.

        Copies come in runs: a reply copies a passage, then writes its own
        words. Widening by two while all drafts land reaches a long run's
        pace in a few steps; narrowing by one after a rejection stops paying
        for rows the model throws away between runs (HF's "heuristic" schedule).
        """
        if accepted == drafted:
            return min(width + 2, self.num_draft_tokens)
        return max(1, width - 1)


def _last_match(arr: np.ndarray, n: int) -> int | None:
    """Start of the latest earlier occurrence of ``arr``'s last ``n`` tokens that some token follows."""
    windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # every n-gram that has a successor
    hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
    return int(hits[-1]) if len(hits) else None
