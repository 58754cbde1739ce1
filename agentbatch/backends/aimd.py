"""Adaptive concurrency for hosted APIs: additive increase, multiplicative decrease (AIMD).

Hosted APIs (OpenAI, Anthropic, Bedrock) enforce per-account limits we cannot see. A fixed
concurrency is either too timid or produces a storm of 429s; AIMD finds the account's limit
the way TCP finds a link's: halve on a throttle, creep up by one after a quiet period. A burst
of 429s from one overload arrives together, so a halving happens at most once per
``cooldown_s``. Throttles are retried (by ``RetryingBackend`` outside ``AdaptiveBackend``), never
counted as agent failures -- they only slow the batch down.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from agentbatch.backends.base import Backend, BackendWrapper
from agentbatch.core.errors import RateLimited
from agentbatch.core.model_io import ModelRequest, ModelResponse

log = logging.getLogger(__name__)

Listener = Callable[[int], None]


def is_throttle(exc: BaseException) -> bool:
    """A signal to slow down: a 429/throttle, or Anthropic's 529 "overloaded"."""
    return isinstance(exc, RateLimited) or getattr(exc, "status", None) == 529


class AIMDController:
    """The concurrency limit as pure logic over an injectable ``clock``.

    ``on_change(limit)`` listeners hear every change (e.g. an engine's
    ``PrioritySlots.set_capacity``); a listener that raises is logged and ignored.
    """

    def __init__(
        self,
        initial: int = 2,
        minimum: int = 1,
        maximum: int = 64,
        quiet_period_s: float = 30.0,
        cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: Listener | None = None,
    ) -> None:
        if not 1 <= minimum <= maximum:
            raise ValueError("AIMD needs 1 <= minimum <= maximum")
        self.minimum, self.maximum = minimum, maximum
        self.quiet_period_s, self.cooldown_s = quiet_period_s, cooldown_s
        self._clock = clock
        self._limit = min(maximum, max(minimum, initial))
        self._quiet_since = clock()
        self._last_decrease: float | None = None
        self._listeners: list[Listener] = [on_change] if on_change else []
        self.throttles = 0  # every throttle seen
        self.decreases = 0  # halvings actually applied
        self.increases = 0

    @property
    def limit(self) -> int:
        return self._limit

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _set(self, limit: int) -> None:
        if limit == self._limit:
            return
        self._limit = limit
        for listener in list(self._listeners):
            try:
                listener(limit)
            except Exception:
                log.exception("AIMD listener failed")

    def on_throttle(self) -> bool:
        """Halve the limit unless it was halved within ``cooldown_s``; True if it was now."""
        now = self._clock()
        self.throttles += 1
        self._quiet_since = now
        if self._last_decrease is not None and now - self._last_decrease < self.cooldown_s:
            return False
        self._last_decrease = now
        self.decreases += 1
        self._set(max(self.minimum, self._limit // 2))
        return True

    def on_success(self) -> bool:
        """+1 once ``quiet_period_s`` passed without a throttle (then the timer restarts)."""
        now = self._clock()
        if now - self._quiet_since < self.quiet_period_s:
            return False
        self._quiet_since = now
        if self._limit >= self.maximum:
            return False
        self.increases += 1
        self._set(self._limit + 1)
        return True


class ResizableGate:
    """A FIFO semaphore whose capacity may change while held (shrinking evicts no one)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self.in_use = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def set_capacity(self, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use < self._capacity:
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_use += 1
                fut.set_result(None)

    async def acquire(self) -> None:
        if self.in_use < self._capacity and not self._waiters:
            self.in_use += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled in the same tick: hand it on
            raise

    def release(self) -> None:
        self.in_use -= 1
        self._wake()


class AdaptiveBackend(BackendWrapper):
    """A ``Backend`` whose concurrency follows an ``AIMDController``.

    Wrap it inside the retry layer -- ``RetryingBackend(AdaptiveBackend(inner))`` -- so every
    retry passes the gate again at the (possibly reduced) limit. Throttles are re-raised
    unchanged after informing the controller. The hooks are the inner backend's.
    """

    def __init__(self, inner: Backend, controller: AIMDController | None = None) -> None:
        super().__init__(inner)
        self.controller = controller or AIMDController()
        self.gate = ResizableGate(self.controller.limit)
        self.controller.add_listener(self.gate.set_capacity)

    @property
    def limit(self) -> int:
        return self.controller.limit

    async def complete(self, request: ModelRequest) -> ModelResponse:
        await self.gate.acquire()
        try:
            response = await self._inner.complete(request)
        except BaseException as exc:
            if is_throttle(exc):
                self.controller.on_throttle()
            raise
        finally:
            self.gate.release()
        self.controller.on_success()
        return response

    def __repr__(self) -> str:
        return f"AdaptiveBackend({self._inner!r}, limit={self.controller.limit})"
