"""What the in-engine tests share: llama-cpp-python's venv, found once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.bench.engines import LLAMACPP_PYTHON

LLAMA_PYTHON = Path(os.environ.get("ENGINES_LLAMACPP_PYTHON", LLAMACPP_PYTHON))


@pytest.fixture(scope="module")
def llama_python() -> Path:
    if not LLAMA_PYTHON.exists():
        pytest.skip(f"no llama-cpp-python venv at {LLAMA_PYTHON} (make .venv-peer-llamacpp/.kvtier builds it)")
    return LLAMA_PYTHON
