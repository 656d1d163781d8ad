"""What the in-engine tests share: the engines' venvs, found once (vLLM's with SmolLM2's HF copy beside it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.bench import engines

LLAMA_PYTHON = Path(os.environ.get("ENGINES_LLAMACPP_PYTHON", engines.LLAMACPP_PYTHON))
VLLM_PYTHON = Path(os.environ.get("ENGINES_VLLM_PYTHON", engines.VLLM_PYTHON))


@pytest.fixture(scope="module")
def llama_python() -> Path:
    if not LLAMA_PYTHON.exists():
        pytest.skip(f"no llama-cpp-python venv at {LLAMA_PYTHON} (make .venv-peer-llamacpp/.kvtier builds it)")
    return LLAMA_PYTHON


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (make test-engines builds it)")
    from kvtier.bench.peer.runners import ensure_hf_dir
    from kvtier.model import default_gguf_path

    ensure_hf_dir(default_gguf_path(), engines.HF_DIR)
    return VLLM_PYTHON
