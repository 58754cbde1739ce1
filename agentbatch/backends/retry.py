"""Retrying transient backend failures, as a wrapper any ``Backend`` can wear.

Waits are *full-jitter* exponential starting small (50 ms): agent turns often take well under
a second, so a blip should cost milliseconds, and thousands of agents failing together must
not retry in lock-step. A server's ``Retry-After`` is honoured as a lower bound (capped, so a
misconfigured header cannot park a batch). Only errors marked ``retryable`` are retried; the
last ``BackendError`` is re-raised unchanged.

A request bounds its own retries: ``max_attempts`` (the agent's remaining ``max_retries``
plus one, so ``max_retries=0`` makes one HTTP attempt) and ``timeout_s``, one deadline for
every attempt of the call together (each attempt gets what is left; no retry starts, and no
backoff sleeps, past it). The attempts made are reported on the reply and on the error, so
the agent's budget and its error message count them truthfully.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agentbatch.backends.base import Backend, BackendWrapper, RetryListener
from agentbatch.core.errors import BackendError, BackendTimeout
from agentbatch.core.model_io import ModelRequest, ModelResponse

SleepFn = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one model call. ``attempts`` counts the first try."""

    attempts: int = 4
    initial: float = 0.05
    maximum: float = 5.0
    jitter: bool = True
    honour_retry_after: bool = True
    max_retry_after: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be >= 1")
        if self.initial < 0 or self.maximum < 0 or self.max_retry_after < 0:
            raise ValueError("RetryPolicy waits must be >= 0")

    def backoff(self, retry_number: int, rng: random.Random | None = None) -> float:
        """The exponential part of the wait before retry ``retry_number`` (1-based)."""
        ceiling = min(self.maximum, self.initial * (2 ** (retry_number - 1)))
        if not self.jitter:
            return ceiling
        return (rng or random).uniform(0.0, ceiling)

    def wait_for(
        self, retry_number: int, error: BaseException | None, rng: random.Random | None = None
    ) -> float:
        """Seconds to sleep before retry ``retry_number`` after ``error``."""
        wait = self.backoff(retry_number, rng)
        retry_after = getattr(error, "retry_after", None)
        if self.honour_retry_after and retry_after is not None and retry_after > 0:
            wait = max(wait, min(float(retry_after), self.max_retry_after))
        return wait


def _past(deadline: float | None) -> bool:
    """The call's deadline (``time.monotonic()``) has passed: no attempt would get time."""
    return deadline is not None and time.monotonic() >= deadline


def _is_retryable(exc: BaseException) -> bool:
    return isinstance(exc, BackendError) and exc.retryable


class RetryingBackend(BackendWrapper):
    """A ``Backend`` that retries the wrapped backend's ``complete`` per a ``RetryPolicy``.

    ``retries`` counts retries performed (not first attempts), ``retries_by_kind`` splits them
    by error kind; both are for stats. ``listeners`` hear each error about to be retried. The
    other hooks (``warm``, ``fetch_load``, ...) are the wrapped backend's (``BackendWrapper``).
    """

    retries: int = 0  # the base hook, counted here (per instance once the first retry happens)

    def __init__(
        self,
        inner: Backend,
        policy: RetryPolicy | None = None,
        *,
        sleep: SleepFn | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()
        self._sleep: SleepFn = sleep or asyncio.sleep
        self._rng = rng
        self.retries = 0
        self.retries_by_kind: Counter[str] = Counter()
        # Called with each error that is about to be retried (e.g. a fleet-wide AIMD hears
        # every 429 here, including the ones a retry later absorbs).
        self._listeners: list[RetryListener] = []

    @property
    def listeners(self) -> list[RetryListener]:
        """Called with each error that is about to be retried."""
        return self._listeners

    def _count_retry(self, error: BaseException) -> None:
        self.retries += 1
        self.retries_by_kind[getattr(error, "kind", type(error).__name__)] += 1
        for listener in self._listeners:
            listener(error)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """``inner.complete`` with retries; raises the last ``BackendError`` when out of tries
        (or out of the request's ``timeout_s``), with ``attempts`` set on it.

        A plain loop, not tenacity's ``AsyncRetrying``: that cost a retry state, a
        ``concurrent.futures.Future`` and four ``inspect`` calls on every model call, retried
        or not, about a tenth of the engine's client CPU per turn (issue 26 item 5)."""
        attempts = request.max_attempts or self.policy.attempts
        deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
        tried = 0
        while True:
            tried += 1
            try:
                response = await self._inner.complete(self._attempt(request, deadline, tried))
            except Exception as exc:
                if not _is_retryable(exc) or tried >= attempts or _past(deadline):
                    if isinstance(exc, BackendError):
                        exc.attempts = tried
                    raise
                wait = self._wait(tried, exc, deadline)
                self._count_retry(exc)
                await self._sleep(wait)
                continue
            response.attempts = tried
            return response

    def _wait(self, retry_number: int, error: BaseException, deadline: float | None) -> float:
        """The policy's wait before retry ``retry_number``, never past ``deadline``."""
        wait = self.policy.wait_for(retry_number, error, self._rng)
        if deadline is not None:
            wait = min(wait, max(deadline - time.monotonic(), 0.0))
        return wait

    @staticmethod
    def _attempt(request: ModelRequest, deadline: float | None, tried: int) -> ModelRequest:
        """The request for one attempt: the time left of the call's deadline as its timeout.
        The first attempt starts as the deadline is set, so all of ``timeout_s`` is left:
        it goes as it is (no copy of the request on every turn)."""
        if deadline is None or (tried == 1 and (request.timeout_s or 0) > 0):
            return request
        left = deadline - time.monotonic()
        if left <= 0:
            raise BackendTimeout(f"the turn's {request.timeout_s:g}s deadline passed")
        return request.model_copy(update={"timeout_s": left})

    def __repr__(self) -> str:
        return f"RetryingBackend({self._inner!r}, {self.policy!r})"
