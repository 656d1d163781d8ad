"""Tokenizer and chat template rebuilt from the embedded GGUF, against transformers and llama.cpp's split."""

from __future__ import annotations

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.model import (
    ChatTemplate,
    ChatTemplateError,
    GGUFMetadata,
    Tokenizer,
    default_gguf_path,
    load_chat_template,
    load_tokenizer,
    read_gguf_metadata,
)

TRICKY = [
    "x = 12345",
    "你好，世界",  # noqa: RUF001 -- the fullwidth comma is the point
    "🤖👍🏽",
    "<|im_start|>user\nhi<|im_end|>",
    "a\n\n\n   \t  b",
    "def f(x):\n    return {'k': x ** 2}  # square\n\tpass",
    "Hello world! It's fine, don't worry.",
    "ÅNGSTRÖM naïve café",
    "",
]

# Pinned so they hold without transformers. "a   1" is where the "smollm" split matters: digits are
# isolated *before* the GPT-2 regex, so the three spaces stay one piece (333 = "ĠĠĠ"). transformers 5's GGUF
# loader has no entry for "smollm" and falls back to the GPT-2 regex alone, giving [81, 256, 216, 33]
# ("a", "ĠĠ", "Ġ", "1"); llama.cpp and the model's own tokenizer.json agree with us.
PINNED = {
    "x = 12345": [104, 446, 216, 33, 34, 35, 36, 37],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "🤖👍🏽": [10813, 114, 240, 10813, 235, 231, 10813, 233, 138],
    "a   1": [81, 333, 33],
}

# Bytes with no token in this vocabulary (the tokenizer was trained on a restricted byte alphabet):
# never-valid UTF-8 bytes, the lead bytes F1/F2 (U+40000..U+BFFFF), and six ASCII control characters.
# Without an unk token, BPE drops them, exactly as the Hugging Face tokenizer does.
UNENCODABLE_BYTES = frozenset({0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)})
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"]


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


def encodable(char: str) -> bool:
    return not UNENCODABLE_BYTES.intersection(char.encode("utf-8"))


TEXT = st.lists(
    st.one_of(st.text(st.characters(codec="utf-8").filter(encodable), max_size=12), st.sampled_from(SPECIALS)),
    max_size=6,
).map("".join)


@pytest.fixture(scope="module")
def metadata() -> GGUFMetadata:
    return read_gguf_metadata(default_gguf_path())


@pytest.fixture(scope="module")
def tok(metadata: GGUFMetadata) -> Tokenizer:
    return load_tokenizer(metadata)


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --- ids --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY)
def test_ids_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=True)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(("text", "ids"), PINNED.items())
def test_pinned_ids(tok: Tokenizer, text: str, ids: list[int]) -> None:
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_special_token_facts(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.eos_ids == (0, 2)  # <|endoftext|> and <|im_end|> both end a generation
    assert not tok.add_bos and not tok.add_eos  # the file says add_bos_token = false
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.id_to_token(216) == "Ġ"
    assert tok.token_to_id("no such token") is None


def test_decode_can_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_vocabulary_lacks_exactly_the_unencodable_bytes(tok: Tokenizer) -> None:
    missing = {b for b, char in gpt2_byte_alphabet().items() if tok.token_to_id(char) is None}
    assert missing == UNENCODABLE_BYTES
    assert tok.decode(tok.encode("a\x04b")) == "ab"  # dropped, though it still splits "a" from "b"


def test_unsupported_pre_tokenizer_is_refused(metadata: GGUFMetadata) -> None:
    for pre in ("deepseek-coder", "tekken", None):
        with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre"):
            load_tokenizer(GGUFMetadata({**metadata.values, "tokenizer.ggml.pre": pre}))


def with_pre(metadata: GGUFMetadata, pre: str, **header: object) -> Tokenizer:
    """SmolLM2's vocabulary under another ``tokenizer.ggml.pre`` (the add_bos key dropped unless given)."""
    values = {k: v for k, v in metadata.values.items() if k != "tokenizer.ggml.add_bos_token"}
    return load_tokenizer(GGUFMetadata({**values, "tokenizer.ggml.pre": pre, **header}))


def test_llama3_adds_bos_unless_the_header_says_not(metadata: GGUFMetadata) -> None:
    """llama.cpp's default for the llama-bpe group; qwen2 has none."""
    assert with_pre(metadata, "llama-bpe").encode("hi")[0] == 1
    assert with_pre(metadata, "llama-bpe", **{"tokenizer.ggml.add_bos_token": False}).encode("hi")[0] != 1
    assert not with_pre(metadata, "qwen2").add_bos


def test_llama3_takes_a_piece_that_is_a_token_whole() -> None:
    """``ignore_merges``: "abc" is a token though no merge builds it; qwen2's BPE stops at "ab" + "c"."""
    alphabet = list(gpt2_byte_alphabet().values())
    header = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [*alphabet, "ab", "abc"],
        "tokenizer.ggml.merges": ["a b"],
    }
    ab, abc = len(alphabet), len(alphabet) + 1
    for pre, ids in (("llama-bpe", [abc]), ("qwen2", [ab, alphabet.index("c")])):
        tokenizer = load_tokenizer(GGUFMetadata({**header, "tokenizer.ggml.pre": pre}))
        assert tokenizer.encode("abc") == ids
        assert tokenizer.encode("abcabc") == [ab, alphabet.index("c"), ab, alphabet.index("c")]  # one piece


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_decode_inverts_encode(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


# --- the split, against llama.cpp's own expressions ---------------------------------------------------------------

# llama.cpp's expressions per pre type (src/llama-vocab.cpp), written out here, not imported from kvtier.
LLAMACPP_SPLITS = {
    "smollm": (
        r"\p{N}",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    "llama-bpe": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}


def llamacpp_split(text: str, pre: str = "smollm") -> list[str]:
    """llama.cpp's ``unicode_regex_split`` for one pre type: each expression in turn, keeping the gaps."""
    regex = pytest.importorskip("regex")
    pieces = [text] if text else []
    for expression in LLAMACPP_SPLITS[pre]:
        pattern = regex.compile(expression)
        split: list[str] = []
        for piece in pieces:
            start = 0
            for match in pattern.finditer(piece):
                if match.start() > start:
                    split.append(piece[start : match.start()])
                split.append(match.group())
                start = match.end()
            if start < len(piece):
                split.append(piece[start:])
        pieces = split
    return pieces


DIGITS_AND_SPACE = st.text(st.sampled_from(list("ab1 2\t\n.'s9٣")), max_size=24)
# Code points unassigned in Python's Unicode database are left out: their category is whatever each
# library's Unicode version says (tokenizers, `regex` and llama.cpp ship different ones).
ASSIGNED = st.characters(codec="utf-8", exclude_categories=["Cn", "Co", "Cs"])


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(DIGITS_AND_SPACE, st.text(ASSIGNED, max_size=24)))
def test_split_is_llamacpps_smollm_split(tok: Tokenizer, text: str) -> None:
    ours = [text[a:b] for _, (a, b) in tok.backend.pre_tokenizer.pre_tokenize_str(text)]
    assert ours == llamacpp_split(text)


@pytest.fixture(scope="module")
def gpt4_style(metadata: GGUFMetadata) -> dict[str, Tokenizer]:
    return {pre: with_pre(metadata, pre) for pre in ("llama-bpe", "qwen2")}


GPT4_STYLE_TEXT = st.text(st.sampled_from(list("aB1 2\t\r\n.'sS9٣_!é中")), max_size=24)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
@settings(max_examples=200, deadline=None)
@given(text=st.one_of(GPT4_STYLE_TEXT, st.text(ASSIGNED, max_size=24)))
def test_split_is_llamacpps_gpt4_style_split(gpt4_style: dict[str, Tokenizer], pre: str, text: str) -> None:
    tokenizer = gpt4_style[pre]
    ours = [text[a:b] for _, (a, b) in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)]
    assert ours == llamacpp_split(text, pre)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text or not all(map(encodable, text))


# --- streaming --------------------------------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = tok.decode_stream(skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.finish()]


def test_stream_holds_back_partial_characters(tok: Tokenizer) -> None:
    assert stream(tok, tok.encode("🤖👍🏽 ok")) == ["", "", "🤖", "", "", "👍", "", "", "🏽", " ok", ""]


@settings(max_examples=100, deadline=None)
@given(text=TEXT)
def test_stream_of_encoded_text_is_the_text(tok: Tokenizer, text: str) -> None:
    chunks = stream(tok, tok.encode(text))
    assert "".join(chunks) == tok.decode(tok.encode(text)) == text
    assert not any("\ufffd" in chunk for chunk in chunks if "\ufffd" not in text)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=16), skip=st.booleans())
def test_stream_of_any_ids_ends_as_decode(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    """Even ids that never form valid UTF-8: the held-back tail comes out in finish()."""
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


# --- chat template ----------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]
CHATML = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chat_template_renders_chatml(metadata: GGUFMetadata) -> None:
    template = load_chat_template(metadata)
    assert template.render(CONVERSATION, add_generation_prompt=True) == CHATML
    assert template.render(CONVERSATION) == CHATML.removesuffix("<|im_start|>assistant\n")


def test_chat_template_matches_transformers(metadata: GGUFMetadata, hf_tok) -> None:
    template = load_chat_template(metadata)
    with_system = [{"role": "system", "content": "Be brief."}, *CONVERSATION]
    for messages in (CONVERSATION, with_system):
        for prompt in (True, False):
            expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert template.render(messages, add_generation_prompt=prompt) == expected


def test_rendered_chat_encodes_specials_whole(metadata: GGUFMetadata, tok: Tokenizer) -> None:
    ids = tok.encode(load_chat_template(metadata).render(CONVERSATION, add_generation_prompt=True))
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert ids.count(tok.token_to_id("<|im_end|>")) == 3
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n") == [1, 520, 9531, 198]


def test_raise_exception_reaches_the_caller() -> None:
    template = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="user first"):
        template.render([{"role": "assistant", "content": "hi"}])


def test_template_is_sandboxed_and_immutable() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])


def test_tojson_is_plain_json() -> None:
    assert ChatTemplate("{{ messages[0] | tojson }}").render([{"role": "user", "content": "<b>&"}]) == (
        '{"role": "user", "content": "<b>&"}'
    )


def test_broken_template_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def sentencepiece(scores: dict[str, float], add_space_prefix: bool = False) -> Tokenizer:
    """A tiny SentencePiece vocabulary: unknown, BOS, EOS, the 256 byte tokens, then ``scores``' pieces."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *scores]
    types = [2, 3, 3, *([6] * 256), *([1] * len(scores))]  # UNKNOWN, CONTROL, BYTE, NORMAL
    values = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, *([0.0] * 256), *scores.values()],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }
    return load_tokenizer(GGUFMetadata(values))


def test_sentencepiece_merges_the_best_scoring_pair_first_and_spells_the_unknown_in_bytes() -> None:
    base = {"▁": -1.0, "a": -2.0, "b": -3.0, "c": -4.0}
    first = 259  # the first piece after the byte tokens
    ids = {piece: first + i for i, piece in enumerate([*base, "ab", "bc"])}
    prefers_bc = sentencepiece(base | {"ab": -6.0, "bc": -5.0})
    assert prefers_bc.encode("abc") == [1, ids["a"], ids["bc"]]  # llama.cpp: highest score first
    prefers_ab = sentencepiece(base | {"ab": -5.0, "bc": -6.0})
    assert prefers_ab.encode("abc") == [1, ids["ab"], ids["c"]]
    assert prefers_ab.encode("a é") == [1, ids["a"], ids["▁"], 3 + 0xC3, 3 + 0xA9]  # no piece: its UTF-8 bytes
    assert prefers_ab.decode(prefers_ab.encode("a é"), skip_special_tokens=True) == "a é"
    prefixed = sentencepiece(base | {"ab": -5.0, "bc": -6.0}, add_space_prefix=True)
    assert prefixed.encode("ab") == [1, ids["▁"], ids["ab"]]
    assert prefixed.decode(prefixed.encode("ab"), skip_special_tokens=True) == "ab"


def test_an_unknown_tokenizer_model_is_refused_by_name(metadata: GGUFMetadata) -> None:
    with pytest.raises(ValueError, match="'rwkv' is not supported"):
        load_tokenizer(GGUFMetadata({**metadata.values, "tokenizer.ggml.model": "rwkv"}))
