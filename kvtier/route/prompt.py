"""A request as the router sees it: how many tokens, their block keys, and whose session it is.

The router must compute exactly the keys its backends publish, so it
derives them the way ``kvtier serve`` does, from the same config: the
tokenizer and chat template read from the same GGUF file (no weights
loaded), the same model fingerprint and KV layout, the same key secret
(``cache.secret_file``, else ``<data_dir>/secret``: the backends' own), and
the tenant's namespace from the caller's API key (read from the headers
the backend reads it from: :func:`caller_key`). Each backend's event
stream opens with its root key, which :meth:`Prompts.agrees` compares with
the router's own: a backend that disagrees is routed to by load alone.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from pydantic import ValidationError

from kvtier.config import Config
from kvtier.hardware import compute_dtype, kv_dtype
from kvtier.identity import kv_identity_for
from kvtier.keys import BlockKey, KeyHasher, Secret
from kvtier.layout import dtype_from_name
from kvtier.model import default_gguf_path, load_chat_template, load_tokenizer, read_gguf_metadata
from kvtier.model.chat import chat_ids
from kvtier.web.auth import Tenants
from kvtier.web.messages import MAX_BREAKPOINTS, MessagesRequest, rendered
from kvtier.web.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    as_template_messages,
)

SESSION_HEADER = "x-session-id"
X_API_KEY = "x-api-key"  # the Messages API's key header


class Endpoint(enum.StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    MESSAGES = "/v1/messages"  # Anthropic's Messages API


SESSION_FIELDS: dict[Endpoint, tuple[tuple[str, ...], ...]] = {
    Endpoint.CHAT: (("prompt_cache_key",), ("user",)),
    Endpoint.COMPLETIONS: (("prompt_cache_key",), ("user",)),
    Endpoint.MESSAGES: (("metadata", "user_id"),),
}
"""Where a body names its session, first found wins: as the server reads it (the header wins over all)."""


@dataclass(frozen=True)
class RoutedPrompt:
    tokens: int
    keys: list[BlockKey]
    session: str | None
    stream: bool


class Prompts:
    def __init__(self, config: Config) -> None:
        path = config.engine.model_path or default_gguf_path()
        meta = read_gguf_metadata(path)
        self.tokenizer = load_tokenizer(meta)
        self.chat = load_chat_template(meta)
        dtype = dtype_from_name(compute_dtype(config).value)
        layout, fingerprint = kv_identity_for(
            path, dtype, config.cache.block_size, config.data_dir, kv_dtype=dtype_from_name(kv_dtype(config))
        )
        self.hasher = KeyHasher(
            Secret.load_or_create(config.data_dir, config.cache.secret_file),
            model_fingerprint=fingerprint,
            layout_descriptor=layout.descriptor,
            block_size=layout.block_size,
        )
        self.block_size = layout.block_size
        self.tenants = Tenants(config.server.api_keys, config.cache.namespace)
        self.namespace = config.cache.namespace  # the keyless default tenant's, and so vLLM backends'
        self.root = bytes(self.hasher.root(config.cache.namespace)).hex()

    def agrees(self, root: str, block_size: int) -> bool:
        """Whether a backend whose event stream opened with ``root`` keys blocks as the router does."""
        return root == self.root and block_size == self.block_size

    def read(self, endpoint: Endpoint, body: Any, key: str | None, session: str | None) -> RoutedPrompt:
        """What routing needs of a request body; a body the backend will refuse gets no keys (it is routed by load).

        ``key`` is the caller's API key (:func:`caller_key`): it names the
        tenant, whose namespace the keys are salted with.
        """
        session = session or _named_session(endpoint, body)
        stream = isinstance(body, dict) and body.get("stream") is True
        ids = self._ids(endpoint, body)
        tenant = self.tenants.from_key(key)
        if ids is None or tenant is None:
            return RoutedPrompt(0 if ids is None else len(ids), [], session, stream)
        return RoutedPrompt(len(ids), self.hasher.keys(ids, tenant.namespace), session, stream)

    def _ids(self, endpoint: Endpoint, body: Any) -> list[int] | None:
        try:
            if endpoint is not Endpoint.COMPLETIONS:
                conversation = _conversation(endpoint, body)
                return None if conversation is None else chat_ids(self.tokenizer, self.chat, conversation)
            prompt = CompletionRequest.model_validate(body).prompt
        except (ValidationError, jinja2.TemplateError):  # the backend answers these with a 4xx of its own
            return None
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode_text(prompt)


def _conversation(endpoint: Endpoint, body: Any) -> list[dict[str, str]] | None:
    """What the chat template renders for a chat or Messages body: the very functions the server renders with.

    A Messages body is rendered by :func:`kvtier.web.messages.rendered`
    (tools, then system, then messages), so router and server cannot
    drift; one with more marks than the server takes is refused there, so
    it has no conversation here either.
    """
    if endpoint is Endpoint.CHAT:
        return as_template_messages(ChatCompletionRequest.model_validate(body).messages)
    conversation, marks = rendered(MessagesRequest.model_validate(body))
    return conversation if len(marks) <= MAX_BREAKPOINTS else None


def _named_session(endpoint: Endpoint, body: Any) -> str | None:
    """The session ``body`` names in its endpoint's :data:`SESSION_FIELDS`; read before validation, as the
    server would read it from a body it accepts (a body it refuses has no session to stick to anyway)."""
    for path in SESSION_FIELDS[endpoint]:
        value = body
        for field in path:
            value = value.get(field) if isinstance(value, dict) else None
        if isinstance(value, str) and value:
            return value
    return None


def caller_key(endpoint: Endpoint, headers: Mapping[str, str]) -> str | None:
    """The API key the backend will name the caller's tenant by: a bearer token; on the Messages API an
    ``x-api-key`` header first (its clients send that), as ``kvtier serve`` reads them.

    An empty ``x-api-key`` counts as none, as the server's header reader has it.
    """
    if endpoint is Endpoint.MESSAGES and headers.get(X_API_KEY):
        return headers[X_API_KEY]
    return _bearer(headers.get("authorization"))


def _bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None
