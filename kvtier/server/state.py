"""Everything the routes share, built once by :func:`kvtier.server.main.build_state` and held by the app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.cache import Cache
from kvtier.config import Config
from kvtier.engine.runtime import LoadedModel
from kvtier.publisher import EventPublisher
from kvtier.server.kv_events import EventFeed
from kvtier.server.loop import EngineLoop
from kvtier.server.retention import Retention
from kvtier.server.warming import Warmer
from kvtier.sessions import SessionRegistry
from kvtier.web.auth import AdminToken, Readers, Tenants

if TYPE_CHECKING:
    from kvtier.server.inference import Job
    from kvtier.server.loop import Outcome


@dataclass(frozen=True)
class ServerState:
    config: Config
    model_name: str
    loaded: LoadedModel  # the tokenizer and chat template; the weights are the engine thread's
    cache: Cache
    loop: EngineLoop
    tenants: Tenants
    admin: AdminToken
    readers: Readers  # of /stats, /metrics, /dashboard and the schema
    created: int  # unix time the server started, reported as the model's ``created``
    retention: Retention  # what cache_control marks keep, per tenant
    events: EventFeed | None = None  # block events for a router; None when the tiers live in a cache service
    publisher: EventPublisher | None = None  # the same in vLLM's format over ZMQ, where kv_events asks for them
    sessions: SessionRegistry | None = None  # live agent sessions; None when session.enabled is false
    warmer: Warmer | None = None  # sessions' next turns prefilled in idle time; None: session.warm_next_turn off

    def note_outcome(self, job: Job, outcome: Outcome) -> None:
        """A finished turn's prompt and cached tokens count toward its session's hit rate; its next turn is warmed."""
        if job.session is None or self.sessions is None:
            return
        namespace = job.tenant.namespace
        self.sessions.served(namespace, job.session, outcome.prompt_tokens, outcome.cached_tokens)
        if self.warmer is not None and job.conversation is not None:
            self.warmer.after((namespace, job.session), job.conversation, outcome.text)
