"""Every BPE pre-tokenizer kvtier accepts, against llama.cpp's own tokenizer on the same vocabulary file.

No Llama 3 or Qwen file can be downloaded here, so the vocabulary is
SmolLM2's, written into a header-only GGUF under each ``tokenizer.ggml.pre``:
llama.cpp then splits with that pre type's expressions and BPE's its pieces
with that vocabulary, exactly the code paths a Llama 3 or Qwen2 file takes.
The llama-bpe file carries no ``add_bos_token`` key, so llama.cpp's default
for that group (add BOS) is checked too. SentencePiece vocabularies are
checked on Gemma 3's file (``test_gemma3.py``). Runs under ``--engines``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.model import default_gguf_path, load_tokenizer, read_gguf_metadata
from tests.engines.corpus import corpus_texts, llamacpp_tokens, write_vocab_gguf

pytestmark = pytest.mark.engines

HEADERS = {
    "smollm": {},
    "llama-bpe": {"tokenizer.ggml.add_bos_token": None},
    "qwen2": {},
}


@pytest.mark.parametrize("pre", sorted(HEADERS))
def test_ids_are_llama_cpps(pre: str, llama_python: Path, tmp_path: Path) -> None:
    gguf = write_vocab_gguf(
        default_gguf_path(), tmp_path / f"{pre}.gguf", **{"tokenizer.ggml.pre": pre}, **HEADERS[pre]
    )
    texts = corpus_texts(tmp_path)
    theirs = llamacpp_tokens(llama_python, gguf, texts)
    tokenizer = load_tokenizer(read_gguf_metadata(gguf))
    differ = [p.name for p, text in texts.items() if tokenizer.encode_text(text) != theirs[p]]
    assert not differ, f"{len(differ)} of {len(texts)} texts tokenized otherwise than llama.cpp: {differ}"
    assert sum(len(ids) for ids in theirs.values()) > 10_000
    assert all(ids[0] == tokenizer.bos_id for ids in theirs.values()) == (pre == "llama-bpe")
