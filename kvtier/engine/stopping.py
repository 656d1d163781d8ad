"""When a request ends: EOS, ``max_tokens``, the context's end, or a stop string, cut where it completes.

Every sampled token passes here once, in order, whichever path produced
it (one decode row, or a run of accepted drafts), so a reply ends at the
same token and with the same text however it was decoded.
"""

from __future__ import annotations

from kvtier.engine.request import FinishReason, Request, StepOutput
from kvtier.model.tokenizer import Tokenizer


class Stopping:
    def __init__(self, tokenizer: Tokenizer, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length

    def advance(self, req: Request, token: int) -> StepOutput:
        """Append ``token`` to ``req``'s output; its new text, and whether the request ends here."""
        req.output_ids.append(token)
        p = req.params
        reason: FinishReason | None = None
        if token in self.tokenizer.eos_ids and not p.ignore_eos:
            piece, reason = req.decoder.finish(), FinishReason.STOP
        else:
            piece = req.decoder.push(token)
            if len(req.output_ids) >= p.max_tokens or len(req.all_ids) >= self.context_length:
                piece, reason = piece + req.decoder.finish(), FinishReason.LENGTH
        piece, stopped = self._cut_at_stop(req, piece)
        if stopped:
            reason = FinishReason.STOP
        req.text += piece
        req.finish_reason = reason
        return StepOutput(req.id, [token], piece, reason is not None, reason)

    def advance_all(self, req: Request, tokens: list[int]) -> StepOutput:
        """:meth:`advance` token by token until the request ends; one output for the lot."""
        outs: list[StepOutput] = []
        for token in tokens:
            outs.append(self.advance(req, token))
            if outs[-1].finished:
                break
        last = outs[-1]
        ids = [t for o in outs for t in o.token_ids]
        return StepOutput(req.id, ids, "".join(o.text for o in outs), last.finished, last.finish_reason)

    @staticmethod
    def _cut_at_stop(req: Request, piece: str) -> tuple[str, bool]:
        """Cut ``piece`` where a stop string first completes (the stop string itself is not returned)."""
        if not req.params.stop or not piece:
            return piece, False
        longest = max(map(len, req.params.stop))
        head = req.text[-(longest - 1) :] if longest > 1 else ""
        window = head + piece
        found = [(i, s) for s in req.params.stop if (i := window.find(s)) >= 0]
        if not found:
            return piece, False
        at, req.stop_sequence = min(found, key=lambda f: f[0])  # the first to complete; at one place, the first given
        return piece[: max(0, at - len(head))], True
