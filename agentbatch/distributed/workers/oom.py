"""Redis out of memory, said once in the worker log instead of a loop of tracebacks.

Under ``maxmemory`` with ``noeviction`` Redis refuses every write: commits fail, the sweep
fails, and Celery's consumer cannot even re-declare its queues, so it logs "Cannot connect"
several times a second. None of that says why. A filter on the log handlers turns the first
such record into one clear error and drops the repeats; the sweeper thread then probes Redis
each interval (only while this lasts) and logs once when it accepts writes again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

log = logging.getLogger(__name__)

_MARKERS = ("OutOfMemoryError", "used memory > 'maxmemory'")
# what Celery logs because of the refused writes: dropped with them while Redis is full
_CONSEQUENCES = ("Connection to broker lost", "Trying to reconnect", "RestartFreqExceeded")
MESSAGE = (
    "Redis is out of memory (maxmemory reached, policy noeviction) and refuses writes: agent "
    "turns cannot commit and the consumer cannot reconnect, so every batch on this Redis is "
    "stalled until memory is freed. Delete finished batches (agentbatch ls, agentbatch rm), "
    "lower AGENTBATCH_RETENTION_S, or raise maxmemory. Repeats are not logged; this worker "
    "keeps retrying and says when Redis accepts writes again.")


def _is_oom(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    while exc is not None:
        if isinstance(exc, redis.exceptions.OutOfMemoryError):
            return True
        if any(m in f"{type(exc).__name__}: {exc}" for m in _MARKERS):
            return True  # kombu re-raises it under its own class
        exc = exc.__cause__ or exc.__context__
    try:
        text = record.getMessage()
    except Exception:
        return False
    return any(m in text for m in _MARKERS)


def _consequence(record: logging.LogRecord) -> bool:
    try:
        text = record.getMessage()
    except Exception:
        return False
    return any(c in text for c in _CONSEQUENCES)


class OomWatch(logging.Filter):
    """The log filter and the recovery probe, one per process."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.active_since: float | None = None
        self.suppressed = 0
        self.episodes = 0
        self._client: Any = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == __name__:
            return True
        oom = _is_oom(record)
        with self._lock:
            if oom and self.active_since is None:
                self.active_since = time.monotonic()
                self.episodes += 1
                record.msg, record.args = MESSAGE, ()
                record.exc_info = record.exc_text = None
                record.levelno, record.levelname = logging.ERROR, "ERROR"
                return True
            if self.active_since is not None and (oom or _consequence(record)):
                self.suppressed += 1
                return False
        return True

    def check(self, redis_url: str) -> None:
        """While Redis is out of memory: probe it, and log once when it accepts writes."""
        if self.active_since is None:
            return
        from agentbatch.distributed.state.connection import sync_client
        from agentbatch.distributed.state.retention import out_of_memory

        if self._client is None:
            self._client = sync_client(redis_url)
        try:
            if out_of_memory(self._client) is not None:
                return
        except redis.RedisError:
            return
        with self._lock:
            lasted = time.monotonic() - (self.active_since or time.monotonic())
            suppressed, self.active_since, self.suppressed = self.suppressed, None, 0
        log.warning("Redis accepts writes again after %.0fs out of memory (%d repeated "
                    "error(s) were not logged); stalled agents resume", lasted, suppressed)


watch = OomWatch()


def install() -> None:
    """Put the filter on every log handler there is (Celery's included); idempotent."""
    loggers: list[Any] = [logging.getLogger()]
    loggers += [lg for lg in logging.Logger.manager.loggerDict.values()
                if isinstance(lg, logging.Logger)]
    for logger in loggers:
        for handler in logger.handlers:
            if watch not in handler.filters:
                handler.addFilter(watch)
