"""Backpressure from the server's own queue: hold new model calls while it is backed up.

A fixed in-flight cap cannot know how busy a shared server is (other batches, other users).
vLLM-style servers publish ``num_requests_waiting``; when that queue is longer than
``max_waiting``, sending more only lengthens it (and every queued prompt holds KV memory the
running ones could use), so callers wait and re-check every ``interval_s`` instead.

The gauge alone cannot hold a burst: it is read at most every ``interval_s`` and lags what
this process has just sent (the first reading of a batch sees an empty queue, so a whole first
wave would go out at once). So the gate also counts the calls it admitted since the reading it
holds was fetched ("unseen" by the gauge) and admits a call only while
``waiting + unseen <= max_waiting``: one process adds at most ``max_waiting + 1`` to the
queue before a fresh reading accounts for it. A call admitted before a fetch started counts as
seen by it (the caller sends it at once; if it reaches the server after the read, that is the
slack of one reading).

The load is fetched at most once per ``interval_s`` and shared: however many agents wait, one
``fetch_load()`` is in flight at a time. A backend without metrics (``fetch_load`` missing,
returning None, or failing) never blocks: backpressure is advisory.

A hold is bounded: by the turn's deadline (``turn_deadline``: ``timeout_per_turn`` from the
turn's start), after which the turn fails with the retryable ``ServerBusy``, and by the
batch's cancel flag. A server whose queue never drains (or ``max_waiting`` below zero) would
otherwise hold every turn, the threads running them and a worker's shutdown forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentbatch.backends.base import ServerLoad
from agentbatch.core.errors import BatchCancelled, ServerBusy

log = logging.getLogger(__name__)

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]
CancelCheck = Callable[[], Awaitable[bool]]

# The bound on capacity waits of a turn whose model calls have no timeout (None).
UNTIMED_TURN_WAIT_S = 120.0


def turn_deadline(timeout_per_turn: float | None, clock: Clock = time.monotonic) -> float:
    """When a turn starting now stops waiting for capacity (on ``clock``, the gate's clock)."""
    budget = timeout_per_turn if timeout_per_turn is not None else UNTIMED_TURN_WAIT_S
    return clock() + budget


class BackpressureGate:
    """``await gate.wait_ready()`` before each model call (or pass it as ``slot(ready=...)``).

    ``stats()``: ``checks`` (``wait_ready`` calls), ``holds`` (calls that had to wait),
    ``sleeps`` (intervals slept in total), ``fetches`` (``fetch_load`` calls), ``last_waiting``.
    """

    def __init__(
        self,
        backend: Any,
        *,
        max_waiting: float,
        interval_s: float = 0.5,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self._fetch_load = backend.fetch_load
        self.max_waiting = max_waiting
        self.interval_s = interval_s
        self._clock = clock
        self._sleep = sleep
        self._load: ServerLoad | None = None
        self._fetched_at: float | None = None
        self._inflight: asyncio.Future[ServerLoad | None] | None = None
        self.checks = 0
        self.holds = 0
        self.sleeps = 0
        self.fetches = 0
        self._admitted = 0  # calls let through, ever
        self._seen = 0  # of those, how many were sent before the held reading was fetched

    @property
    def unseen(self) -> int:
        """Calls admitted since the held reading was fetched: not yet in its gauge."""
        return self._admitted - self._seen

    def stats(self) -> dict[str, Any]:
        return {
            "checks": self.checks,
            "holds": self.holds,
            "sleeps": self.sleeps,
            "fetches": self.fetches,
            "last_waiting": self._load.waiting if self._load is not None else None,
        }

    def looks_open(self) -> bool:
        """Whether the last known load admits a call now (no fetch: a claim asks this to
        decide whether to take its inference slot in the same script)."""
        return not self._blocked(self._load)

    def _blocked(self, load: ServerLoad | None) -> bool:
        return load is not None and load.waiting + self.unseen > self.max_waiting

    async def wait_ready(self, deadline: float | None = None,
                         cancelled: CancelCheck | None = None) -> None:
        """Return once the last known load plus the calls it has not seen yet is at most
        ``max_waiting`` (or the load is unknown); the call returned for counts as sent.

        While held: raise ``ServerBusy`` once ``deadline`` (on the gate's clock) has passed,
        and ``BatchCancelled`` when ``cancelled()`` says so (asked once per interval held).
        """
        self.checks += 1
        if self._fetch_load is None:
            return
        held = False
        while self._blocked(load := await self.load()):
            if not held:
                held = True
                self.holds += 1
            if cancelled is not None and await cancelled():
                raise BatchCancelled("the batch was cancelled")
            pause = self.interval_s
            if deadline is not None:
                left = deadline - self._clock()
                if left <= 0:
                    assert load is not None
                    raise ServerBusy(
                        f"the server's queue stayed above max_server_waiting="
                        f"{self.max_waiting:g} ({load.waiting:g} waiting, {self.unseen} sent "
                        f"since that reading) until the turn's deadline")
                pause = min(pause, left)
            self.sleeps += 1
            await self._sleep(pause)
        if load is not None:
            self._admitted += 1

    async def load(self) -> ServerLoad | None:
        """The server load, refreshed when older than ``interval_s``; one fetch at a time."""
        if self._fetch_load is None:
            return None
        fresh = (
            self._fetched_at is not None and self._clock() - self._fetched_at < self.interval_s
        )
        if fresh:
            return self._load
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._refresh())
        # Shielded: a waiter that is cancelled must not cancel the fetch the others share.
        return await asyncio.shield(self._inflight)

    async def _refresh(self) -> ServerLoad | None:
        assert self._fetch_load is not None
        self.fetches += 1
        admitted_before = self._admitted  # sent before this read: in its gauge
        try:
            load = await self._fetch_load()
        except Exception as exc:  # advisory: a failing probe must never stall the batch
            log.debug("fetch_load failed: %r", exc)
            load = None
        except BaseException:
            self._inflight = None
            raise
        self._load = load if isinstance(load, ServerLoad) else None
        self._fetched_at = self._clock()
        self._seen = max(self._seen, admitted_before)
        self._inflight = None
        return self._load
