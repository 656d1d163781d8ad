"""Run inside llama-cpp-python's venv: quantize a GGUF with llama.cpp's own quantizer.

Usage: ``python llamacpp_quantize.py IN OUT TYPE THREADS``; TYPE is a
llama.cpp file type (``Q4_0``, ``Q4_K_M``, ...), its usual mix: llama.cpp
picks each tensor's type as ``llama-quantize`` does (K-quants only where a
row is a multiple of 256 wide, the usual fallbacks elsewhere).
"""

from __future__ import annotations

import sys

import llama_cpp


def main() -> None:
    source, target, kind, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    if status != 0:
        raise SystemExit(f"llama_model_quantize failed ({status}) for {kind}")


if __name__ == "__main__":
    main()
