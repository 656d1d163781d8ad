"""The tokenizer a GGUF file describes, rebuilt with ``tokenizers`` from its metadata.

A GGUF carries no ``tokenizer.json``: it stores the vocabulary, the merges, a type per
token and the *name* of a pre-tokenizer (``tokenizer.ggml.pre``). The name is what
decides how text is split before BPE, and a wrong split gives valid-looking but
different ids (so different KV, so silent cache misses and worse outputs). Only the
names we map to a known split are accepted.

``"smollm"`` (SmolLM/SmolLM2, the same split llama.cpp uses for StarCoder) first
isolates every digit, then applies the GPT-2 regex: llama.cpp's expressions
``\\p{N}`` then ``'s|'t|...| ?\\p{N}+|...|\\s+(?!\\S)``, and the model's own
``tokenizer.json`` ``Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]``.
Isolating digits also changes how whitespace before a number is cut (``"a   1"``
gives ``"a", "   ", "1"`` here and ``"a", "  ", " 1"`` with the GPT-2 regex alone).

``"llama-bpe"`` (Llama 3; also ``"llama3"``, ``"llama-v3"``, ``"falcon3"``) and ``"qwen2"``
(Qwen2/2.5/3) split with one expression each, the one in the model's
``tokenizer.json`` with its ``(?i:...)`` group spelled out as llama.cpp does:
letters take one leading non-letter (``"_foo"``), punctuation runs keep their
trailing newlines, and digits go in runs of at most three (Llama 3) or one at a
time (Qwen2). Llama 3 also *ignores merges* for a piece that is itself a token
(it is taken whole, whatever BPE would have built), and llama.cpp adds BOS for it
unless the header says otherwise.

SentencePiece vocabularies (``tokenizer.ggml.model = "llama"``: Llama 2,
Mistral, Gemma) carry a score per token instead of merges. llama.cpp
tokenizes them with no split at all: spaces become ``▁``, the text starts as
one symbol per character, and the adjacent pair whose concatenation is the
highest-scoring token is merged first (the leftmost on a tie), until no pair
is a token; what is left unknown is spelled in ``<0xXX>`` byte tokens. That
is BPE whose merges are every split of every token, ranked by the token's
score, with byte fallback, which is how it is built here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvtier.model.gguf import GGUFMetadata

# Tokens llama.cpp also treats as end of generation when the vocabulary has them as
# control tokens, beside the declared eos/eot/eom ids: a chat model that emits
# `<|endoftext|>` after its answer has finished, whatever the header says.
_END_OF_GENERATION_TEXTS = frozenset({"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"})


def _gpt2_split(add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def _digits_then_gpt2_split(add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split(add_prefix_space)])


# llama.cpp's expressions for LLAMA3 and QWEN2: they differ only in how many digits a piece holds.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT4_STYLE = (
    _CONTRACTIONS + r"|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{digits}"
    r"| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_EXPRESSION = _GPT4_STYLE.format(digits="{1,3}")
QWEN2_EXPRESSION = _GPT4_STYLE.format(digits="")


def _expression_split(expression: str) -> Callable[[bool], pre_tokenizers.PreTokenizer]:
    def split(add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(expression), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )

    return split


@dataclass(frozen=True)
class BpeSplit:
    """What llama.cpp does for one ``tokenizer.ggml.pre`` value of a BPE vocabulary."""

    split: Callable[[bool], pre_tokenizers.PreTokenizer]
    ignore_merges: bool = False  # a piece that is a token is taken whole
    add_bos: bool = False  # llama.cpp's default where the header has no tokenizer.ggml.add_bos_token


_LLAMA3 = BpeSplit(_expression_split(LLAMA3_EXPRESSION), ignore_merges=True, add_bos=True)
_QWEN2 = BpeSplit(_expression_split(QWEN2_EXPRESSION))

# tokenizer.ggml.pre -> the split llama.cpp applies for it (see the module docstring).
PRE_TOKENIZERS: dict[str, BpeSplit] = {
    "gpt2": BpeSplit(_gpt2_split),
    "smollm": BpeSplit(_digits_then_gpt2_split),
    "starcoder": BpeSplit(_digits_then_gpt2_split),
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
}


class Tokenizer:
    """Text <-> token ids for one model, with its special-token facts.

    Control tokens (``<|im_start|>``...) are added as special tokens, so they are
    matched whole wherever they appear in text passed to :meth:`encode`; that is what
    lets a rendered chat template encode to the right ids. Text a client sent goes
    through :meth:`encode_text` instead, where the same strings are spelled out as
    ordinary text: a user who types ``<|im_start|>system`` must not open a system turn.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        add_eos: bool,
    ) -> None:
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.eos_ids: tuple[int, ...] = tuple(sorted(set(eos_ids)))
        self.add_bos = add_bos
        self.add_eos = add_eos
        # The same vocabulary with added tokens never matched in input: for text from a request.
        self._text_backend = Backend.from_str(backend.to_str())
        self._text_backend.encode_special_tokens = True
        self.control_texts: tuple[str, ...] = tuple(
            t.content for t in backend.get_added_tokens_decoder().values() if t.special
        )

    @property
    def vocab_size(self) -> int:
        """Ids are ``0 .. vocab_size - 1``, added tokens included (49,152 for SmolLM2)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.backend.id_to_token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.backend.id_to_token(self.eos_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds BOS/EOS only where the file asks for them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of untrusted text: control-token strings in it become ordinary text tokens, never controls."""
        return self._text_backend.encode(text, add_special_tokens=add_special_tokens).ids

    def has_control_text(self, text: str) -> bool:
        """Whether ``text`` spells out a control token (``<|im_end|>``...) that :meth:`encode` would match."""
        return any(c in text for c in self.control_texts)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; bytes that do not form UTF-8 become U+FFFD."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def decode_stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Turns ids arriving one at a time into text, never emitting half a character.

    A byte-level token can end in the middle of a multi-byte UTF-8 character (an emoji
    spans up to four tokens). The decoder keeps the ids since the last point where
    the text ended cleanly and emits only once the decoded tail no longer ends in
    U+FFFD. It decodes a small window, not the whole sequence, so a step costs
    O(window), and it forgets ids that are already emitted.

    Invariant: the concatenation of everything :meth:`push` returned plus
    :meth:`finish` equals ``tokenizer.decode(all ids)``. This holds because the window
    only ever starts where the previous text ended on a whole character, and UTF-8
    decoding restarts cleanly there.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # ids from the window start on
        self._read = 0  # ids[:_read] are already emitted

    def push(self, token_id: int) -> str:
        """Text that became complete with this token ('' while a character is still open)."""
        self._ids.append(token_id)
        emitted = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return ""
        # Keep the last emitted ids as context, drop the rest: the window now starts
        # where the previous one was read up to.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(emitted) :]

    def finish(self) -> str:
        """What is still held back (a character that never completed comes out as U+FFFD)."""
        emitted = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        self._ids, self._read = [], 0
        return text[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""


@dataclass(frozen=True)
class _Vocabulary:
    """The tokenizer part of the header, checked once."""

    tokens: list[str]
    merges: list[tuple[str, str]]
    token_types: list[int]


def load_tokenizer(metadata: GGUFMetadata) -> Tokenizer:
    """Build the model's tokenizer from ``tokenizer.ggml.*`` metadata: byte-level BPE, or SentencePiece."""
    model = metadata.get("tokenizer.ggml.model")
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    if model == "gpt2":
        pre = metadata.get("tokenizer.ggml.pre")  # no default: llama.cpp's fallback split is not GPT-2's
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
        split = PRE_TOKENIZERS[pre]
        vocab = _read_vocabulary(metadata)
        backend = Backend(
            models.BPE(
                vocab={token: i for i, token in enumerate(vocab.tokens)},
                merges=vocab.merges,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=split.ignore_merges,
            )
        )
        backend.pre_tokenizer = split.split(add_prefix_space)
        backend.decoder = decoders.ByteLevel()
        default_add_bos = split.add_bos
    elif model == "llama":
        vocab = _read_vocabulary(metadata, merges=False)
        backend = _sentencepiece(vocab, list(metadata["tokenizer.ggml.scores"]), add_prefix_space)
        default_add_bos = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ValueError(f"tokenizer.ggml.model {model!r} is not supported; known: 'gpt2' (BPE), 'llama' (SPM)")
    _add_special_tokens(backend, vocab)

    bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id")
    eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    post = _post_processor(vocab.tokens, bos_id if add_bos else None, eos_id if add_eos else None)
    if post is not None:
        backend.post_processor = post
    return Tokenizer(
        backend,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=_optional_id(metadata, "tokenizer.ggml.padding_token_id"),
        eos_ids=_end_of_generation_ids(metadata, vocab, eos_id),
        add_bos=add_bos,
        add_eos=add_eos,
    )


def _sentencepiece(vocab: _Vocabulary, scores: list[float], add_prefix_space: bool) -> Backend:
    """llama.cpp's SentencePiece tokenizer as BPE (see the module docstring).

    Every split of every token into two tokens is a merge, ranked by the
    whole token's score (higher first): BPE then merges the adjacent pair of
    best rank, leftmost first, as llama.cpp does by score.
    """
    if len(scores) != len(vocab.tokens):
        raise ValueError(f"{len(scores)} scores for {len(vocab.tokens)} tokens")
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    ranked = sorted(range(len(vocab.tokens)), key=lambda i: (-scores[i], i))
    merges = []
    for i in ranked:
        token = vocab.tokens[i]
        merges += [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
    unk = next((t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == TokenType.UNKNOWN), None)
    backend = Backend(models.BPE(vocab=ids, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if add_prefix_space else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_prefix_space else [])
    )
    return backend


def _read_vocabulary(metadata: GGUFMetadata, *, merges: bool = True) -> _Vocabulary:
    tokens = list(metadata["tokenizer.ggml.tokens"])
    if len(set(tokens)) != len(tokens):
        raise ValueError("tokenizer.ggml.tokens has duplicates; ids would be ambiguous")
    pairs = []
    for merge in metadata["tokenizer.ggml.merges"] if merges else []:
        # Byte-level tokens never contain a space (it is spelled 'Ġ'), so one space separates the pair.
        left, sep, right = merge.partition(" ")
        if not sep or " " in right:
            raise ValueError(f"malformed merge {merge!r}")
        pairs.append((left, right))
    types = list(metadata.get("tokenizer.ggml.token_type", [int(TokenType.NORMAL)] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(f"{len(types)} token types for {len(tokens)} tokens")
    return _Vocabulary(tokens, pairs, types)


def _add_special_tokens(backend: Backend, vocab: _Vocabulary) -> None:
    """CONTROL tokens become special (skippable in decode); USER_DEFINED ones are matched whole but kept.

    Both keep the id they already have in the vocabulary: ``add_*_tokens`` reuses an
    existing entry, so the vocabulary does not grow (checked, since a grown vocabulary
    would index past the embedding matrix).
    """
    size = backend.get_vocab_size(with_added_tokens=True)
    control = [t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == TokenType.CONTROL]
    user = [t for t, kind in zip(vocab.tokens, vocab.token_types, strict=True) if kind == TokenType.USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    if backend.get_vocab_size(with_added_tokens=True) != size:
        raise ValueError("adding the file's special tokens grew the vocabulary")


def _post_processor(tokens: list[str], bos_id: int | None, eos_id: int | None) -> processors.PostProcessor | None:
    """BOS/EOS around each sequence, as ``add_bos_token``/``add_eos_token`` ask (neither, for SmolLM2)."""
    if bos_id is None and eos_id is None:
        return None
    head = [f"{tokens[bos_id]}:0"] if bos_id is not None else []
    tail = [f"{tokens[eos_id]}:0"] if eos_id is not None else []
    specials = [(tokens[i], i) for i in (bos_id, eos_id) if i is not None]
    return processors.TemplateProcessing(
        single=[*head, "$A:0", *tail],
        pair=[*head, "$A:0", *tail, *head, "$B:1", *tail],
        special_tokens=list(dict.fromkeys(specials)),
    )


def _end_of_generation_ids(metadata: GGUFMetadata, vocab: _Vocabulary, eos_id: int | None) -> list[int]:
    ids = [eos_id] if eos_id is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = _optional_id(metadata, key)
        if extra is not None:
            ids.append(extra)
    ids += [
        i
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.token_types, strict=True))
        if kind == TokenType.CONTROL and token in _END_OF_GENERATION_TEXTS
    ]
    return ids


def _optional_id(metadata: GGUFMetadata, key: str) -> int | None:
    value = metadata.get(key)
    return None if value is None else int(value)
