"""Prompt-lookup drafts in the engine's step: which requests carry drafts, and which drafts are kept.

:mod:`kvtier.engine.speculate` proposes; this runs the proposals. Each
draft is one more decode row of the same forward; row *i* holds the logits
after draft *i-1* (row 0: after the last real token), so the tokens kept are
exactly those one-token steps would have produced, up to the first draft
the model disagrees with. The K/V written for the drafts after that one lie
past ``table.num_tokens``: their pages were reserved at admission anyway,
nothing reads past ``num_tokens``, and the next forward writes over them.
"""

from __future__ import annotations

import torch

from kvtier.engine import quant
from kvtier.engine.request import Request, SpeculationCounters, StepOutput
from kvtier.engine.speculate import PromptLookup
from kvtier.engine.stopping import Stopping


class Drafting:
    def __init__(self, lookup: PromptLookup, stopping: Stopping) -> None:
        self.lookup = lookup
        self.stopping = stopping
        self.counters = SpeculationCounters()

    def draft(self, batch: list[Request]) -> dict[Request, list[int]]:
        """Drafts for the greedy decoding requests, oldest first, while the step stays a quantized decode step.

        A decode step's rows all go through the GGUF-block matmuls only up to
        :data:`~kvtier.engine.quant.MAX_ROWS`; past that every row would take
        the dense path, slower and rounded differently. A sampled request gets
        none: accepting drafts would need its distribution, not one argmax.
        """
        decodes = [r for r in batch if not r.prefilling]
        room = quant.MAX_ROWS - len(decodes)
        drafts: dict[Request, list[int]] = {}
        for req in decodes:
            if room <= 0:
                break
            if not req.params.greedy:
                continue
            left = min(req.params.max_tokens - len(req.output_ids), self.stopping.context_length - len(req.all_ids))
            width = req.draft_width or self.lookup.num_draft_tokens
            proposed = self.lookup.propose(req.all_ids, min(left - 1, room, width))  # its own token comes too
            if proposed:
                drafts[req] = proposed
                room -= len(proposed)
        return drafts

    def verify(self, req: Request, drafts: list[int], rows: list[torch.Tensor]) -> StepOutput:
        """Keep the drafts equal to the model's greedy choice, then its own next token; uncount the rest."""
        tokens: list[int] = []
        for i, row in enumerate(rows):
            tokens.append(req.sampler(row))
            if i == len(drafts) or tokens[-1] != drafts[i]:
                break
        out = self.stopping.advance_all(req, tokens)
        req.table.num_tokens = min(req.table.num_tokens, len(req.all_ids) - 1)  # the last token's K/V is next step's
        counters = self.counters
        counters.verify_steps += 1
        counters.drafted += len(drafts)
        counters.accepted += len(tokens) - 1
        width = req.draft_width or self.lookup.num_draft_tokens
        req.draft_width = self.lookup.adapt(width, len(drafts), len(tokens) - 1)
        return out
