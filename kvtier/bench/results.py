"""Where benchmark results go: a dated JSON (plus a ``-latest`` copy) and a PNG beside it."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any


def write(result: dict[str, Any], out_dir: Path, name: str) -> Path:
    """``<name>-<UTC stamp>.json`` and ``<name>-latest.json``; the stamp is ``result["setup"]["date"]``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = result["setup"]["date"].replace(":", "").replace("-", "")
    body = json.dumps(result, indent=2)
    path = out_dir / f"{name}-{stamp}.json"
    path.write_text(body)
    (out_dir / f"{name}-latest.json").write_text(body)
    return path


def pyplot() -> ModuleType | None:
    """matplotlib's pyplot on the headless Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
