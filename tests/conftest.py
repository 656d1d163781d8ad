"""Skip tests marked ``cuda`` when no CUDA device is present (every CPU-only machine)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def loaded_model(tmp_path_factory: pytest.TempPathFactory):
    """The embedded SmolLM2-135M in float32, loaded once for the whole test session."""
    from kvtier.config import load_config
    from kvtier.engine.runtime import load_model

    data = tmp_path_factory.mktemp("model-data")
    return load_model(load_config(environ={"KVTIER_DATA_DIR": str(data)}), progress=False)


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own loading of the same GGUF (its dequantizer, its Q/K un-permutation): the oracle."""
    transformers = pytest.importorskip("transformers")
    from kvtier.model import default_gguf_path

    path = default_gguf_path()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
