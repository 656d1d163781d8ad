"""``kvtier serve``: check the bind address, load the model, open the cache, run uvicorn, close it all.

Safe by default: the server binds 127.0.0.1, and refuses any non-loopback
address unless an admin token is set (an operator who exposes the server
has thought about who may clear or probe its cache). Without API keys,
inference on a non-loopback address is open to the network: that is logged
as a warning, not refused, since a trusted network or a proxy may be doing
the authentication.

The listening sockets are bound before the model loads: a port in use or an
address this host does not have is a one-line error at once, and uvicorn
then serves those very sockets, so nothing can take the port in between.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import resource
import socket
import time

import uvicorn
from starlette.types import ASGIApp

from kvtier.cache import Cache
from kvtier.config import Config, ConfigError
from kvtier.engine.engine import Engine
from kvtier.engine.runtime import LoadedModel, load_model, make_engine, open_cache
from kvtier.publisher import EventPublisher
from kvtier.server.app import create_app
from kvtier.server.kv_events import EventFeed
from kvtier.server.limits import read_timeout_protocol
from kvtier.server.loop import EngineLoop
from kvtier.server.metrics import EngineMetrics
from kvtier.server.retention import Retention, retain_quota
from kvtier.server.state import ServerState
from kvtier.server.warming import Warmer
from kvtier.sessions import SessionRegistry
from kvtier.web.auth import AdminToken, Readers, Tenants
from kvtier.web.listen import listen_sockets

log = logging.getLogger(__name__)

# Descriptors the process needs beside its connections: the model file, the disk tier's
# slabs and index, the cache service's socket, the runtime's own.
FD_HEADROOM = 512


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def check_bind(config: Config) -> None:
    server = config.server
    if is_loopback(server.host):
        return
    if server.admin_token is None:
        raise ConfigError(
            f"refusing to serve on the non-loopback address {server.host}: set server.admin_token "
            "(or KVTIER_SERVER__ADMIN_TOKEN) first, or bind 127.0.0.1"
        )
    if not server.api_keys:
        log.warning("serving on %s without server.api_keys: inference is open to that network", server.host)


def fit_open_files(max_connections: int) -> int:
    """Raise the soft open-files limit to what ``max_connections`` needs, as far as the hard limit allows.

    Each connection holds a descriptor. At the soft limit accept() fails and
    asyncio stops accepting for a while: clients then hang in connect, not
    the quick 503 the cap promises. Returns the soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_HEADROOM
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    if new < want:
        log.warning("server.max_connections %d needs %d open files; the hard limit is %d", max_connections, want, new)
    return new


def uvicorn_config(config: Config, app: ASGIApp) -> uvicorn.Config:
    """uvicorn with the server section's limits.

    uvicorn counts the connection a request arrives on among the open ones
    and refuses at ``limit_concurrency``: one more than ``max_connections``
    serves exactly that many.
    """
    return uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level="info",
        server_header=False,
        timeout_graceful_shutdown=10,
        http=read_timeout_protocol(config.server.read_timeout_s),
        limit_concurrency=config.server.max_connections + 1,
    )


def _event_feed(cache: Cache, config: Config) -> EventFeed | None:
    """Block events of the tiers in this process; a cache service's tiers are shared, not this instance's."""
    feed = EventFeed(config.cache.block_size, cache.hasher.root(config.cache.namespace))
    return feed if cache.follow(feed) else None


def _publisher(feed: EventFeed | None, cache: Cache, config: Config) -> EventPublisher | None:
    """This process's block events in vLLM's format over ZMQ, where ``kv_events.endpoint`` asks for them."""
    events = config.kv_events
    if events.endpoint is None:
        return None
    if feed is None:
        log.warning("kv_events: the tiers live in the node's cache service, which publishes them, not this server")
        return None
    publisher = EventPublisher(
        events.endpoint,
        replay_endpoint=events.replay_endpoint,
        block_size=config.cache.block_size,
        root=cache.hasher.root(config.cache.namespace),
        snapshot=feed.snapshot,
        topic=events.topic,
        buffer_batches=events.buffer_batches,
    )
    feed.listen(publisher)
    log.info("kv events (vLLM's format) on %s, replay on %s", publisher.endpoint, publisher.replay_endpoint)
    return publisher


def _engine(loaded: LoadedModel, config: Config, cache: Cache, feed: EventFeed | None) -> Engine:
    engine = make_engine(loaded, config, cache=cache)
    if engine.resident is not None:
        engine.resident.events = feed
    return engine


def _sessions(cache: Cache, config: Config) -> SessionRegistry | None:
    """Live sessions; this process's host eviction protects their blocks (a cache service's protects them there)."""
    if not config.session.enabled:
        return None
    registry = SessionRegistry(config.session, config.cache.block_size)
    cache.protect(registry.protection)
    return registry


def build_state(config: Config) -> ServerState:
    loaded = load_model(config)
    cache = open_cache(loaded, config)
    feed = _event_feed(cache, config)
    loop = EngineLoop(lambda: _engine(loaded, config, cache, feed), EngineMetrics())
    sessions = _sessions(cache, config)
    warm = sessions is not None and config.session.warm_next_turn and loaded.chat is not None
    return ServerState(
        config=config,
        model_name=config.server.model_name or loaded.path.stem,
        loaded=loaded,
        cache=cache,
        loop=loop,
        tenants=Tenants(config.server.api_keys, config.cache.namespace),
        admin=AdminToken(config.server.admin_token),
        readers=Readers(config.server.admin_token, config.server.read_token),
        created=int(time.time()),
        retention=Retention(cache, functools.partial(retain_quota, config)),
        events=feed,
        publisher=_publisher(feed, cache, config),
        sessions=sessions,
        warmer=Warmer(loaded, cache, config.session.ttl_s, loop.warm) if warm else None,
    )


def _log_addresses(sockets: list[socket.socket]) -> None:
    """uvicorn logs where it listens only for sockets it binds itself."""
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        logging.getLogger("uvicorn.error").info("kvtier serving on http://%s:%d", shown, port)


def serve(config: Config) -> int:
    check_bind(config)
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(s) for s in listen_sockets(config.server.host, config.server.port)]
        fit_open_files(config.server.max_connections)
        state = build_state(config)
        server = uvicorn.Server(uvicorn_config(config, create_app(state)))
        for sock in sockets:  # listening before the line that says so: a client that waits for it is never refused
            sock.listen(server.config.backlog)
        _log_addresses(sockets)
        try:
            server.run(sockets=sockets)
        finally:
            if state.warmer is not None:
                state.warmer.close()
            state.loop.stop()
            state.cache.close(config.cache.flush_on_exit_s)
            if state.publisher is not None:
                state.publisher.close()
    return 0 if server.started else 1
