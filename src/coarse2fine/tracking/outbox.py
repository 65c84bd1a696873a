"""`Outbox`: a stage's MLflow writes while its store cannot be reached, kept in order and retried with back-off.

A training stage runs for days; a tracking server restarts (an upgrade, a node reboot) in a minute. A write that
fails waits here with every later one, so the run's history keeps its order; each new write first retries the
waiting ones, at most once per back-off period (doubling from FIRST_RETRY_SECONDS to MAX_RETRY_SECONDS), so a
stage pays for a dead server a few seconds a period, not at every call. At most MAX_WRITES wait (about a
thousand epochs' metrics, tags and system-metric samples): beyond that the oldest are dropped with one warning;
the DVCLive files hold every metric either way. The stage's end drains it, waiting up to `drain_seconds`.
MLflow's own async logging (`synchronous=False`) queues writes in a thread but drops a batch that still fails after
its HTTP retries (an error in the log, mlflow/utils/async_logging/async_logging_queue.py): nothing there waits for a
server to come back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from coarse2fine.errors import first_line

logger = logging.getLogger(__name__)
FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS = 5.0, 60.0
MAX_WRITES = 10_000

Write = tuple[str, tuple[Any, ...], dict[str, Any]]


class Outbox:
    """`call(method, *args)` runs `send(method, args, kwargs)` (a client's method) unless writes are waiting and
    their retry is not due; a failure keeps the write and starts the back-off. `where` names the store in the
    warnings: one when it goes, one when it is back."""

    def __init__(self, send: Callable[[str, tuple, dict], Any], where: str, *, clock: Callable[[], float] = time.monotonic):
        self._send, self._where, self._clock = send, where, clock
        self._waiting: deque[Write] = deque()
        self._delay, self._retry_at, self._dropped = FIRST_RETRY_SECONDS, 0.0, 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def write(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A write: sent now (its result returned) when nothing waits or the waiting ones went through, else kept
        (None)."""
        if self._waiting and not self.retry():
            self._keep((method, args, kwargs))
            return None
        try:
            return self._send(method, args, kwargs)
        except Exception as error:  # whatever the store raised: MlflowException, sqlalchemy, requests, OSError
            self._went(error)
            self._keep((method, args, kwargs))
            return None

    def read(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A read (its answer is needed now): None while the store is away."""
        if self._waiting and not self.retry():
            return None
        try:
            return self._send(method, args, kwargs)
        except Exception as error:
            self._went(error)
            return None

    def retry(self, *, now: bool = False) -> bool:
        """Send the waiting writes in order if their retry is due (or `now`); True when none is left."""
        if not self._waiting:
            return True
        if not now and self._clock() < self._retry_at:
            return False
        sent = 0
        while self._waiting:
            method, args, kwargs = self._waiting[0]
            try:
                self._send(method, args, kwargs)
            except Exception:
                self._back_off()
                return False
            self._waiting.popleft()
            sent += 1
        logger.warning("MLflow at %s is back: %d waiting write(s) sent", self._where, sent)
        self._delay = FIRST_RETRY_SECONDS
        return True

    def drain(self, seconds: float, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Retry until nothing waits or `seconds` have passed; True when everything was sent."""
        deadline = self._clock() + seconds
        while not self.retry(now=True):
            if self._clock() >= deadline:
                logger.warning("warning: MLflow at %s still unreachable: %d write(s) not sent (every metric is in "
                               "the stage's DVCLive files)", self._where, len(self._waiting))
                return False
            sleep(max(0.0, min(self._retry_at, deadline) - self._clock()))
        return True

    def _went(self, error: BaseException) -> None:
        if not self._waiting:
            logger.warning("warning: MLflow at %s is not reachable (%s): its writes wait (up to %d) and are retried "
                           "every %g-%g s", self._where, first_line(error), MAX_WRITES, FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS)
        self._back_off()

    def _back_off(self) -> None:
        self._retry_at = self._clock() + self._delay
        self._delay = min(self._delay * 2, MAX_RETRY_SECONDS)

    def _keep(self, write: Write) -> None:
        if len(self._waiting) == MAX_WRITES:
            self._waiting.popleft()
            if self._dropped == 0:
                logger.warning("warning: MLflow at %s: more than %d writes waiting, the oldest are dropped",
                               self._where, MAX_WRITES)
            self._dropped += 1
        self._waiting.append(write)
