"""Text nobody here wrote, and llama.cpp's own tokenization of it, for the tokenizer oracles.

The corpus is what this machine already holds: CPython's sources and tests
(docs, code, digits, whitespace runs, emoji, Cyrillic, and its CJK codec
samples in Chinese, Japanese and Korean) and Debian's GPL text. llama.cpp
tokenizes it in llama-cpp-python's venv
(``tests/engines/runners/llamacpp_tokenize.py``), as a client's text would be.
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter

RUNNERS = Path(__file__).resolve().parent / "runners"
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


def corpus_texts(folder: Path) -> dict[Path, str]:
    """The first :data:`SLICE` characters of each corpus file, written under ``folder`` for the runner."""
    texts = {}
    for source in CORPUS:
        assert source.is_file(), source
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


def write_vocab_gguf(source: Path, target: Path, **changes: object) -> Path:
    """``source``'s header alone (no tensors), with keys changed (a value of None drops the key).

    llama.cpp's ``vocab_only`` load reads the header and nothing else, so this
    is a file both tokenizers accept, with any pre-tokenizer named in it.
    """
    reader = GGUFReader(source, "r")
    writer = GGUFWriter(target, arch=str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in changes:
            continue
        sub_type = field.types[-1] if field.types[0] is GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for name, value in changes.items():
        if value is not None:
            kind = GGUFValueType.BOOL if isinstance(value, bool) else GGUFValueType.STRING
            writer.add_key_value(name, value, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
