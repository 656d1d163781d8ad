"""A request as the router sees it: how many tokens, their block keys, and whose session it is.

The router must compute exactly the keys its backends publish, so it
derives them the way ``kvtier serve`` does, from the same config: the
tokenizer and chat template read from the same GGUF file (no weights
loaded), the same model fingerprint and KV layout, the same key secret
(``cache.secret_file``, else ``<data_dir>/secret``: the backends' own), and
the tenant's namespace from the caller's API key. Each backend's event
stream opens with its root key, which :meth:`Prompts.agrees` compares with
the router's own: a backend that disagrees is routed to by load alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import jinja2
from pydantic import ValidationError

from kvtier.config import Config
from kvtier.hardware import compute_dtype
from kvtier.identity import kv_identity_for
from kvtier.keys import BlockKey, KeyHasher, Secret
from kvtier.layout import dtype_from_name
from kvtier.model import default_gguf_path, load_chat_template, load_tokenizer, read_gguf_metadata
from kvtier.model.chat import chat_ids
from kvtier.web.auth import Tenants
from kvtier.web.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    as_template_messages,
)

SESSION_HEADER = "x-session-id"


class Endpoint(enum.StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


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
        layout, fingerprint = kv_identity_for(path, dtype, config.cache.block_size, config.data_dir)
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

    def read(self, endpoint: Endpoint, body: Any, authorization: str | None, session: str | None) -> RoutedPrompt:
        """What routing needs of a request body; a body the backend will refuse gets no keys (it is routed by load)."""
        named = [body.get(k) for k in ("prompt_cache_key", "user")] if isinstance(body, dict) else []
        session = session or next((n for n in named if isinstance(n, str) and n), None)  # as the server reads it
        stream = isinstance(body, dict) and body.get("stream") is True
        ids = self._ids(endpoint, body)
        tenant = self.tenants.from_key(_bearer(authorization))
        if ids is None or tenant is None:
            return RoutedPrompt(0 if ids is None else len(ids), [], session, stream)
        return RoutedPrompt(len(ids), self.hasher.keys(ids, tenant.namespace), session, stream)

    def _ids(self, endpoint: Endpoint, body: Any) -> list[int] | None:
        try:
            if endpoint is Endpoint.CHAT:
                chat = ChatCompletionRequest.model_validate(body)
                return chat_ids(self.tokenizer, self.chat, as_template_messages(chat.messages))
            prompt = CompletionRequest.model_validate(body).prompt
        except (ValidationError, jinja2.TemplateError):  # the backend answers these with a 4xx of its own
            return None
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode_text(prompt)


def _bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None
