"""An engine's link to the node's cache service: one live client, reconnected at most every ``RECONNECT_S``.

Every connector needs the same rule: a service that is down, goes away or
answers with failures makes every call a miss (None here), its failures are
counted, and the link tries again later, never in a tight loop on the
engine's hot path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.layout import KVLayout
from kvtier.service.client import CacheClient, ServiceUnavailable

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
    ) -> None:
        self.socket, self.layout, self.fingerprint = socket, layout, fingerprint
        self._count = count_failures
        self._miss = miss_message
        self._client: CacheClient | None = None
        self._retry_at = 0.0
        self._lock = threading.Lock()  # the engine's threads share one link

    def client(self) -> CacheClient | None:
        """The live client; None (a miss) while the service is away or until the next retry is due."""
        with self._lock:
            c = self._client
            if c is not None and c.failures == 0:
                return c
            if c is not None:
                self._count(c.failures)
                c.close()
                self._client = None
            now = time.monotonic()
            if now < self._retry_at:
                return None
            self._retry_at = now + RECONNECT_S
            try:
                self._client = CacheClient(self.socket, self.layout, model_fingerprint=self.fingerprint)
            except ServiceUnavailable as err:
                log.warning("kvtier: %s; %s", err, self._miss)
                self._count(1)
            return self._client

    def unreported_failures(self) -> int:
        """Failures of the live client not yet counted (they are counted when the link drops it)."""
        with self._lock:
            return self._client.failures if self._client is not None else 0

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
