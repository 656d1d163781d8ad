"""The one typed configuration tree, and its one loader.

Sources, later ones winning: built-in defaults → a YAML file → ``KVTIER_*``
environment variables. A nested key is named in the environment with double
underscores: ``KVTIER_HOST__CAPACITY_BYTES=4GiB`` sets ``host.capacity_bytes``;
``KVTIER_DATA_DIR`` sets the top-level ``data_dir``. An unknown key, in the
file or the environment, is an error that names it: a typo must never be
silently ignored and leave a default in force.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import platformdirs
import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtier.policy.base import PolicyName

ENV_PREFIX = "KVTIER_"
ENV_NESTING = "__"


class ConfigError(ValueError):
    pass


class FsyncMode(enum.StrEnum):
    """When the disk tier forces payload bytes to stable storage.

    ``always``: fsync after every block, before its index commit: no
    acknowledged block is ever lost, at one device flush per block.
    ``batch``: one fsync per batch (``put_many``) before the batch's single
    index commit: the same guarantee for every acknowledged block, amortised.
    ``never``: no fsync and a non-syncing index: fastest; after a power loss an
    indexed block may point at stale bytes, which its checksum then turns into
    a counted miss (never wrong KV). A process crash loses nothing either way.
    """

    ALWAYS = "always"
    BATCH = "batch"
    NEVER = "never"


class WriteMode(enum.StrEnum):
    """How blocks reach the disk tier.

    ``write_back``: stored in host only; demoted to disk when host evicts
    them (disk I/O only for blocks that outgrow host memory).
    ``write_through``: written to disk as soon as they are stored (they
    survive a restart at once, at the cost of disk bandwidth for every block).
    """

    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


class DiskIO(enum.StrEnum):
    """How the disk tier reads and writes its slab files.

    ``buffered`` (the default, chosen by ``kvtier bench tiers`` on the
    development VM): through the page cache, whose readahead keeps a disk
    with slow individual requests streaming, so cold block reads beat
    O_DIRECT there (see bench/README.md). ``direct``:
    O_DIRECT, never double-caching what the host tier already holds and
    using less CPU per byte; the better choice on a local NVMe that serves
    aligned requests at full speed (fails at open if the filesystem refuses).
    ``auto``: O_DIRECT when the filesystem accepts it, else buffered.
    """

    BUFFERED = "buffered"
    DIRECT = "direct"
    AUTO = "auto"


class OnMismatch(enum.StrEnum):
    """What the disk tier does when its header does not match the model/layout."""

    ERROR = "error"
    WIPE = "wipe"


class OnCorrupt(enum.StrEnum):
    """What the disk tier does when its index is damaged (torn pages, garbage, an unreadable header).

    ``quarantine`` (the default): move the index and its slab files aside,
    into ``<disk.path>/quarantine/<UTC time>/``, log it once, count it
    (``quarantined`` in the disk tier's stats) and start empty. Everything in
    the cache can be recomputed, so a damaged cache must cost a cold start,
    never an outage; the files are kept for a post-mortem rather than wiped.
    ``error``: refuse to start, with one line naming the file, for an
    operator who wants to look before anything is moved.
    """

    QUARANTINE = "quarantine"
    ERROR = "error"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class HostConfig(_Section):
    capacity_bytes: ByteSize = Field(ByteSize(2 * 1024**3), description="Host slab size; rounded down to whole slots.")
    policy: PolicyName = PolicyName.LRU


class DiskConfig(_Section):
    enabled: bool = True
    capacity_bytes: ByteSize = Field(ByteSize(16 * 1024**3), description="Total slab bytes on disk.")
    path: Path | None = Field(None, description="Slab and index directory; default: <data_dir>/disk.")
    file_bytes: ByteSize = Field(ByteSize(1024**3), description="Largest single slab file.")
    policy: PolicyName = PolicyName.LRU
    fsync: FsyncMode = FsyncMode.BATCH
    io: DiskIO = DiskIO.BUFFERED
    on_mismatch: OnMismatch = OnMismatch.ERROR
    on_corrupt: OnCorrupt = OnCorrupt.QUARANTINE

    @field_validator("path")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser()


class TransferConfig(_Section):
    workers: int = Field(2, ge=1, description="Transfer threads (CUDA streams: one per worker when a GPU exists).")
    prefetch: bool = Field(True, description="Start moving a request's lower-tier blocks up as soon as it arrives.")
    deadline_slack: float = Field(
        2.0, gt=0, description="A prefetch may take this many times its predicted time (capped by what it saves)."
    )
    layerwise: bool = Field(True, description="Copy fetched KV into the engine pool layer by layer, under compute.")


class CacheConfig(_Section):
    block_size: int = Field(16, gt=0, description="Tokens per block.")
    namespace: str = Field("default", min_length=1, description="Namespace used when a caller gives none.")
    write_mode: WriteMode = WriteMode.WRITE_BACK
    flush_on_exit_s: float = Field(
        30.0, ge=0, description="On a clean exit (SIGTERM), write-back host blocks go to disk for at most this long."
    )
    service: str = Field(
        "embedded",
        description="embedded: the tiers live in this process; unix:///path: in the node's cache service there.",
    )
    service_retry_s: float = Field(
        5.0, gt=0, description="While the cache service is away, how often this process tries to connect again."
    )
    secret_file: Path | None = Field(
        None, description="The key secret (32 bytes), shared by every node of a deployment; default <data_dir>/secret."
    )

    @field_validator("secret_file")
    @classmethod
    def _expand_secret(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser()

    @field_validator("service")
    @classmethod
    def _check_service(cls, v: str) -> str:
        if v != "embedded" and not (v.startswith("unix:///") and len(v) > len("unix:///")):
            raise ValueError("cache.service is 'embedded' or 'unix:///absolute/path/to.sock'")
        return v

    @property
    def service_socket(self) -> Path | None:
        """The cache service's socket, or None when the cache is embedded."""
        return None if self.service == "embedded" else Path(self.service.removeprefix("unix://"))


class ComputeDtype(enum.StrEnum):
    """The engine's weights, activations and (unless ``engine.kv_dtype`` says int8) KV dtype.

    ``auto`` (the default) is picked once at start
    (:func:`kvtier.hardware.compute_dtype`): ``bfloat16`` on a CPU with native
    bf16 arithmetic (AVX-512 BF16 or AMX), where it is the faster of the two,
    ``float32`` everywhere else (an AVX2-only CPU converts every bf16 value in
    software; on a GPU exact reuse is proven in float32 only, see below). A
    fleet whose machines differ sets it explicitly, since the dtype enters
    every block key. With ``float32`` greedy output with cached KV is token-for-token
    identical to a full recompute (tested), the differences between KV
    computed in different chunks or by a decode step being far below what
    moves a greedy token. ``bfloat16`` halves the bytes every weight and KV
    read moves and runs the matmuls on native bf16 arithmetic where the CPU
    has it (AVX-512 BF16, AMX), and there its differences are not small.
    So on the CPU bf16 reuse is made exact by construction: every prefill
    chunk's attention runs the C kernel (:mod:`kvtier.engine.kernels`), whose
    reduction order does not depend on where the prompt was cut, so a token's
    prefill KV is the same bits in one forward or in many (torch's CPU
    matmuls give a row the same bits whatever rows come with it: tested in
    tests/engine/test_bf16_reuse.py); and only prefill-computed blocks are cached
    (:class:`DecodedKV`). On a GPU the attention is SDPA's, and that holds
    only as far as its kernels are invariant too.
    """

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class KVDtype(enum.StrEnum):
    """What the engine's KV pool, and so every tier, holds a token's keys and values in.

    ``auto``: the compute dtype (``engine.dtype``). ``int8``: int8 quants
    with a float32 scale per token and KV head (:mod:`kvtier.layout`),
    0.27x float32's bytes and 0.53x bfloat16's at head_dim 64, in the pool,
    the tiers and on the wire. ``fp8_e4m3``: the same with float8 e4m3
    quants (relative steps instead of even ones: small values kept finer,
    the largest coarser). ``float16``: half of float32's bytes under either
    compute dtype, finer than bfloat16 (10 mantissa bits, not 7) but
    bounded at 65,504. Reuse stays exact at any precision: a token's
    KV is rounded once, when the engine writes it, and every token, cached
    or new, is attended to as the pool holds it (the C kernels read the
    quants in place), so the KV an engine computes and the KV a tier returns
    are the same bytes. Precision is part of the layout, which is bound into
    every block key: blocks written at one precision never serve another.
    float16 and the 8-bit ones run on the CPU's C attention kernels (head_dim
    a multiple of 16, at most 256). ``float32``/``bfloat16`` name the compute dtype itself.
    """

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT8 = "int8"
    FP8_E4M3 = "fp8_e4m3"

    @property
    def eight_bit(self) -> bool:
        return self in (KVDtype.INT8, KVDtype.FP8_E4M3)

    @property
    def any_compute(self) -> bool:
        """Whether the kernels take this KV under either compute dtype (the C kernels widen it as they read)."""
        return self.eight_bit or self is KVDtype.FLOAT16


class DecodeWeights(enum.StrEnum):
    """What a decode step multiplies by.

    ``gguf``: the file's own quantized blocks (Q4_0 to Q8_0 and the K-quants),
    read by a C kernel (kvtier/engine/quant.py): the same weights in a quarter
    to a seventh of float32's bytes, and a decode step is bound by the bytes it reads. Used on the CPU (activations
    as the engine holds them: ``decode_activations``) when the native extension is
    built and every matrix is in a supported format; otherwise, and always
    for prefills, ``dense``: matmuls of the dequantized weights.
    """

    GGUF = "gguf"
    DENSE = "dense"


class DecodeActivations(enum.StrEnum):
    """What a decode step's products on the GGUF blocks multiply the weights with.

    ``exact``: the activations as the engine holds them (float32, or
    bfloat16 on VDPBF16PS): every product exact, float32 sums. ``q8``: each
    32 activations rounded to int8 quants and a scale first, as llama.cpp
    does, and the products summed in int8 on AVX-512 VNNI: far fewer
    instructions a weight, activations rounded once more. Reuse stays exact
    either way (a cached run and an uncached one decode alike); with ``q8``
    no decode-computed block is cached (``decoded_kv``), since a prefill of
    the same tokens would not compute it so. A CPU without AVX-512 VNNI
    runs ``exact`` (logged).
    """

    EXACT = "exact"
    Q8 = "q8"


class DecodedKV(enum.StrEnum):
    """Whether blocks holding KV a decode step computed (a reply's tokens) are cached and reused.

    A decode step computes its token's KV with other kernels than a prefill
    (one row; in float32 the GGUF matvec), so a reply's blocks differ in the
    last bits from the same tokens prefilled in the next turn without a cache.
    ``auto``: cached in float32 KV, where that difference is far below what
    moves a greedy token; not in bfloat16 or 8-bit KV (where a last-bit
    difference can move a quant a whole step), where skipping them (the next
    turn prefills the previous reply again) keeps reuse exact by construction.
    """

    AUTO = "auto"
    CACHE = "cache"
    SKIP = "skip"


class EngineDevice(enum.StrEnum):
    """Where the engine's weights and KV pool (the device tier) live: ``auto`` takes a CUDA GPU when there is one."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class SpeculativeConfig(_Section):
    """Prompt-lookup decoding for greedy requests: drafts copied from earlier in the context, verified in one forward.

    Output is what one-token steps give; only the number of forwards changes.
    """

    prompt_lookup: bool = Field(True, description="Draft tokens from n-gram matches; false: one token per step.")
    num_draft_tokens: int = Field(
        3, ge=1, le=32, description="Most drafts per request per step (3: with the next token, 4 decode rows)."
    )
    min_ngram: int = Field(2, ge=1, description="Shortest tail of the reply looked up in the context.")
    max_ngram: int = Field(3, ge=1, description="Longest tail looked up; the longest match wins.")

    @model_validator(mode="after")
    def _ordered(self) -> SpeculativeConfig:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {self.min_ngram} > max_ngram {self.max_ngram}")
        return self


class EngineConfig(_Section):
    model_path: Path | None = Field(None, description="A Llama GGUF file; null: the embedded SmolLM2-135M-Instruct.")
    device: EngineDevice = Field(EngineDevice.AUTO, description="auto: cuda when a GPU is visible, else cpu.")
    dtype: ComputeDtype = Field(
        ComputeDtype.AUTO, description="auto: bfloat16 on a CPU with AVX-512 BF16 or AMX, else float32."
    )
    kv_dtype: KVDtype = Field(
        KVDtype.AUTO,
        description="The KV pool's and every tier's precision: auto = engine.dtype; float16; int8 or fp8_e4m3 quants.",
    )
    decode_weights: DecodeWeights = DecodeWeights.GGUF
    decode_activations: DecodeActivations = Field(
        DecodeActivations.EXACT, description="q8: decode's products in int8, as llama.cpp (AVX-512 VNNI)."
    )
    pool_bytes: ByteSize = Field(ByteSize(1024**3), description="The engine's paged KV pool (the device tier).")
    max_batch: int = Field(16, ge=1, description="Requests decoded together in one step.")
    max_step_tokens: int = Field(
        512,
        ge=16,
        description="Tokens one step computes: a token per decoding request, then prompt chunks (chunked prefill).",
    )
    keep_resident: bool = Field(True, description="Keep finished requests' blocks in the pool (device tier).")
    windowed_loads: bool = Field(
        True,
        description="A hit loads into sliding-window layers (Gemma 3) only the blocks inside their window.",
    )
    decoded_kv: DecodedKV = Field(
        DecodedKV.AUTO, description="Cache blocks a decode step computed: auto = in float32, not in bfloat16."
    )
    speculative: SpeculativeConfig = SpeculativeConfig()

    @field_validator("model_path")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser()

    @model_validator(mode="after")
    def _check_decode(self) -> EngineConfig:
        if self.decode_activations is DecodeActivations.Q8 and self.decoded_kv is DecodedKV.CACHE:
            raise ValueError(
                "engine.decode_activations q8 with engine.decoded_kv cache: a reply's blocks would be KV "
                "that a prefill of the same tokens does not compute, and reuse would no longer be exact"
            )
        return self


TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class TenantLimits(_Section):
    """What one tenant's promises may hold (``server.tenants.<name>``)."""

    retain_bytes: ByteSize | None = Field(
        None, description="Host bytes this tenant's cache_control marks may keep; null: server.retain_bytes."
    )
    retain_disk_bytes: ByteSize | None = Field(
        None,
        description="Disk bytes this tenant's day-long promises (prompt_cache_retention: 24h) may keep; "
        "null: server.retain_disk_bytes.",
    )


class ServerConfig(_Section):
    """``kvtier serve``: where it listens, who may call it, and how much one request may ask for."""

    host: str = Field("127.0.0.1", min_length=1, description="Bind address; a non-loopback one needs admin_token.")
    port: int = Field(8000, ge=1, le=65535)
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token of the admin routes (null: they always answer 401); it also reads the figures.",
    )
    read_token: SecretStr | None = Field(
        None,
        description=(
            "Bearer token that reads /stats, /metrics, /dashboard and the schema, and nothing else. With neither "
            "token set those are open (the server then binds loopback only); else they need one of the two."
        ),
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="API key -> tenant name. Empty: one default tenant and no auth on inference.",
    )
    model_name: str | None = Field(None, description="The model id clients send; null: the GGUF file's stem.")
    max_body_bytes: ByteSize = Field(ByteSize(1024**2), description="Larger request bodies get 413.")
    max_tokens_limit: int = Field(1024, ge=1, description="The largest max_tokens a request may ask for.")
    max_pin_ttl_s: float = Field(86400.0, gt=0, description="The longest TTL /admin/pin accepts.")
    read_timeout_s: float = Field(
        30.0, gt=0, description="A request's headers and body must arrive within this; else the connection closes."
    )
    max_connections: int = Field(
        2048, ge=1, description="Open connections served; requests on connections past it get 503."
    )
    retain_bytes: ByteSize | None = Field(
        None,
        description=(
            "Host bytes one tenant's cache_control marks may keep; past it, that tenant's oldest marked prefix "
            "goes first. null: half the host tier."
        ),
    )
    retain_disk_bytes: ByteSize | None = Field(
        None,
        description=(
            "Disk bytes one tenant's day-long promises (OpenAI's prompt_cache_retention: 24h) may keep pinned on "
            "disk; past it, that tenant's oldest such prompt goes first. null: half the disk tier (0 without one)."
        ),
    )
    tenants: dict[str, TenantLimits] = Field(default_factory=dict, description="Per tenant name: its own limits.")

    @field_validator("host")
    @classmethod
    def _unbracket(cls, v: str) -> str:
        """``[::1]`` (URL form) is the address ``::1``: the form sockets and uvicorn take."""
        return v[1:-1] if v.startswith("[") and v.endswith("]") else v

    @field_validator("admin_token", "read_token")
    @classmethod
    def _check_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("a token needs at least 16 characters")
        return v

    @field_validator("tenants")
    @classmethod
    def _check_tenants(cls, v: dict[str, TenantLimits]) -> dict[str, TenantLimits]:
        for name in v:
            if not re.fullmatch(TENANT_NAME, name):
                raise ValueError(f"tenant name {name!r} must match {TENANT_NAME}")
        return v

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, v: dict[str, str]) -> dict[str, str]:
        for key, tenant in v.items():
            if len(key) < 8:
                raise ValueError("an API key needs at least 8 characters")
            if not re.fullmatch(TENANT_NAME, tenant):
                raise ValueError(f"tenant name {tenant!r} must match {TENANT_NAME}")
        return v


class VerifyConfig(_Section):
    """Shadow verification: a share of hits recomputed while the engine is idle, and compared with what was served."""

    shadow_fraction: float = Field(
        0.0, ge=0, le=1, description="Share of hits from host/disk/remote checked; 0 turns it off."
    )
    queue_size: int = Field(8, ge=1, description="Hits waiting to be checked; more are dropped, counted.")
    max_tokens: int = Field(2048, ge=1, description="A hit is checked up to this prompt position.")


class RoutePolicy(enum.StrEnum):
    """How ``kvtier route`` picks a backend for a request.

    ``round_robin`` and ``least_loaded`` ignore the cache (the baselines);
    ``kvtier`` predicts each backend's cost from the blocks it holds and its
    load, keeps a session on one backend, and spills off an overloaded one.
    """

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    KVTIER = "kvtier"


class RouteConfig(_Section):
    """``kvtier route``: a cache-aware front over several ``kvtier serve`` instances (the backends)."""

    host: str = Field("127.0.0.1", min_length=1, description="Bind address of the router.")
    port: int = Field(8100, ge=1, le=65535)
    backends: list[str] = Field(default_factory=list, description="Backend base URLs (http://host:port).")
    policy: RoutePolicy = RoutePolicy.KVTIER
    backend_token: SecretStr | None = Field(
        None, description="The backends' server.admin_token, which their block event streams and /stats ask for."
    )
    admin_token: SecretStr | None = Field(
        None, description="Bearer token of the router's fleet control routes, /fleet/* (null: they always answer 401)."
    )
    fleet_timeout_s: float = Field(
        30.0, gt=0, description="How long a fleet control call waits for each backend; past it, that one is down."
    )
    health_interval_s: float = Field(1.0, gt=0, description="How often each backend's /health is asked.")
    retries: int = Field(1, ge=0, description="Other backends a request is sent to when one fails before a byte.")
    first_byte_timeout_s: float = Field(
        120.0, gt=0, description="A backend's first output must come this soon after the request, else it is out."
    )
    idle_timeout_s: float = Field(
        120.0, gt=0, description="Longest silence between two data events of an answer (keep-alives are silence)."
    )
    load_tokens: int = Field(
        256, ge=0, description="Prefill tokens one request of another client on a backend is counted as (size unknown)."
    )
    queue_weight: float = Field(
        1.0, ge=0, description="Weight of a backend's queued prefill tokens against a request's own; 0: prefix alone."
    )
    max_imbalance: int = Field(
        8, ge=0, description="A backend this many requests above the least loaded is passed over, hot prefix or not."
    )
    approx_blocks: int = Field(
        65536, ge=0, description="Block keys kept per backend of what was routed there (a guess beyond its events)."
    )
    kv_events: dict[str, EventSource] = Field(
        default_factory=dict,
        description="Backend URL -> its vLLM-format KV event publisher (a kvtier node's kv_events, or vLLM's "
        "--kv-events-config), followed over ZMQ instead of the backend's GET /v1/kv-events.",
    )
    vllm_events: dict[str, str] = Field(
        default_factory=dict,
        description="Backend URL -> a publisher without a replay socket (kv_events' older, shorter form).",
    )
    max_event_line_bytes: ByteSize = Field(
        ByteSize(64 * 1024**2),
        gt=0,
        description="Longest line of a backend's block events (a snapshot lists all its keys); longer: stream dropped.",
    )

    def event_source(self, backend: str) -> EventSource | None:
        """Where ``backend``'s events come over ZMQ; None: its HTTP stream."""
        source = self.kv_events.get(backend)
        if source is None and backend in self.vllm_events:
            source = EventSource(endpoint=self.vllm_events[backend])
        return source

    @field_validator("backends")
    @classmethod
    def _check_backends(cls, v: list[str]) -> list[str]:
        for url in v:
            if not re.fullmatch(r"https?://[^/?#\s]+/?", url):
                raise ValueError(f"{url!r} is not http://host:port")
        return [url.rstrip("/") for url in v]

    @field_validator("admin_token")
    @classmethod
    def _check_admin_token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < 16:
            raise ValueError("a token needs at least 16 characters")
        return v


def default_data_dir() -> Path:
    """Under the user's cache directory (XDG on Linux), never the source tree."""
    return Path(platformdirs.user_cache_dir("kvtier"))


class ServiceConfig(_Section):
    """``kvtier cache serve``: who may connect and how long a reservation may stay open.

    Its socket is ``cache.service``'s path (one config file serves the whole
    node), or ``<data_dir>/cache.sock`` while that is ``embedded``.
    """

    allowed_uids: list[int] = Field(
        default_factory=list, description="Users besides the service's own who may connect (peer uid checked)."
    )
    socket_group: str | None = Field(
        None,
        description="A group (name or gid) whose members may connect too: socket and slab 0660 in it. null: 0600.",
    )
    reservation_ttl_s: float = Field(
        60.0,
        gt=0,
        description="An uncommitted store reservation is withdrawn after this (its slots wait for its client).",
    )
    max_clients: int = Field(
        256, gt=0, description="Connections served at once (a thread each); one more is refused in one line."
    )
    slab_dir: Path | None = Field(
        None, description="Where the shared host slab file lives; null: /dev/shm (else TMPDIR)."
    )

    @field_validator("slab_dir")
    @classmethod
    def _expand(cls, v: Path | None) -> Path | None:
        return None if v is None else v.expanduser()


class RemoteWriteOn(enum.StrEnum):
    """When blocks go out to the remote tier (always behind the request, on the remote's writer thread).

    ``store``: every newly stored block, as soon as host memory holds it:
    another node can hit it at once, at the cost of network bytes for every
    block. ``host_eviction``: only blocks host memory evicts (beside their
    demotion to disk): fewer bytes out, but a block reaches other nodes only
    once this one has no room for it.
    """

    STORE = "store"
    HOST_EVICTION = "host_eviction"


REMOTE_URL = r"^(redis|rediss)://[^/?#]+(/\d+)?$|^unix:///.+$"


class RemoteConfig(_Section):
    """The shared remote tier: a Redis or Valkey (standalone or cluster) below the local tiers, shared by nodes."""

    enabled: bool = False
    urls: list[str] = Field(
        default_factory=lambda: ["redis://127.0.0.1:6379"],
        description="redis://host:port[/db], rediss://host:port (TLS), unix:///path.sock; a cluster: any of its nodes.",
    )
    cluster: bool = Field(False, description="Redis Cluster: keys spread over the masters by hash slot.")
    username: str | None = Field(None, description="ACL user (prefer KVTIER_REMOTE__USERNAME).")
    password: SecretStr | None = Field(None, description="Password (prefer KVTIER_REMOTE__PASSWORD).")
    key_prefix: str = Field("kvtier:", min_length=1, description="Prefix of every key kvtier writes.")
    ttl_s: float = Field(3600.0, gt=0, description="A block expires this long after its last store or hit.")
    timeout_ms: float = Field(100.0, gt=0, description="Longest wait for one connect, send or receive.")
    write_on: RemoteWriteOn = RemoteWriteOn.STORE
    write_queue_blocks: int = Field(64, ge=1, description="Blocks waiting to be written; more are dropped, counted.")
    breaker_failures: int = Field(
        3,
        ge=1,
        description="Consecutive failures that open a node's circuit breaker (one timed-out call opens it at once).",
    )
    breaker_retry_s: float = Field(5.0, gt=0, description="An open breaker lets one trial call through this often.")

    @field_validator("urls", mode="before")
    @classmethod
    def _split_urls(cls, v: object) -> object:
        """The environment gives one string: ``KVTIER_REMOTE__URLS=redis://a:6379,redis://b:6379``."""
        return [u.strip() for u in v.split(",") if u.strip()] if isinstance(v, str) else v

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("remote.urls needs at least one URL")
        for url in v:
            if not re.fullmatch(REMOTE_URL, url):
                raise ValueError(f"{url!r} is not redis://host:port[/db], rediss://host:port or unix:///path")
        return v

    @model_validator(mode="after")
    def _check_topology(self) -> RemoteConfig:
        """A cluster is reached over TCP (its nodes announce host:port); one standalone server has one URL."""
        if self.cluster and any(u.startswith("unix://") for u in self.urls):
            raise ValueError("remote.cluster: Redis Cluster nodes are reached over TCP, not unix:// sockets")
        if not self.cluster and len(self.urls) > 1:
            raise ValueError("remote.urls lists several servers: set remote cluster: true (they seed one cluster)")
        return self


class SessionConfig(_Section):
    """Agent sessions (named by the request's ``user`` field or an ``X-Session-ID`` header)."""

    enabled: bool = Field(True, description="Track sessions and protect a live session's transcript in host memory.")
    ttl_s: float = Field(600.0, gt=0, description="A session is live this long after its last turn.")
    max_sessions: int = Field(4096, ge=1, description="Sessions remembered at once; the idlest is forgotten first.")
    max_protected_share: float = Field(
        0.75, ge=0, le=1, description="Most of the host tier live sessions may protect, oldest sessions first."
    )
    max_transcript_tokens: int = Field(
        8192, ge=1, description="Leading transcript tokens remembered per session (for prefetch and explain)."
    )
    eviction_log: int = Field(65536, ge=0, description="Recent evictions remembered for /v1/cache/explain.")
    warm_next_turn: bool = Field(
        True,
        description="When a chat or Messages turn of a session ends, prefill its next prompt's known start "
        "(prompt, reply, the next message's opening) in the engine's idle time.",
    )


_ZMQ_ENDPOINT = re.compile(r"(tcp://[^\s/]+:(\d+|\*)|ipc://\S+|inproc://\S+)")


def _zmq_endpoint(v: str | None) -> str | None:
    if v is not None and not _ZMQ_ENDPOINT.fullmatch(v):
        raise ValueError(f"{v!r} is not a ZMQ endpoint (tcp://host:port, tcp://host:*, ipc://path)")
    return v


class KVEventsConfig(_Section):
    """This node's block events in vLLM's format over ZMQ, for any router (kvtier route, llm-d, Dynamo).

    Published by ``kvtier serve`` for the tiers in its own process and by the
    cache service for the node's shared ones (see :mod:`kvtier.vllm_events`).
    """

    endpoint: str | None = Field(
        None, description="PUB socket to bind (tcp://127.0.0.1:5557; port * picks one); None: no events published."
    )
    replay_endpoint: str | None = Field(
        None, description="ROUTER socket to bind for replays and snapshots (tcp://127.0.0.1:5558); None: none."
    )
    topic: str = Field("", description="First frame of every published message (vLLM's kv_events topic).")
    buffer_batches: int = Field(10_000, ge=1, description="Batches kept for replay; an older start gets a snapshot.")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        return _zmq_endpoint(v)

    @model_validator(mode="after")
    def _replay_needs_pub(self) -> KVEventsConfig:
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("kv_events.replay_endpoint is set without kv_events.endpoint")
        return self


class EventSource(_Section):
    """Where a backend publishes vLLM-format KV events: its PUB socket and, if it has one, its replay ROUTER."""

    endpoint: str
    replay_endpoint: str | None = None

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, v: str | None) -> str | None:
        return _zmq_endpoint(v)


class Config(_Section):
    data_dir: Path = Field(default_factory=default_data_dir)
    cache: CacheConfig = CacheConfig()
    verify: VerifyConfig = VerifyConfig()
    host: HostConfig = HostConfig()
    disk: DiskConfig = DiskConfig()
    transfer: TransferConfig = TransferConfig()
    engine: EngineConfig = EngineConfig()
    server: ServerConfig = ServerConfig()
    route: RouteConfig = RouteConfig()
    service: ServiceConfig = ServiceConfig()
    remote: RemoteConfig = RemoteConfig()
    session: SessionConfig = SessionConfig()
    kv_events: KVEventsConfig = KVEventsConfig()

    @field_validator("data_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @property
    def service_socket(self) -> Path:
        """Where the node's cache service listens: ``cache.service``'s path, else ``<data_dir>/cache.sock``."""
        return self.cache.service_socket or self.data_dir / "cache.sock"

    @property
    def disk_path(self) -> Path:
        return self.disk.path if self.disk.path is not None else self.data_dir / "disk"


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = name[len(ENV_PREFIX) :].lower().split(ENV_NESTING)
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {part!r} is both a value and a section")
        node[path[-1]] = value
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        what = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{where}: {what}")
    return f"invalid kvtier config ({origin}):\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Defaults, then ``path`` (YAML), then ``KVTIER_*`` variables of ``environ`` (default: os.environ)."""
    tree: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        tree = loaded
        origin = str(path)
    env = _env_overrides(os.environ if environ is None else environ)
    if env:
        tree = _merge(tree, env)
        origin += " + KVTIER_* environment"
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_describe(err, origin)) from None
