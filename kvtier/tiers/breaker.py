"""A circuit breaker: after repeated failures, stop calling a remote for a while instead of waiting on it again.

A remote that is down or hung would otherwise cost every request a full
timeout. Closed, every call goes through; ``failures`` consecutive failures
open it, and for ``retry_s`` no call is made (the caller counts a miss and
recomputes). A failure that cost its caller the whole timeout opens it at
once: a refused connection is cheap to retry, but a node that let one call
wait out its timeout would make the next callers wait too, and a request
should pay that wait once, not once per remote call on its path. Then one
call is let through as a trial: success closes the breaker, failure keeps it
open for another ``retry_s``. Each opening is counted and logged once; the
close that follows is logged too, so a log shows one line per outage, never
one per request.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("kvtier")


class BreakerState(enum.StrEnum):
    CLOSED = "closed"  # calls go through
    OPEN = "open"  # calls are skipped until the next trial


class Breaker:
    def __init__(
        self, name: str, *, failures: int, retry_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        self._threshold = failures
        self._retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._state = BreakerState.CLOSED
        self._retry_at = 0.0
        self.opened = 0  # times it opened since start
        self.skipped = 0  # calls refused while open

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        """May a call go out now? While open, one trial per ``retry_s`` is allowed (the caller must report it)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            now = self._clock()
            if now >= self._retry_at:
                self._retry_at = now + self._retry_s  # the next trial waits another period
                return True
            self.skipped += 1
            return False

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            if self._state is BreakerState.CLOSED:
                return
            self._state = BreakerState.CLOSED
        log.warning("remote %s answers again: circuit breaker closed", self.name)

    def failure(self, err: BaseException, *, timed_out: bool = False) -> None:
        """Count a failed call; ``timed_out`` (it waited the whole timeout) opens the breaker at once."""
        with self._lock:
            self._failures += 1
            if self._state is BreakerState.OPEN:
                self._retry_at = self._clock() + self._retry_s
                return
            if self._failures < self._threshold and not timed_out:
                return
            self._state = BreakerState.OPEN
            self._retry_at = self._clock() + self._retry_s
            self.opened += 1
        log.warning(
            "remote %s failed %d times in a row (%s): circuit breaker open, skipping it for %.1f s at a time",
            self.name,
            self._failures,
            err,
            self._retry_s,
        )
