"""The server's answers: OpenAI-compatible responses, and kvtier's stats and admin bodies.

What a client sends to the OpenAI endpoints is :mod:`kvtier.web.requests`,
shared with the router; the admin bodies here build on its messages and
bounds. No request model has a namespace field: the server derives it from
the caller's API key.
"""

from __future__ import annotations

import enum
from typing import Annotated, Literal

from pydantic import BaseModel, Field, model_validator

from kvtier.engine.request import FinishReason
from kvtier.explain import ExplainReason
from kvtier.index import MissReason
from kvtier.pins import MAX_TTL_S, PinTier
from kvtier.tiers.base import TierKind
from kvtier.tiers.breaker import BreakerState
from kvtier.web.requests import MAX_MESSAGES, ChatMessage, RequestBody, SessionId, Text, TokenId


# -- OpenAI responses ------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose prefill was skipped (served from the KV cache).")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Finish(enum.StrEnum):
    """The finish reasons a client can see (an engine error is an error response, not a finish reason)."""

    STOP = "stop"
    LENGTH = "length"

    @classmethod
    def of(cls, reason: FinishReason) -> Finish:
        return cls.LENGTH if reason is FinishReason.LENGTH else cls.STOP


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Finish | None = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Finish
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Finish | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtier"
    context_length: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- the Messages API's responses ------------------------------------------------------
class StopReason(enum.StrEnum):
    END_TURN = "end_turn"  # the model ended its turn (EOS)
    MAX_TOKENS = "max_tokens"  # max_tokens, or the context's end
    STOP_SEQUENCE = "stop_sequence"  # one of stop_sequences (named in stop_sequence)

    @classmethod
    def of(cls, reason: FinishReason, stop_sequence: str | None) -> StopReason:
        if reason is FinishReason.LENGTH:
            return cls.MAX_TOKENS
        return cls.STOP_SEQUENCE if stop_sequence is not None else cls.END_TURN


class CacheCreation(BaseModel):
    """``cache_creation_input_tokens`` by how long they are kept (the longest mark over each block)."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class MessagesUsage(BaseModel):
    """The prompt in three exact parts (they sum to its length) and the reply's tokens.

    ``cache_read_input_tokens``: served from the KV cache, prefill skipped.
    ``cache_creation_input_tokens``: computed now and kept by a ``cache_control``
    mark (whole blocks up to the last breakpoint). ``input_tokens``: the rest.
    """

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = Field(default_factory=lambda: CacheCreation())


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextContent]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class MessagesErrorDetail(BaseModel):
    type: str
    message: str


class MessagesErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: MessagesErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


# -- admin -------------------------------------------------------------------------------
class _PromptOrMessages(RequestBody):
    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    tenant: str | None = Field(None, description="Whose cache; null: the default tenant (only when no API keys).")

    @model_validator(mode="after")
    def _exactly_one(self) -> _PromptOrMessages:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class LookupRequest(_PromptOrMessages):
    """``messages`` are rendered as /v1/chat/completions would (with the assistant turn's opening)."""


class LookupResponse(BaseModel):
    tenant: str
    prompt_tokens: int
    cached_tokens: int = Field(
        description="Leading tokens held in host, disk or the remote tier (when configured), whole blocks only."
    )
    tiers: dict[TierKind, int] = Field(description="Of cached_tokens, how many each tier would serve.")
    miss_reason: MissReason


class PinRequest(_PromptOrMessages):
    """``messages`` are rendered as a prefix (no assistant turn opened), e.g. a shared system prompt."""

    ttl_s: float = Field(ge=0.0, le=MAX_TTL_S, description="Seconds to keep it; 0 unpins.")
    tier: PinTier = Field(
        PinTier.HOST,
        description="Where eviction skips it: host memory, or disk (written through there at once, whatever "
        "cache.write_mode). A pin in one tier never protects the other.",
    )


class PinResponse(BaseModel):
    tenant: str
    pinned_blocks: int
    pinned_tokens: int
    cached_tokens: int = Field(description="Of the pinned tokens, how many are cached now (host or disk).")
    ttl_s: float
    tier: PinTier


class PrefetchRequest(_PromptOrMessages):
    """``messages`` are rendered as /v1/chat/completions would (with the assistant turn's opening), as /lookup does."""


class PrefetchResponse(BaseModel):
    tenant: str
    prompt_tokens: int
    promoted_tokens: dict[TierKind, int] = Field(description="Tokens moved up to host memory, by the tier they left.")
    host_tokens: int = Field(description="Leading prompt tokens host memory holds now.")


class ClearRequest(RequestBody):
    tier: TierKind | None = Field(None, description="null: every tier.")
    tenant: str | None = Field(
        None, description="Only this tenant's blocks (its namespace's chains); null: everyone's.", max_length=256
    )


class ClearResponse(BaseModel):
    dropped_blocks: dict[TierKind, int]


# -- stats -------------------------------------------------------------------------------
class LatencyReport(BaseModel):
    """Percentiles are exact over the most recent 1,024 samples (null: none yet); count and sum cover all."""

    count: int
    sum_s: float
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    buckets: list[tuple[float, int]] = Field(default_factory=list, exclude=True)  # for /metrics (the last is +Inf)


class TierReport(BaseModel):
    """One tier. ``device`` is the engine's own pool: its hits are blocks still resident from earlier
    requests; it has no lookups, loads or bytes moved of its own, and its releases are not counted as evictions.
    The counters are :data:`kvtier.stats.TIER_COUNTERS`, where each is named and described once.
    """

    capacity_bytes: int
    used_bytes: int
    capacity_blocks: int
    blocks: int
    lookups: int
    hit_tokens: int
    miss_tokens: int
    hit_rate: float | None
    confirm_mismatches: int
    evictions: int
    demotions: int
    bytes_read: int
    bytes_written: int
    bytes_moved: int
    checksum_failures: int
    errors: int
    rejected_stores: int = Field(0, description="Blocks a store offered that the tier had no room for.")
    quarantined: int = Field(0, description="Disk: damaged indexes moved aside at start (the tier started empty).")
    lost_blocks: int = Field(0, description="Disk: records dropped because their slab bytes were gone.")
    write_errors: int = Field(0, description="Disk: blocks not stored (write, fsync or commit failed; never indexed).")
    read_errors: int = Field(0, description="Disk: blocks whose read failed (each a counted miss).")
    load_latency: LatencyReport


class RemoteReport(BaseModel):
    """The shared remote tier beyond its tier counters (those are under ``tiers.remote``)."""

    breakers: dict[str, BreakerState] = Field(description="Each Redis node's circuit breaker, by host:port.")
    breaker_opens: int = Field(
        description="Times a breaker opened (a node failed breaker_failures calls in a row, or one timed out)."
    )
    skipped: int = Field(description="Calls not made because a breaker was open (each a miss).")
    timeouts: int = Field(description="Calls that ran into remote.timeout_ms (also counted in errors).")
    redirects: int = Field(description="Keys a cluster node sent to another (MOVED/ASK, a reshard), followed once.")
    probes: int = Field(description="Headers read at lookup.")
    writes: int = Field(description="Blocks written.")
    dropped_writes: int = Field(description="Blocks not written: the write queue was full, or the write failed.")
    write_queue: int = Field(description="Blocks waiting to be written now.")
    rejected: dict[str, int] = Field(
        description="Values read and refused, by reason (bad_mac, foreign_tokens, ...); each a miss, never served."
    )


class PrefetchReport(BaseModel):
    """The arrival-time fetches (:class:`kvtier.engine.engine.PrefetchCounters`), since the server started."""

    started: int = Field(description="Fetches started when a request arrived.")
    blocks_planned: int = Field(description="Blocks the break-even model chose to fetch rather than recompute.")
    blocks_used: int = Field(description="Of blocks_planned, those that landed in time and were copied into the pool.")
    deadline_missed: int = Field(description="Fetches cut short by their deadline (the rest was recomputed).")
    recompute_chosen: int = Field(description="Requests whose cached blocks were cheaper to recompute than to fetch.")
    cancelled: int = Field(
        description="Fetches dropped at admission: the pool's resident prefix had changed since arrival."
    )


class WarmingReport(BaseModel):
    """Sessions' next turns prefilled in idle time (:mod:`kvtier.server.warming`), since the server started."""

    queued: int = Field(description="Finished turns whose next prompt was handed to the engine to warm.")
    started: int = Field(description="Warm prefills put into the engine (an interrupted one again when resumed).")
    finished: int = Field(description="Warm prefills that reached the end of their prompt.")
    interrupted: int = Field(description="Warm prefills a request's arrival stopped (queued again to resume).")
    superseded: int = Field(description="Warms dropped because their session's next turn arrived first.")
    expired: int = Field(description="Warms dropped because their session's TTL passed before the engine was idle.")
    failed: int = Field(description="Warms the engine refused or lost.")
    tokens: int = Field(description="Prompt tokens warm prefills computed.")
    running: int = Field(description="Warm prefills in the engine now.")


class VerifyReport(BaseModel):
    """Shadow verification (:class:`kvtier.engine.verify.VerifyCounters`), since the server started."""

    sampled: int = Field(description="Hits from host, disk or remote queued to be recomputed while idle.")
    dropped: int = Field(description="Sampled hits not queued: the queue was full.")
    failed: int = Field(description="Checks whose recompute failed (never verified).")
    verified: int = Field(description="Hits recomputed and compared with the KV that was served.")
    blocks_verified: int = Field(description="Blocks compared.")
    mismatched_blocks: int = Field(description="Blocks whose served KV differed from their recompute.")
    mismatched_hits: int = Field(description="Verified hits with at least one mismatched block.")


class SpeculationReport(BaseModel):
    """Prompt-lookup decoding (:class:`kvtier.engine.engine.SpeculationCounters`), since the engine started."""

    verify_steps: int = Field(description="Request-steps that carried draft tokens.")
    drafted: int = Field(description="Draft tokens run through the model.")
    accepted: int = Field(description="Draft tokens equal to the model's own greedy choice, kept.")
    acceptance_rate: float | None = Field(description="accepted / drafted; null before any draft.")


class EngineReport(BaseModel):
    requests: dict[FinishReason, int] = Field(description="Finished requests by finish reason.")
    in_flight: int
    prefill_tokens_computed: int
    prefill_tokens_skipped: int
    onboarded_bytes: int = Field(description="Bytes hits copied from kvtier's host slots into the engine's pool.")
    onboarded_full_bytes: int = Field(
        description="What those hits would have copied loading every layer: more where sliding-window layers "
        "took only their window (engine.windowed_loads)."
    )
    ttft: LatencyReport
    prefill_seconds_per_token: float | None = Field(
        description="Measured: step time spent on prefill (a token-proportional share) per prefilled token."
    )
    prefill_seconds_saved_estimate: float = Field(description="prefill_tokens_skipped x prefill_seconds_per_token.")
    prefetch: PrefetchReport
    speculation: SpeculationReport | None = None
    verify: VerifyReport
    warming: WarmingReport


class TierCostReport(BaseModel):
    """One tier's fitted fetch cost, ``seconds = latency + bytes / bandwidth`` (the prior until samples arrive)."""

    latency_ms: float = Field(description="Fixed cost of one batch fetched from the tier, in milliseconds.")
    bandwidth_gbps: float | None = Field(
        description="Fitted bandwidth in GB/s (1e9 bytes per second); null: the fit found no per-byte cost."
    )
    samples: int = Field(description="Fetch batches measured so far; 0: latency and bandwidth are the prior.")


class PrefillCostReport(BaseModel):
    """The engine's fitted prefill cost, ``seconds = overhead + a x tokens + b x attended positions``."""

    overhead_ms: float = Field(description="Fixed cost of one forward that prefills, in milliseconds.")
    ms_per_token: float = Field(description="a: milliseconds per token computed (the linear layers).")
    ns_per_attended_position: float = Field(
        description="b: nanoseconds per (token, earlier position) pair attended (the quadratic part of attention)."
    )
    samples: int = Field(description="Prefilling forwards measured so far; 0: the coefficients are the prior.")


class BlockCostReport(BaseModel):
    """One more block at a given context length: recomputed, or fetched (each tier's batch latency not included)."""

    recompute_ms: float = Field(description="Milliseconds to prefill one block's tokens on top of the context.")
    host_fetch_ms: float = Field(description="Milliseconds to copy one block from host into the pool.")
    disk_fetch_ms: float = Field(description="Milliseconds to bring one block from disk (via host) into the pool.")
    host_wins_x: float | None = Field(description="recompute_ms / host_fetch_ms; above 1 fetching wins.")
    disk_wins_x: float | None = Field(description="recompute_ms / disk_fetch_ms; above 1 fetching wins.")


class BreakEvenReport(BaseModel):
    """The reload-vs-recompute cost model (:mod:`kvtier.breakeven`) that sizes prefetches and sets their deadlines."""

    tiers: dict[TierKind, TierCostReport] = Field(
        description="Fetch cost per tier; device (blocks already in the pool) is never measured: its prior."
    )
    prefill: PrefillCostReport
    per_block_at_context: dict[int, BlockCostReport] = Field(
        description="Keyed by the tokens already in context (attention makes a block dearer the longer it is)."
    )
    block_tokens: int = Field(description="Tokens per block.")
    block_bytes: int = Field(description="Payload bytes per block (every layer's K and V).")
    deadline_slack: float = Field(
        description="A prefetch is waited for up to this many times its predicted time (never past what it saves)."
    )


class GpuReport(BaseModel):
    """NVML's view of the engine's GPU at the time of the report."""

    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int


class HardwareReport(BaseModel):
    """What produced every figure in this report: the engine's device and dtype, the CPU's vector extensions,
    and whether torch's idle OpenMP workers spin (they take cores from kvtier's own kernels when they do)."""

    device: str = Field(description="Where the weights and the KV pool live (engine.device resolved): cpu, cuda:0.")
    dtype: str = Field(description="The engine's compute and KV dtype.")
    cpu_isa: list[str] = Field(description="Vector extensions of this CPU that the kernels use.")
    omp_wait_policy: str | None = Field(
        None,
        description="OMP_WAIT_POLICY torch's OpenMP runtime loaded with: PASSIVE as kvtier sets it "
        "(kvtier/openmp.py), the process's own, or null for the runtime's default.",
    )
    gpu: GpuReport | None = Field(None, description="The GPU's memory and utilisation (NVML); null without one.")


class ServiceLinkReport(BaseModel):
    """This server's link to the node's cache service (``cache.service``)."""

    connected: bool = Field(description="The service answered this /stats (its tiers' figures are fresh).")
    connects: int = Field(description="Connections made since start: more than one, the service restarted.")
    failures: int = Field(description="Calls that found the service away or failing (each a miss).")


class RetainedReport(BaseModel):
    """What one tenant's promises keep in one tier now."""

    blocks: int = Field(description="Distinct blocks the tenant's live promises keep in this tier.")
    bytes: int
    prefixes: int = Field(description="Promised prefixes still within their TTL.")
    quota_bytes: int = Field(
        description="What the tenant's promises may keep here (server.tenants.<name>.retain_bytes in host, "
        "retain_disk_bytes on disk)."
    )


class KVEventsReport(BaseModel):
    """This server's publisher of KV events in vLLM's format (``kv_events``)."""

    endpoint: str = Field(description="The PUB socket, as bound.")
    replay_endpoint: str | None = Field(description="The ROUTER socket that replays, as bound; null: none.")
    incarnation: int = Field(description="Random per start: a consumer that sees it change resynchronises.")
    last_seq: int = Field(description="Sequence number of the last batch published.")
    replays: int = Field(description="Replay requests answered from the buffer.")
    snapshots: int = Field(description="Replay requests answered with a snapshot (too old, another incarnation).")


class StatsReport(BaseModel):
    model: str
    block_size: int
    hardware: HardwareReport | None = None
    tiers: dict[TierKind, TierReport]
    pinned_blocks: int = Field(description="Host blocks pinned by loads in progress.")
    ttl_pinned_blocks: int = Field(
        description="Keys under a live TTL pin in any tier: /admin/pin, cache_control marks, prompt_cache_retention."
    )
    engine: EngineReport
    break_even: BreakEvenReport
    remote: RemoteReport | None = Field(None, description="The remote tier's own figures; null when it is off.")
    sessions: SessionsReport | None = Field(None, description="Live agent sessions; null when sessions are off.")
    service: ServiceLinkReport | None = Field(None, description="The cache service link; null when embedded.")
    kv_events: KVEventsReport | None = Field(None, description="KV events in vLLM's format; null when not published.")
    retained: dict[str, dict[TierKind, RetainedReport]] = Field(
        default_factory=dict,
        description=(
            "Per tenant name, per tier it keeps something in: host, what its cache_control marks keep (and its "
            'prompt_cache_retention "24h" prompts where there is no disk tier); disk, its "24h" prompts.'
        ),
    )


# -- agent sessions and explain ------------------------------------------------------
class SessionCountsReport(BaseModel):
    session: str = Field(description="/stats: a keyed hash of tenant and id; GET /v1/sessions: the id as given.")
    turns: int
    transcript_tokens: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    idle_s: float


class SessionsReport(BaseModel):
    live: int
    expired: int = Field(description="Sessions that outlived session.ttl_s since the start.")
    protected_blocks: int = Field(description="Host blocks the last eviction kept for live sessions.")
    sessions: list[SessionCountsReport] = Field(description="Counts only, never token text; idlest first.")


class SessionPrefetchResponse(BaseModel):
    session: str
    transcript_tokens: int
    promoted_tokens: dict[TierKind, int] = Field(description="Tokens moved to host memory, by the tier they left.")
    host_tokens: int = Field(description="Leading transcript tokens host memory holds now.")
    device_tokens: int = Field(description="Leading transcript tokens resident in the engine's pool now.")


class ExplainRequest(_PromptOrMessages):
    """A chat (or completion) request as it would be sent; nothing runs and nothing is counted."""

    model: str | None = None
    user: SessionId | None = Field(None, description="The session to compare with (X-Session-ID wins).")


class EvictionReport(BaseModel):
    tier: TierKind
    policy: str
    seconds_ago: float


class DivergenceReport(BaseModel):
    position: int = Field(description="First token position where this request leaves the session's earlier turn.")
    before: str = Field(description="The earlier turn's text around that position.")
    now: str = Field(description="This request's text around that position.")


class ExplainResponse(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[TierKind, int] = Field(description="Of cached_tokens, how many each tier would serve.")
    reason: ExplainReason
    first_miss_token: int | None
    eviction: EvictionReport | None = None
    other_namespace: bool = Field(False, description="Cached under another namespace of the caller's own.")
    divergence: DivergenceReport | None = None


StatsReport.model_rebuild()  # its sessions field names a model defined after it
