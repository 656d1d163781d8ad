"""What one request is while the engine runs it, and what the engine reports about its work.

The engine's parts (admission, publishing, drafting, stopping) all read and
update the same :class:`Request`; it lives here, apart from any of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from kvtier.breakeven import FetchPlan
from kvtier.cache import Fetching
from kvtier.engine.pool import BlockTable
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.keys import BlockKey, KeyedTokens
from kvtier.model.tokenizer import StreamDecoder
from kvtier.tiers.base import TierKind


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ERROR = "error"
    ABORT = "abort"  # the caller gave up on it (a client that disconnected); nobody reads its output


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    id: str
    prompt: KeyedTokens  # the prompt with its blocks' keys, hashed once for the request's whole way
    params: SamplingParams
    sampler: Sampler
    decoder: StreamDecoder
    arrival: float
    prompt_ids: list[int] = field(default_factory=list)
    chain: KeyedTokens | None = None  # prompt + reply keyed so far (extended as the reply fills blocks)
    table: BlockTable = field(default_factory=BlockTable)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    cached_tokens: int = 0
    served_from: dict[TierKind, int] = field(default_factory=dict)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None  # the stop string that ended it, where one did
    error: str | None = None
    stored_blocks: int = 0  # leading blocks known to be in kvtier already
    shared_blocks: int = 0  # leading prompt blocks published in the pool for other requests to attach
    partial_blocks: set[int] = field(default_factory=set)  # table blocks whose sliding-window layers never loaded
    last_chunk: int | None = None  # prompt tokens the previous step gave it (None: not planned yet)
    fetch: Fetching | None = None  # started on arrival, taken on admission
    fetch_plan: FetchPlan | None = None  # what the break-even model decided on arrival
    draft_width: int | None = None  # drafts its next step may carry (prompt lookup; None: not drafted for yet)
    verify_span: tuple[int, int] | None = None  # blocks loaded from kvtier that shadow verification checks

    def __post_init__(self) -> None:
        self.prompt_ids = self.prompt.tokens.tolist()
        self.chain = self.prompt

    @property
    def namespace(self) -> str:
        return self.prompt.namespace

    @property
    def keys(self) -> list[BlockKey]:
        """The prompt's full blocks' keys."""
        return self.prompt.keys

    @property
    def blocks(self) -> np.ndarray:
        """The prompt's full blocks' tokens, ``[n, block_size]``."""
        return self.prompt.blocks

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def keyed_through(self, blocks: int) -> KeyedTokens:
        """Prompt + reply keyed through ``blocks`` full blocks at least: only blocks not keyed yet are hashed."""
        assert self.chain is not None
        if self.chain.num_blocks < blocks:
            self.chain = self.chain.extend(self.all_ids[: blocks * self.prompt.hasher.block_size])
        return self.chain

    @property
    def prefilling(self) -> bool:
        """Admitted, with prompt tokens still to compute (its first token is not sampled yet)."""
        return self.first_token_at is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


@dataclass
class PrefetchCounters:
    """What the arrival-time fetches did, since the engine started (the server reports them in /stats)."""

    started: int = 0  # fetches started on arrival
    blocks_planned: int = 0  # blocks the break-even model chose to fetch
    blocks_used: int = 0  # blocks that landed in time and were copied into the pool
    deadline_missed: int = 0  # fetches cut short by their deadline (the rest was recomputed)
    recompute_chosen: int = 0  # requests whose cached blocks were cheaper to recompute than to fetch
    cancelled: int = 0  # fetches dropped because the pool already held the prefix


@dataclass
class SpeculationCounters:
    """What prompt-lookup drafting did, since the engine started (the server reports them in /stats)."""

    verify_steps: int = 0  # request-steps that carried drafts
    drafted: int = 0  # draft tokens run through the model
    accepted: int = 0  # of those, tokens equal to the model's own choice (kept)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    token_ids: list[int]  # new this step
    text: str  # new this step (stop strings already cut)
    finished: bool
    finish_reason: FinishReason | None = None
    cached_tokens: int | None = None  # with a request's first token: its prompt tokens served from cache


@dataclass(frozen=True)
class Completion:
    request_id: str
    prompt_tokens: int
    cached_tokens: int
    served_from: dict[TierKind, int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft_s: float
    total_s: float
    stop_sequence: str | None = None  # the stop string that ended it, where one did
