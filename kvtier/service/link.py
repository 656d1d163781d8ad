"""An engine's link to the node's cache service: one live client, replaced when the service went away.

Every holder of the service (``kvtier serve``'s cache, the connectors inside
vLLM, llama.cpp and SGLang) needs the same rule: a service that is down,
goes away or answers with failures makes every call a miss (None here), its
failures are counted, and the link connects again: at once after losing a
connection, then no more often than every ``retry_s``, never in a tight
loop on the engine's hot path. A
service restarted under the same socket is found at the first call after
its restart: a connection the old one closed is seen before it is used
(:meth:`CacheClient.alive`). Losing and finding the service are each said
once in the log, not at every retry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.layout import KVLayout
from kvtier.service.client import CacheClient, ServiceRefused, ServiceUnavailable

log = logging.getLogger(__name__)

RECONNECT_S = 5.0


class ServiceLink:
    def __init__(
        self,
        socket: str | Path,
        layout: KVLayout,
        fingerprint: str,
        *,
        count_failures: Callable[[int], None],
        miss_message: str = "serving misses",
        retry_s: float = RECONNECT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` tells when the next try is due (tests step it instead of sleeping)."""
        self.socket, self.layout, self.fingerprint = socket, layout, fingerprint
        self._count = count_failures
        self._miss = miss_message
        self._retry_s = retry_s
        self._clock = clock
        self._client: CacheClient | None = None
        self._retry_at = 0.0
        self._lost = False  # said in the log; said again only once the service answers
        self.connects = 0
        self._lock = threading.Lock()  # the engine's threads share one link

    def open(self) -> CacheClient | None:
        """Connect now, at start: a refusal (another model, layout or user) raises; an absent service is a miss."""
        with self._lock:
            return self._connect(refusal_raises=True)

    def client(self) -> CacheClient | None:
        """The live client; None (a miss) while the service is away or until the next try is due."""
        with self._lock:
            c = self._client
            if c is not None and c.failures == 0 and c.alive():
                return c
            if c is not None:
                self._count(max(1, c.failures))  # a connection the service closed is one failure
                c.close()  # once no fill or copy uses its slots
                self._client = None
            return self._connect(refusal_raises=False)

    def _connect(self, *, refusal_raises: bool) -> CacheClient | None:
        now = self._clock()
        if now < self._retry_at:
            return None
        try:
            self._client = CacheClient(self.socket, self.layout, model_fingerprint=self.fingerprint)
        except ServiceUnavailable as err:
            self._retry_at = now + self._retry_s  # only a failed try waits: a lost connection is retried at once
            self._count(1)
            if refusal_raises and isinstance(err, ServiceRefused):
                raise
            if not self._lost:
                self._lost = True
                log.warning("kvtier: %s; %s until it answers (tried again every %gs)", err, self._miss, self._retry_s)
            return None
        self.connects += 1
        if self._lost:
            self._lost = False
            log.warning("kvtier: cache service at %s answers again; using it", self.socket)
        return self._client

    @property
    def connected(self) -> bool:
        with self._lock:
            return self._client is not None

    def unreported_failures(self) -> int:
        """Failures of the live client not yet counted (they are counted when the link drops it)."""
        with self._lock:
            return self._client.failures if self._client is not None else 0

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
