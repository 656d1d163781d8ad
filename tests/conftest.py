"""Skip tests marked ``cuda`` when no CUDA device is present; mark the slow ones ``slow``.

``slow``: every test that loads the real model (the ``loaded_model`` or
``hf_model`` fixture) or starts a real ``kvtier serve`` (``tests.server.live``).
``pytest -m "not slow"`` runs the rest, the fast suite, in about a minute on two cores.

``engines``: tests that run kvtier inside a real vLLM, llama-cpp-python or
SGLang, each from its own venv. They need those venvs, which take many
minutes to build, so they run only under ``--engines`` (``make test-engines``);
``make test`` reports them skipped.

``timing``: statistical tests over wall-clock samples (cross-tenant timing).
A suite that shares its cores with itself is no place for them (a run in
the whole suite once gave p < 1e-4 where alone it gives p > 0.05), and
``make test`` holds no wall-clock assertion; they run under ``--timing``
(``make test-timing``), alone, and ``kvtier bench tenants`` gives the figures.
"""

from __future__ import annotations

import pytest
import torch

from tests.remote import redis_cluster, redis_server, redis_session  # noqa: F401  (real redis-server fixtures)

MODEL_FIXTURES = {"loaded_model", "hf_model"}


def _is_slow(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ()))
    module = getattr(item, "module", None)
    return bool(fixtures & MODEL_FIXTURES) or "running" in vars(module or object)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--engines", action="store_true", help="run the in-engine tests (make test-engines)")
    parser.addoption("--timing", action="store_true", help="run the statistical timing tests (make test-timing)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--engines"):
        skip_engines = pytest.mark.skip(reason="runs inside a real engine's venv: make test-engines")
        for item in items:
            if "engines" in item.keywords:
                item.add_marker(skip_engines)
    if not config.getoption("--timing"):
        skip_timing = pytest.mark.skip(reason="a statistical wall-clock test: make test-timing")
        for item in items:
            if "timing" in item.keywords:
                item.add_marker(skip_timing)
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
    env = {"KVTIER_DATA_DIR": str(data), "KVTIER_ENGINE__DTYPE": "float32"}  # the same on every CPU
    return load_model(load_config(environ=env), progress=False)


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
