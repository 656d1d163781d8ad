"""Run inside llama-cpp-python's venv: llama.cpp's own tokenization of a text and its greedy choice at every position.

Usage: ``python llamacpp_logits.py GGUF TEXT_FILE THREADS``; prints one JSON
object: ``ids`` (llama.cpp's tokens of the text, BOS first) and, for K/V
kept in float32 and in float16 (llama.cpp's default), ``argmax[i]``: its
most likely token after ``ids[: i + 1]``, and ``margin[i]``: how far that
logit leads the runner-up. The two precisions show how far llama.cpp's own
choices move under rounding alone: near ties fall either way.
"""

from __future__ import annotations

import json
import sys

import numpy as np
from llama_cpp import Llama

GGML_TYPE = {"f32": 0, "f16": 1}


def choices(gguf: str, ids: list[int], threads: int, kv: str) -> dict[str, list[float] | list[int]]:
    llm = Llama(
        model_path=gguf,
        n_ctx=len(ids) + 8,
        n_batch=512,
        n_threads=threads,
        logits_all=True,
        type_k=GGML_TYPE[kv],
        type_v=GGML_TYPE[kv],
        verbose=False,
    )
    llm.eval(ids)
    scores = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    top2 = np.sort(np.partition(scores, -2, axis=1)[:, -2:], axis=1)
    out = {"argmax": scores.argmax(axis=1).tolist(), "margin": (top2[:, 1] - top2[:, 0]).tolist()}
    llm.close()
    return out


def main() -> None:
    gguf, text_file, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    vocab = Llama(model_path=gguf, vocab_only=True, verbose=False)
    ids = vocab.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    print(json.dumps({"ids": ids, **{kv: choices(gguf, ids, threads, kv) for kv in GGML_TYPE}}))


if __name__ == "__main__":
    main()
