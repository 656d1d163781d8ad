"""Run inside llama-cpp-python's venv: llama.cpp's tokenization of each text file, as a user's request would get it.

Usage: ``python llamacpp_tokenize.py GGUF FILE...``; prints ``{FILE: ids}``
as JSON: BOS as the file asks, control-token strings in the text left as
text (``special=False``, what a client's text gets).
"""

from __future__ import annotations

import json
import sys

from llama_cpp import Llama


def main() -> None:
    vocab = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
    out = {}
    for path in sys.argv[2:]:
        with open(path, encoding="utf-8") as f:
            out[path] = vocab.tokenize(f.read().encode("utf-8"), add_bos=True, special=False)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
