"""Read a Llama-family GGUF file (:class:`~kvtier.model.config.Architecture`) into a
:class:`ModelConfig` and Hugging Face-named weights.

The ``gguf`` package does the reading (``GGUFReader``) and the dequantizing
(``gguf.quants.dequantize``); this module only renames, reshapes and checks.
Two things about the file layout decide correctness here:

* **Dimension order.** GGUF stores ``ne`` fastest-varying first, so a tensor whose
  reader shape is ``[576, 1536]`` is a ``(1536, 576)`` row-major matrix (the
  ``(out_features, in_features)`` of ``nn.Linear``). Every tensor is reshaped to the
  reversed ``ne`` and then checked against the shape the config implies.
* **Q/K row order.** For ``llama`` files, llama.cpp's ``convert_hf_to_gguf.py`` permutes
  the rows of ``q_proj`` and ``k_proj`` so that its interleaved RoPE (pairs ``2i, 2i+1``)
  computes what Hugging Face's rotate-half RoPE (pairs ``i, i + d/2``) did. We undo it, so
  the weights obey the :class:`ModelConfig` contract. Architectures llama.cpp runs with
  rotate-half ("NEOX") RoPE, such as ``qwen2`` and ``qwen3``, are stored unpermuted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, ReaderField
from gguf.quants import dequantize
from tqdm import tqdm

from kvtier.model.blocks import BLOCK_FORMATS, QuantBlocks, repack
from kvtier.model.config import TRAITS, Architecture, ModelConfig
from kvtier.private import make_private, private_dir

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = frozenset(a.value for a in Architecture)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma norms its attention's and MLP's outputs too, so llama.cpp's "ffn_norm" is the one before the MLP there
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

FINGERPRINT_CACHE_FILE = "model_fingerprints.json"


@dataclass(frozen=True)
class GGUFMetadata:
    """The key/value header of a GGUF file, as plain Python values.

    Kept whole (not just what :class:`ModelConfig` needs) because the tokenizer and the
    chat template are rebuilt from it. ``GGUF.*`` pseudo-fields (version, counts) are
    left out: they describe the container, not the model.
    """

    values: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.values["general.architecture"])

    @property
    def chat_template(self) -> str | None:
        return self.values.get("tokenizer.chat_template")


class GGUFModel(NamedTuple):
    """What :func:`load_gguf` returns; unpacks as ``config, weights, metadata``."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    metadata: GGUFMetadata


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, *, progress: bool = True) -> GGUFModel:
    """Dequantize every tensor of a Llama GGUF into ``dtype`` tensors with Hugging Face names.

    Dequantization always goes through float32 (what ``gguf.quants`` produces) and is cast
    to ``dtype`` last, so a bf16 load equals the float32 load rounded once. Unknown
    tensors (biases, ``rope_freqs``) raise rather than being dropped: silently ignoring
    one would give a model that runs and is wrong.
    """
    return _load(GGUFReader(Path(path), "r"), Path(path), dtype, progress)


def load_gguf_with_blocks(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, *, progress: bool = True
) -> tuple[GGUFModel, dict[str, QuantBlocks]]:
    """:func:`load_gguf` and :func:`load_gguf_blocks` from one parse of the file (the header alone takes seconds)."""
    reader = GGUFReader(Path(path), "r")
    model = _load(reader, Path(path), dtype, progress)
    return model, _blocks(reader, model.config)


def _load(reader: GGUFReader, path: Path, dtype: torch.dtype, progress: bool) -> GGUFModel:
    metadata = _read_metadata(reader)
    tensor_names = {t.name for t in reader.tensors}
    config = _config_from(metadata, tensor_names, reader)
    expected = _expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    bar = tqdm(
        reader.tensors, desc=f"loading {path.name}", unit="tensor", leave=False, file=sys.stderr, disable=not progress
    )
    for tensor in bar:
        hf_name = hf_tensor_name(tensor.name, config.architecture)
        array = _dequantized(tensor)
        if config.traits.interleaved_qk and hf_name.endswith("q_proj.weight"):
            array = unpermute_qk(array, config.num_heads)
        elif config.traits.interleaved_qk and hf_name.endswith("k_proj.weight"):
            array = unpermute_qk(array, config.num_kv_heads)
        shape = expected.get(hf_name)
        if shape is None:
            raise ValueError(f"{path}: {tensor.name} ({hf_name}) has no place in a {config.num_layers}-layer model")
        if array.shape != shape:
            raise ValueError(f"{path}: {tensor.name} has shape {array.shape}, expected {shape}")
        weights[hf_name] = torch.from_numpy(array).to(dtype)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return GGUFModel(config, weights, metadata)


def load_gguf_blocks(path: str | os.PathLike[str]) -> dict[str, QuantBlocks]:
    """Every matrix in a block format (:data:`~kvtier.model.blocks.BLOCK_FORMATS`) in its decode-kernel form.

    Under its Hugging Face name, rows in :func:`load_gguf`'s order: Q and K rows
    get the same un-permutation as the dequantized weights, so row *r* here is
    row *r* there. Tensors in other formats are left out; their users fall back
    to the dequantized weights.
    """
    reader = GGUFReader(Path(path), "r")
    return _blocks(reader, _config_from(_read_metadata(reader), {t.name for t in reader.tensors}, reader))


def _blocks(reader: GGUFReader, config: ModelConfig) -> dict[str, QuantBlocks]:
    out: dict[str, QuantBlocks] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in BLOCK_FORMATS or len(tensor.shape) < 2:
            continue
        rows = int(tensor.shape[-1])
        blocks = repack(tensor.data.view(np.ndarray), tensor.tensor_type, rows)
        hf_name = hf_tensor_name(tensor.name, config.architecture)
        heads = config.num_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads
        if config.traits.interleaved_qk and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            q, d, m, d_fac, m_fac = (
                None if a is None else unpermute_qk(a, heads)
                for a in (blocks.q, blocks.d, blocks.m, blocks.d_fac, blocks.m_fac)
            )
            assert q is not None and d is not None
            blocks = blocks._replace(q=q, d=d, m=m, d_fac=d_fac, m_fac=m_fac)
        out[hf_name] = blocks
    return out


def read_gguf_metadata(path: str | os.PathLike[str]) -> GGUFMetadata:
    """Only the header (tokenizer, chat template, shape), for callers that need no weights."""
    return _read_metadata(GGUFReader(Path(path), "r"))


def weight_types(path: str | os.PathLike[str]) -> dict[str, int]:
    """How many weight matrices of each GGML type the file holds (norms and other vectors left out), most first."""
    reader = GGUFReader(Path(path), "r")
    return dict(Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1).most_common())


def _read_metadata(reader: GGUFReader) -> GGUFMetadata:
    """Every model key of the header, decoded by ``gguf`` (``ReaderField.contents``)."""
    values = {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return GGUFMetadata(values)


def _field_value(field: ReaderField) -> Any:
    """A field's value; float32 scalars become the shortest decimal that round-trips them.

    GGUF keeps ``1e-05`` as the float32 nearest to it, which reads back as
    ``9.999999747378752e-06``. The shortest float32 decimal (numpy's ``str``) recovers the value the
    model's authors wrote, so configs compare equal to the original ones.
    """
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value


def hf_tensor_name(gguf_name: str, architecture: Architecture = Architecture.LLAMA) -> str:
    """The Hugging Face name of a llama.cpp tensor name (``blk.3.attn_q.weight``, ``blk.3.attn_q.bias``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if architecture is Architecture.GEMMA3 else _LAYER_NAMES
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{match.group(1)}.{names[match.group(2)]}.{match.group(3)}"


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(weights, n_head, n_head_kv)`` on Q or K rows.

    The converter views each head's ``head_dim`` rows as ``(2, head_dim // 2)``
    (rotate-half halves) and transposes them to ``(head_dim // 2, 2)`` (interleaved
    pairs). The inverse views the stored rows as ``(head_dim // 2, 2)`` and transposes
    back. For K the converter used the KV head count, so callers pass that.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    half = rows // n_head // 2
    return np.ascontiguousarray(weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape))


def _dequantized(tensor: Any) -> np.ndarray:
    """One tensor as a writable float32 array in numpy (row-major) order.

    ``tensor.shape`` is GGUF's ``ne`` (fastest first); reversing it gives the numpy shape.
    Unquantized tensors come back as read-only views of the memory map, hence the copy.
    """
    array = dequantize(tensor.data.view(np.ndarray), tensor.tensor_type)  # plain view: memmap slicing is slow
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32, order="C")
    return array


def _config_from(metadata: GGUFMetadata, tensor_names: set[str], reader: GGUFReader) -> ModelConfig:
    """The config from ``{arch}.*`` keys; refuses what the forward pass cannot honour."""
    arch = metadata.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    architecture = Architecture(arch)
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"RoPE scaling {scaling!r} is not supported")
    hidden = int(metadata[f"{arch}.embedding_length"])
    heads = int(metadata[f"{arch}.attention.head_count"])
    kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(embed.shape[1])
    declared_vocab = metadata.get(f"{arch}.vocab_size")
    if declared_vocab is not None and int(declared_vocab) != vocab:
        raise ValueError(f"{arch}.vocab_size says {declared_vocab} but token_embd has {vocab} rows")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    layers = int(metadata[f"{arch}.block_count"])
    window, sliding = _sliding_windows(metadata, architecture, layers)
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(metadata[f"{arch}.feed_forward_length"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        context_length=int(metadata[f"{arch}.context_length"]),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        architecture=architecture,
        sliding_window=window,
        sliding_layers=sliding,
        local_rope_theta=float(metadata.get(f"{arch}.rope.freq_base_swa", 0) or 0)
        or TRAITS[architecture].local_rope_theta,
    )


def _sliding_windows(
    metadata: GGUFMetadata, architecture: Architecture, layers: int
) -> tuple[int | None, tuple[bool, ...]]:
    """The window and which layers use it: the file's pattern when it has one, else the architecture's.

    A pattern ``n`` makes every n-th layer global (llama.cpp's
    ``set_swa_pattern``: layer ``i`` slides when ``i % n < n - 1``); an
    array names each layer.
    """
    arch = architecture.value
    window = metadata.get(f"{arch}.attention.sliding_window")
    if not window:
        return None, ()
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", TRAITS[architecture].sliding_pattern)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{arch}.attention.sliding_window_pattern names {len(pattern)} of {layers} layers")
        return int(window), tuple(bool(p) for p in pattern)
    n = int(pattern)
    if n <= 0:
        return None, ()
    return int(window), tuple(i % n < n - 1 for i in range(layers))


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the config implies, with its ``nn.Linear``-style shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    per_layer = {
        "self_attn.q_proj": (q_rows, hidden),
        "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden),
        "self_attn.o_proj": (hidden, q_rows),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
    }
    per_layer = {f"{name}.weight": shape for name, shape in per_layer.items()}
    traits = config.traits
    if traits.post_norms:
        del per_layer["post_attention_layernorm.weight"]
        per_layer |= {f"{n}.weight": (hidden,) for n in ("pre_feedforward_layernorm", "post_attention_layernorm")}
        per_layer |= {"post_feedforward_layernorm.weight": (hidden,)}
    if traits.qkv_bias:
        per_layer |= {"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,)}
        per_layer |= {"self_attn.v_proj.bias": (kv_rows,)}
    if traits.qk_norm:
        per_layer |= {"self_attn.q_norm.weight": (config.head_dim,), "self_attn.k_norm.weight": (config.head_dim,)}
    for layer in range(config.num_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    return shapes


def model_fingerprint(path: str | os.PathLike[str], dtype: torch.dtype, cache_dir: str | os.PathLike[str]) -> str:
    """``sha256:<hex of the file>:<dtype>``: what KV computed from these weights depends on.

    The dtype is part of it because the same weights computed in bf16 and float32 give
    different KV; block keys rooted in this string never mix the two.
    """
    return f"sha256:{file_sha256(path, cache_dir)}:{str(dtype).removeprefix('torch.')}"


def file_sha256(path: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, remembered in ``cache_dir`` by (resolved path, size, mtime_ns).

    Hashing reads the whole file, which is quick for the small default model
    but takes seconds for a multi-GB one, on every start; the cache makes it a
    ``stat``. The file is stat-ed *before* hashing, so a file rewritten while
    being hashed is recorded under its old mtime and hashed again next time. A
    cache that cannot be read or written only costs the rehash.
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    cache_file = Path(cache_dir) / FINGERPRINT_CACHE_FILE
    make_private(cache_file)  # loosened since it was written: it names the model files this user serves
    entries = _read_fingerprint_cache(cache_file)
    entry = entries.get(str(resolved))
    if (
        isinstance(entry, dict)
        and entry.get("size") == stat.st_size
        and entry.get("mtime_ns") == stat.st_mtime_ns
        and isinstance(entry.get("sha256"), str)
    ):
        return entry["sha256"]
    with resolved.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    entries[str(resolved)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    _write_fingerprint_cache(cache_file, entries)
    return digest


def _read_fingerprint_cache(cache_file: Path) -> dict[str, Any]:
    try:
        entries = json.loads(cache_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # ValueError covers JSONDecodeError and bad UTF-8
        logger.warning("ignoring unreadable fingerprint cache %s: %s", cache_file, exc)
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_fingerprint_cache(cache_file: Path, entries: dict[str, Any]) -> None:
    """Replace the cache atomically, so a crash or a concurrent reader never sees half a file."""
    tmp_name: str | None = None
    try:
        private_dir(cache_file.parent)  # the data directory: 0700, like everything kvtier keeps there
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=cache_file.parent, prefix=cache_file.name, suffix=".tmp", delete=False
        ) as tmp:
            tmp_name = tmp.name
            json.dump(entries, tmp, indent=1, sort_keys=True)
        os.replace(tmp_name, cache_file)
    except OSError as exc:
        logger.warning("could not write fingerprint cache %s: %s", cache_file, exc)
        if tmp_name is not None:
            Path(tmp_name).unlink(missing_ok=True)
