"""A per-tool async token bucket.

External APIs behind tools (search, scraping) have rate limits that a 10,000-agent batch would
blow through in a second. Each acquirer reserves a token up front (the balance may go negative)
and sleeps exactly until its token is due: waiters queue in arrival order, and nothing spins.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

__all__ = ["TokenBucket"]


def _monotonic() -> float:
    return time.monotonic()


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def check_bucket(rate: float, burst: float) -> None:
    """Refuse a bucket that could never hand out a token (both buckets share this rule)."""
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError("rate must be a positive number of tokens per second")
    if burst < 1:
        raise ValueError("burst must be at least 1")


class TokenBucket:
    """``rate`` tokens per second, holding at most ``burst``; ``acquire`` waits for one.

    ``clock`` and ``sleep`` default to the module's ``_monotonic``/``_sleep`` (looked up at call
    time, so tests can replace them).
    """

    def __init__(self, rate: float, burst: float = 1.0, *,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[None]] | None = None) -> None:
        check_bucket(rate, burst)
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._sleep = sleep
        self._tokens = burst
        self._updated = self._now()

    def _now(self) -> float:
        return (self._clock or _monotonic)()

    def _refill(self) -> None:
        now = self._now()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now

    def reserve(self) -> float:
        """Take a token now (possibly on credit); returns how long to wait until it is due."""
        self._refill()
        self._tokens -= 1
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def acquire(self) -> float:
        """Wait for a token; returns the seconds slept (0 when one was available)."""
        delay = self.reserve()
        if delay <= 0:
            return 0.0
        try:
            await (self._sleep or _sleep)(delay)
        except asyncio.CancelledError:
            self._refill()  # hand the unused reservation back to the queue
            self._tokens = min(self.burst, self._tokens + 1)
            raise
        return delay
