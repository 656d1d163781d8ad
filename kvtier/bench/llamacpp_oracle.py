"""llama.cpp as the oracle for a GGUF: its tokens of real text, and its greedy choice at every position.

llama.cpp runs in llama-cpp-python's venv (``make .venv-peer-llamacpp/.kvtier``),
through the runners in ``bench/runners/`` (``llamacpp_tokenize.py``,
``llamacpp_logits.py``). The text is what this machine already holds and
nobody here wrote: CPython's sources and tests (docs, code, digits,
whitespace runs, emoji, Cyrillic, and its CJK codec samples in Chinese,
Japanese and Korean) and Debian's GPL text.
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

from kvtier.bench.engines import RUNNERS

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS = [
    STDLIB / "json" / "__init__.py",
    STDLIB / "textwrap.py",
    STDLIB / "this.py",
    STDLIB / "test" / "test_unparse.py",  # emoji
    STDLIB / "test" / "test_doctest2.py",  # Cyrillic
    STDLIB / "test" / "test_tokenize.py",  # whitespace runs, numbers
    *sorted((STDLIB / "test" / "cjkencodings").glob("*-utf8.txt")),
    Path("/usr/share/common-licenses/GPL-3"),
]
SLICE = 6000  # characters of each file
AGREEMENT_TEXT = STDLIB / "json" / "__init__.py"  # docs and code, about 1,500 tokens in its first 5,000 characters
AGREEMENT_CHARS = 5000


def corpus_texts(folder: Path) -> dict[Path, str]:
    """The first :data:`SLICE` characters of each corpus file present, written under ``folder`` for the runner."""
    texts = {}
    for source in CORPUS:
        if not source.is_file():
            continue
        path = folder / f"{len(texts)}-{source.name}"
        texts[path] = source.read_text(encoding="utf-8")[:SLICE]
        path.write_text(texts[path], encoding="utf-8")
    return texts


def llamacpp_tokens(llama_python: Path, gguf: Path, texts: dict[Path, str]) -> dict[Path, list[int]]:
    """llama.cpp's ids for each text (BOS as the file asks, control-token strings left as text)."""
    run = subprocess.run(
        [str(llama_python), str(RUNNERS / "llamacpp_tokenize.py"), str(gguf), *map(str, texts)],
        capture_output=True,
        text=True,
        check=True,
    )
    ids = json.loads(run.stdout)
    return {path: ids[str(path)] for path in texts}


def llamacpp_choices(llama_python: Path, gguf: Path, text_file: Path, threads: int) -> dict[str, Any]:
    """``{"ids", "f32": {"argmax", "margin"}, "f16": {...}}``: llama.cpp's tokens of the text and, with its K/V in
    float32 and in float16, its most likely next token at every position and that logit's lead."""
    run = subprocess.run(
        [str(llama_python), str(RUNNERS / "llamacpp_logits.py"), str(gguf), str(text_file), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(run.stdout)
    return result


__all__ = [
    "AGREEMENT_CHARS",
    "AGREEMENT_TEXT",
    "CORPUS",
    "SLICE",
    "corpus_texts",
    "llamacpp_choices",
    "llamacpp_tokens",
]
