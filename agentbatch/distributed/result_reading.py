"""What one read of a batch's result stream remembers, apart from how it talks to Redis.

``DistributedHandle.results()`` (blocking) and ``aresults()`` (asyncio) each drive one
``StreamRead``: it keeps the cursor, drops a second result of an agent, times the check on
Redis's memory, and decides how long an unreachable Redis is retried. The rules live here
once, so both readers ride out the same outage and give up at the same bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import redis

log = logging.getLogger(__name__)

RECONNECT_WINDOW_S = 30.0  # an unreachable Redis is retried this long, then the batch is lost
RETRY_PAUSE_S = 0.5
OOM_CHECK_S = 5.0  # while no result arrives, how often a reader asks whether Redis is full
TRANSIENT = (redis.ConnectionError, redis.TimeoutError)

Lost = Callable[[str], BaseException]  # why -> the error that ends the read


class StreamRead:
    """One pass over a batch's result stream, from ``cursor``."""

    def __init__(self, batch_id: str, total: int, cursor: str, lost: Lost) -> None:
        self.batch_id = batch_id
        self.cursor = cursor
        self._seen = bytearray(total)  # one byte per agent: each result once per read
        self._lost = lost
        self._failing_since: float | None = None
        self._next_memory_check = time.monotonic() + OOM_CHECK_S

    def fresh(self, entries: list[tuple[str, dict[str, str]]]
              ) -> Iterator[tuple[str, dict[str, str]]]:
        """The entries to deliver, advancing the cursor past every one read."""
        if entries:
            self._next_memory_check = time.monotonic() + OOM_CHECK_S
        for entry_id, fields in entries:
            self.cursor = entry_id
            if self._first(fields):
                yield entry_id, fields

    def _first(self, fields: dict[str, str]) -> bool:
        """False for a second result of an agent in one read. After a Sentinel failover an
        agent whose final commit the old primary acknowledged but never replicated runs
        again, and its result is written again; a reader that saw the first one skips it."""
        try:
            index = int(fields["i"])
        except (KeyError, ValueError):
            return True
        if not 0 <= index < len(self._seen):
            return True
        if self._seen[index]:
            log.warning("batch %s: skipped a second result of agent %d (written again after "
                        "a Redis failover lost its first commit)", self.batch_id, index)
            return False
        self._seen[index] = 1
        return True

    def reached(self) -> None:
        """Redis answered: an outage, if there was one, is over."""
        self._failing_since = None

    def unreachable(self, exc: BaseException) -> float:
        """Redis did not answer: seconds to wait before the next try, or the batch is lost
        (raised) once it has been unreachable for ``RECONNECT_WINDOW_S``."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._failing_since > RECONNECT_WINDOW_S:
            raise self._lost(f"Redis has been unreachable for {RECONNECT_WINDOW_S:.0f}s "
                             f"({exc})") from exc
        return RETRY_PAUSE_S

    def memory_check_due(self) -> bool:
        """True about every ``OOM_CHECK_S`` while no result arrives."""
        now = time.monotonic()
        if now < self._next_memory_check:
            return False
        self._next_memory_check = now + OOM_CHECK_S
        return True
