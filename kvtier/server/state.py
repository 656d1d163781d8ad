"""Everything the routes share, built once by :func:`kvtier.server.main.build_state` and held by the app."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.config import Config
from kvtier.engine.runtime import LoadedModel
from kvtier.manager import CacheManager
from kvtier.server.auth import AdminToken, Tenants
from kvtier.server.kv_events import EventFeed
from kvtier.server.loop import EngineLoop
from kvtier.service.cache import ServiceCache


@dataclass(frozen=True)
class ServerState:
    config: Config
    model_name: str
    loaded: LoadedModel  # the tokenizer and chat template; the weights are the engine thread's
    cache: CacheManager | ServiceCache
    loop: EngineLoop
    tenants: Tenants
    admin: AdminToken
    created: int  # unix time the server started, reported as the model's ``created``
    events: EventFeed | None = None  # block events for a router; None when the tiers live in a cache service
