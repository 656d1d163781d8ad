"""What the engine runs on: the device its pool lives in, the CPU's vector ISA, and a GPU's live memory.

Shown in ``/stats`` and ``/metrics`` and recorded with every benchmark,
because the same code is several times faster or slower from one machine
to the next (AVX-512 BF16 or not, a GPU or not), and a figure is only
meaningful next to what produced it. GPU facts come from NVML
(``nvidia-ml-py``): the driver's own view of memory and utilisation,
which torch's allocator counters do not give (other processes share the
GPU). Without a GPU, or without a driver, they are absent, never an error.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.config import ComputeDtype, Config, ConfigError, EngineDevice, KVDtype

log = logging.getLogger(__name__)

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@functools.cache
def cpu_isa() -> tuple[str, ...]:
    """The vector extensions of this CPU that kvtier's and torch's kernels use (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return tuple(f for f in ISA_FLAGS if f in flags)


NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})


def engine_device(config: Config) -> torch.device:
    """The device ``engine.device`` names on this machine; ``cuda`` where torch sees no GPU is a one-line error."""
    cuda = torch.cuda.is_available()
    wanted = config.engine.device
    if wanted is EngineDevice.CUDA and not cuda:
        raise ConfigError("engine.device is cuda, but torch sees no CUDA device on this machine")
    return torch.device("cuda" if wanted is EngineDevice.CUDA or (wanted is EngineDevice.AUTO and cuda) else "cpu")


def compute_dtype(config: Config) -> ComputeDtype:
    """``engine.dtype`` resolved: ``auto`` is bfloat16 on a CPU with native bf16 arithmetic, float32 elsewhere.

    Every process that keys blocks for this model (server, cache service,
    router) resolves it here, from the same machine facts, so they agree.
    """
    wanted = config.engine.dtype
    if wanted is not ComputeDtype.AUTO:
        return wanted
    native = engine_device(config).type == "cpu" and bool(NATIVE_BF16.intersection(cpu_isa()))
    return ComputeDtype.BFLOAT16 if native else ComputeDtype.FLOAT32


def kv_dtype(config: Config) -> str:
    """``engine.kv_dtype`` resolved, by name: ``auto`` is the compute dtype; a float one must be it (the
    kernels take q and K/V in one dtype), float16 or an 8-bit one goes with either (the kernels widen them as
    they read). Resolved here for the same reason."""
    chosen, compute = config.engine.kv_dtype, compute_dtype(config)
    if chosen is KVDtype.AUTO:
        return compute.value
    if not chosen.any_compute and chosen.value != compute.value:
        raise ConfigError(
            f"engine.kv_dtype {chosen.value} with engine.dtype {compute.value}: a float32 or bfloat16 KV pool holds "
            f"the compute dtype (set kv_dtype auto, {compute.value}, float16, int8 or fp8_e4m3)"
        )
    return chosen.value


@dataclass(frozen=True)
class GpuFacts:
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_percent: int


@functools.cache
def _nvml() -> object | None:
    """The initialised ``pynvml`` module, or None where there is no NVIDIA driver (logged once)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:
        log.debug("NVML unavailable: %s", err)
        return None
    return pynvml


def gpu_facts(device: torch.device) -> GpuFacts | None:
    """NVML's view of ``device`` now, or None (not a CUDA device, or no NVML)."""
    if device.type != "cuda":
        return None
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        name = nvml.nvmlDeviceGetName(handle)
    except Exception as err:
        log.debug("NVML query failed: %s", err)
        return None
    return GpuFacts(name if isinstance(name, str) else name.decode(), int(mem.used), int(mem.total), int(util.gpu))
