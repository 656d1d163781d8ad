"""GGUF files the engines' oracles need and nobody ships: header-only ones and a float32 one.

The corpus and llama.cpp's tokenization of it are
:mod:`kvtier.bench.llamacpp_oracle`'s, shared with ``kvtier bench models``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

from kvtier.bench.llamacpp_oracle import corpus_texts, llamacpp_tokens

__all__ = ["corpus_texts", "llamacpp_tokens", "write_dense_gguf", "write_vocab_gguf"]


def write_vocab_gguf(source: Path, target: Path, **changes: object) -> Path:
    """``source``'s header alone (no tensors), with keys changed (a value of None drops the key).

    llama.cpp's ``vocab_only`` load reads the header and nothing else, so this
    is a file both tokenizers accept, with any pre-tokenizer named in it.
    """
    reader = GGUFReader(source, "r")
    writer = _header(reader, target, changes)
    return _finish(writer, target)


def write_dense_gguf(source: Path, target: Path) -> Path:
    """``source`` with every tensor dequantized to F32 as stored (Q/K rows still in llama.cpp's order).

    The input llama.cpp's quantizer wants: each type is then made from the
    same float weights, as a user quantizes a model they converted.
    """
    reader = GGUFReader(source, "r")
    writer = _header(reader, target, {"general.file_type": 0})
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        array = np.asarray(dequantize(tensor.data.view(np.ndarray), tensor.tensor_type), dtype=np.float32)
        writer.add_tensor(tensor.name, np.ascontiguousarray(array.reshape(shape)))
    return _finish(writer, target)


def _header(reader: GGUFReader, target: Path, changes: dict[str, object]) -> GGUFWriter:
    writer = GGUFWriter(target, arch=str(reader.fields["general.architecture"].contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in changes:
            continue
        sub_type = field.types[-1] if field.types[0] is GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    for name, value in changes.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_key_value(name, value, GGUFValueType.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(name, value, GGUFValueType.UINT32)
        else:
            writer.add_key_value(name, value, GGUFValueType.STRING)
    return writer


def _finish(writer: GGUFWriter, target: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
