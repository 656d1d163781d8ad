"""The engine's device from config, and what /stats says produced its figures."""

from __future__ import annotations

import pytest
import torch

from kvtier import hardware, openmp
from kvtier.config import ComputeDtype, ConfigError, load_config
from kvtier.hardware import ISA_FLAGS, compute_dtype, cpu_isa, engine_device, gpu_facts
from kvtier.server.metrics import hardware_report


def config(device: str):
    return load_config(environ={"KVTIER_ENGINE__DEVICE": device})


def test_cpu_device_and_report() -> None:
    assert engine_device(config("cpu")) == torch.device("cpu")
    assert set(cpu_isa()) <= set(ISA_FLAGS)
    assert gpu_facts(torch.device("cpu")) is None
    report = hardware_report(torch.device("cpu"), torch.float32)
    assert (report.device, report.dtype, report.gpu) == ("cpu", "float32", None)
    assert report.cpu_isa == list(cpu_isa())
    assert report.omp_wait_policy == openmp.wait_policy  # what torch loaded with (tests/test_openmp.py)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_auto_is_cpu_and_cuda_is_refused_without_a_gpu() -> None:
    assert engine_device(config("auto")) == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA device"):
        engine_device(config("cuda"))


def test_unknown_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        config("tpu")


def test_metrics_carry_the_device() -> None:
    class Report:
        hardware = hardware_report(torch.device("cpu"), torch.bfloat16)

    from kvtier.server.metrics import _hardware_families

    (info,) = list(_hardware_families(Report()))  # no GPU: the info gauge alone
    assert info.name == "kvtier_engine_device_info"
    assert info.samples[0].labels == {"device": "cpu", "dtype": "bfloat16"}


@pytest.mark.cuda
def test_cuda_device_and_nvml_facts() -> None:
    assert engine_device(config("auto")).type == "cuda"
    facts = gpu_facts(torch.device("cuda"))
    assert facts is not None and 0 < facts.memory_used_bytes <= facts.memory_total_bytes
    report = hardware_report(torch.device("cuda:0"), torch.float32)
    assert report.gpu is not None and report.gpu.name


def test_auto_dtype_is_bfloat16_exactly_where_the_cpu_has_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(environ={"KVTIER_ENGINE__DEVICE": "cpu"})
    assert cfg.engine.dtype is ComputeDtype.AUTO
    native = bool({"avx512_bf16", "amx_bf16"} & set(cpu_isa()))  # this machine, read from /proc/cpuinfo
    assert compute_dtype(cfg) is (ComputeDtype.BFLOAT16 if native else ComputeDtype.FLOAT32)
    for isa, want in ((("avx2",), ComputeDtype.FLOAT32), (("avx2", "avx512f", "avx512_bf16"), ComputeDtype.BFLOAT16)):
        monkeypatch.setattr(hardware, "cpu_isa", lambda isa=isa: isa)  # another machine of this kind
        assert compute_dtype(cfg) is want
    for explicit in (ComputeDtype.FLOAT32, ComputeDtype.BFLOAT16):  # a set dtype is kept on any machine
        fixed = load_config(environ={"KVTIER_ENGINE__DTYPE": explicit.value})
        assert compute_dtype(fixed) is explicit
