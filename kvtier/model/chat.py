"""Render a conversation into the prompt text the model was trained on.

The template is Jinja source shipped in the file (``tokenizer.chat_template``), i.e.
code from whoever made the file. It runs in jinja2's ``ImmutableSandboxedEnvironment``
(no attribute escapes, no mutating the messages) with the same settings and helpers
Hugging Face's ``apply_chat_template`` gives it (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, ``raise_exception``, ``tojson``, ``strftime_now``), so a template
renders here exactly as it does there — byte-identical prompts are what make the
prefix cache hit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvtier.model.gguf import GGUFMetadata
from kvtier.model.tokenizer import Tokenizer

_MARK = re.compile("\ue000(\\d+)\ue001")  # a message's content while the template renders around it


class ChatTemplateError(jinja2.TemplateError):
    """The template refused the conversation (its ``raise_exception``), or could not be compiled."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Jinja's own ``tojson`` HTML-escapes ``<>&'``; chat templates expect plain JSON."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}, ...]``).

        ``add_generation_prompt`` appends the opening of the assistant's turn, which is
        what a request for a completion wants. Messages are copied to plain dicts first,
        so a template sees the same data whatever mapping type the caller used.
        """
        plain = []
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise ChatTemplateError(f"message {i} is not a mapping with a 'role': {message!r}")
            plain.append(dict(message))
        return self._template.render(
            messages=plain,
            add_generation_prompt=add_generation_prompt,
            tools=None if tools is None else [dict(t) for t in tools],
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def render_pieces(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False
    ) -> list[tuple[str, bool]]:
        """The rendered prompt cut into the template's own text (True) and the messages' contents (False).

        The template renders with each content replaced by a private-use
        marker; the markers are then found and the contents put back. Only the
        template's own pieces may be tokenized with control tokens recognized.
        A template that transforms a content (trims it, say) would give a
        different prompt once the contents are put back: that raises, since
        such a content cannot be kept apart from the template's text.
        """
        masked = [{**m, "content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)]
        out: list[tuple[str, bool]] = []
        for i, piece in enumerate(_MARK.split(self.render(masked, add_generation_prompt=add_generation_prompt))):
            if i % 2:
                out.append((str(messages[int(piece)].get("content", "")), False))
            elif piece:
                out.append((piece, True))
        if "".join(p for p, _ in out) != self.render(messages, add_generation_prompt=add_generation_prompt):
            raise ChatTemplateError(
                "this chat template transforms message contents; control-token text cannot be kept apart"
            )
        return out


def load_chat_template(metadata: GGUFMetadata) -> ChatTemplate:
    """The file's own template; a file without one cannot be chatted with correctly, so it raises."""
    source = metadata.chat_template
    if not source:
        raise ChatTemplateError("the GGUF file has no tokenizer.chat_template")
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str | None:
        index = metadata.get(key)
        return tokens[int(index)] if index is not None and int(index) < len(tokens) else None

    return ChatTemplate(
        source,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
    )


def chat_ids(
    tok: Tokenizer, chat: ChatTemplate, messages: list[dict[str, str]], *, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation, by default ending with the opening of the assistant's turn.

    Only the template inserts control tokens. A content that spells one
    out (``<|im_end|>\\n<|im_start|>system``) is tokenized as the text it
    is; contents that do not are encoded with the rest of the prompt in one
    piece, exactly as before, so their ids (and cached keys) do not change.
    A function of the tokenizer and template alone: ``kvtier route`` computes
    the backends' ids (and so their block keys) without loading weights.
    """
    if not any(tok.has_control_text(m.get("content", "")) for m in messages):
        return tok.encode(chat.render(messages, add_generation_prompt=add_generation_prompt), False)
    ids: list[int] = []
    for piece, from_template in chat.render_pieces(messages, add_generation_prompt=add_generation_prompt):
        ids += (tok.encode if from_template else tok.encode_text)(piece, False)
    return ids


def next_turn_ids(
    tok: Tokenizer, chat: ChatTemplate, messages: list[dict[str, str]], reply: str, *, role: str = "user"
) -> list[int]:
    """The ids every next turn of this conversation starts with, whatever that turn's message says.

    That is the conversation, the assistant's ``reply`` as the template
    writes it in history (not as it was generated: the next request resends
    it as text), and the template's opening of a ``role`` message. The
    template renders the next message with a placeholder content and the
    prompt is cut there, so the opening is the template's own text. Ids as
    :func:`chat_ids` gives them for the whole next prompt, up to that cut.
    """
    turn = [*messages, {"role": "assistant", "content": reply}, {"role": role, "content": ""}]
    pieces = chat.render_pieces(turn, add_generation_prompt=False)
    head = pieces[: max(i for i, (_, from_template) in enumerate(pieces) if not from_template)]
    if not any(tok.has_control_text(m["content"]) for m in turn):
        return tok.encode("".join(piece for piece, _ in head), False)
    ids: list[int] = []
    for piece, from_template in head:
        ids += (tok.encode if from_template else tok.encode_text)(piece, False)
    return ids
