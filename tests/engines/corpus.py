"""Header-only GGUF files, for tokenizer oracles on vocabularies no file here carries.

The corpus and llama.cpp's tokenization of it are
:mod:`kvtier.bench.llamacpp_oracle`'s, shared with ``kvtier bench models``.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kvtier.bench.llamacpp_oracle import corpus_texts, llamacpp_tokens

__all__ = ["corpus_texts", "llamacpp_tokens", "write_vocab_gguf"]


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
