"""Random-weight models in the shapes people run: for what depends on a model's shape, not on its weights.

Only two models can be had on this machine (SmolLM2 and Gemma 3 270M), so a
second architecture inside another engine, and speed at the size where a
cache matters, are measured on models whose weights are seeded random
numbers in a real model's exact shape. Time per token and bytes of KV
depend on the shape alone; output is compared only with the same engine's
own output on the same weights, never with a real model's text.

The weights are drawn at a scale that keeps logits far apart (a greedy
token is decided by a wide margin), so token-for-token comparisons of
cached against uncached runs stay meaningful on random weights. The
tokenizer is SmolLM2's: a shape's vocabulary may be larger (embedding rows
past the tokenizer's last id are never produced by it, as with Qwen's own
padded vocabulary).

A shape becomes a GGUF in three steps, each done once and kept under
``bench/.peer``: the random model written at F16 with SmolLM2's tokenizer,
then llama.cpp's own quantizer (``llama_model_quantize``, in
llama-cpp-python's venv) makes the K-quant mix people download, and the
file says what it is (``kvtier.random_weights``), so every benchmark on it
can say so. vLLM gets that very file dequantized (``kvtier export-hf``):
all three engines run the same weights.

transformers is imported only when a model is built: it is the ``hf`` extra,
as for ``kvtier export-hf``.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import KVTierError
from kvtier.model.config import Architecture

if TYPE_CHECKING:
    from kvtier.model.gguf import GGUFMetadata

REPO = Path(__file__).resolve().parents[2]
BUILT = REPO / "bench" / ".peer"
"""Where built shapes are kept (ignored by git)."""
QUANTIZER = REPO / "bench" / "runners" / "llamacpp_quantize.py"
RANDOM_KEY = "kvtier.random_weights"
"""The GGUF metadata flag a random-weight file carries: its figures are speed, never quality."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""What a built directory takes from the tokenizer's directory (SmolLM2's Hugging Face export)."""


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions, as its ``config.json`` names them."""

    name: str
    arch: Architecture
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tie_embeddings: bool
    rope_theta: float
    context: int

    def hf_config(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": self.context,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": self.tie_embeddings,
            "rope_theta": self.rope_theta,
        }


QWEN2_SMALL = Shape(
    "qwen2-small-random",
    Architecture.QWEN2,
    hidden=512,
    intermediate=1408,
    layers=4,
    heads=8,
    kv_heads=2,
    vocab=49152,
    tie_embeddings=True,
    rope_theta=1000000.0,
    context=8192,
)
"""A small qwen2 (Q/K/V biases, GQA, tied embeddings): the second architecture inside vLLM, quick to start."""

QWEN2_5_1_5B = Shape(
    "qwen2.5-1.5b-random",
    Architecture.QWEN2,
    hidden=1536,
    intermediate=8960,
    layers=28,
    heads=12,
    kv_heads=2,
    vocab=151936,
    tie_embeddings=True,
    rope_theta=1000000.0,
    context=32768,
)
"""Qwen2.5-1.5B(-Instruct)'s published ``config.json`` dimensions."""


def random_model(shape: Shape, seed: int = 0) -> Any:
    """A seeded float32 ``transformers`` model of ``shape``, weights drawn so that greedy choices are clear.

    Matrices get a standard deviation of 2/sqrt(fan-in) (their outputs keep
    their inputs' scale), the embedding 1 (so tied logits spread by about
    sqrt(hidden)), biases 0.5, norm weights 1 ± 0.1.
    """
    import transformers

    if shape.arch is not Architecture.QWEN2:
        raise KVTierError(f"no random {shape.arch.value} shape is built here")
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**shape.hf_config())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return redraw(model, lambda name, p: 1.0 if name.endswith("embed_tokens.weight") else 2.0 / math.sqrt(p.shape[1]))


def redraw(model: Any, matrix_std: Callable[[str, torch.Tensor], float]) -> Any:
    """``model``'s weights drawn again from the seeded generator: norms 1 ± 0.1, biases 0.5, matrices ``matrix_std``.

    The scales transformers initialises with give logits too close to call;
    these make a greedy choice clear (the tests' tiny models use them too).
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(matrix_std(name, p) * torch.randn_like(p))
    return model


def random_hf_dir(shape: Shape, out: Path, *, tokenizer_dir: Path, seed: int = 0) -> Path:
    """``shape`` as a Hugging Face directory at ``out`` (float32 safetensors + the tokenizer), built once.

    Written through a sibling and renamed at the end, so an interrupted
    build never leaves a directory that looks done.
    """
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    model = random_model(shape, seed)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, tmp / name)
    (tmp / "kvtier-shape.json").write_text(json.dumps({"shape": shape.name, "seed": seed, "random_weights": True}))
    tmp.rename(out)
    return out


SHAPES = {s.name: s for s in (QWEN2_SMALL, QWEN2_5_1_5B)}


def random_weights(metadata: GGUFMetadata) -> bool:
    """Whether a GGUF was built here from random weights (its figures are speed, never quality)."""
    return bool(metadata.get(RANDOM_KEY, False))


def gguf_path(shape: Shape, kind: str = "Q4_K_M") -> Path:
    return BUILT / f"{shape.name}-{kind.lower()}.gguf"


def random_gguf(
    shape: Shape,
    *,
    tokenizer: GGUFMetadata,
    llama_python: Path,
    kind: str = "Q4_K_M",
    threads: int = 2,
    seed: int = 0,
    out: Path | None = None,
) -> Path:
    """``shape`` with seeded random weights as a ``kind`` GGUF (llama.cpp's mix), built once; returns its path.

    ``tokenizer``: the metadata of the GGUF whose tokenizer it carries;
    ``llama_python``: llama-cpp-python's venv, whose quantizer makes the
    K-quant mix.
    """
    from gguf import GGMLQuantizationType

    from kvtier.model.hf_gguf import write_gguf

    out = out or gguf_path(shape, kind)
    if out.exists():
        return out
    if not llama_python.exists():
        raise KVTierError(f"building {out.name} needs llama.cpp's quantizer: no venv at {llama_python}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-shape-", dir=out.parent) as tmp:
        dense = Path(tmp) / "f16.gguf"
        model = random_model(shape, seed)
        extra = {"general.name": shape.name, RANDOM_KEY: True, "kvtier.random_seed": seed}
        write_gguf(model, shape.arch, dense, tokenizer=tokenizer, matrices=GGMLQuantizationType.F16, extra=extra)
        del model
        partial = Path(tmp) / out.name
        cmd = [str(llama_python), str(QUANTIZER), str(dense), str(partial), kind, str(threads)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        partial.rename(out)
    return out
