"""Hedged stragglers on a pool: a turn in flight past ``hedge_after`` x p95 is sent again.

One slow server of a pool holds the tail of a batch: the agents whose turns it serves finish
last. ``hedge_after=`` (``BatchOptions``) makes the ``EndpointPool`` send such a turn a second
time, to another of its endpoints; the first answer is returned, and the other request is
cancelled (its HTTP request closed, so the server stops working on it). The race happens
inside one ``complete`` call, so the turn machine sees one reply and applies the turn once.

The bar is ``hedge_after`` times the p95 of the *typical* endpoint: each endpoint keeps the
latencies of the requests it answered (the last ``WINDOW``), an endpoint's p95 counts once it
has ``MIN_SAMPLES`` of them, and the bar uses the median of those p95s (the lower one for an
even count). A pool-wide p95 would not do: with one slow endpoint of three, a third of all
answers are slow, the p95 is the slow latency, and nothing would ever be hedged. Until some
endpoint has ``MIN_SAMPLES`` answers nothing is hedged; a turn already in flight is hedged as
soon as the bar is known and it is past it.

A hedge goes to an endpoint that is not ejected and not the turn's own, whose own p95 (where
known) is under the bar, suspect ones last, then the fewest in flight, ties by the agent's
ranking. At most one hedge per turn. The counters (``stats``) are in
``handle.stats()["pool"]["hedge"]``: hedges sent, won by the hedge, won by the original,
and the loser's tokens: exact when both answered, else the loser's prompt (the same as the
winner's; its completion tokens are not known, since it was stopped). Those tokens were paid
for, so the winner's reply carries them (``ModelResponse.hedge_usage``): the turn machine
adds them to the agent's ``hedge_usage``, which its ``cost_usd``, the caps and the batch's
spend count at the sync prices (``core/pricing.state_cost``; on the distributed engine the
winning commit adds them to the spend in Redis). The same counts go to
Prometheus as they happen (``agentbatch_hedges_total``, ``agentbatch_hedge_outcomes_total``,
``agentbatch_hedge_loser_tokens_total``), and a subclass may count them elsewhere too by
overriding ``_settled`` and ``_count_loser`` (the distributed engine: per batch,
``distributed/workers/hedging.py``); both run in the task that called ``race``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbatch.core.errors import BackendError
from agentbatch.core.model_io import ModelResponse, Usage
from agentbatch.metrics import (
    hedging_enabled,
    record_hedge_loser_tokens,
    record_hedge_outcome,
    record_hedge_sent,
)

if TYPE_CHECKING:
    from agentbatch.backends.base import Backend

MIN_SAMPLES = 20  # answers an endpoint must have given before its p95 counts
WINDOW = 200  # the latencies each endpoint keeps (the running p95 follows the recent ones)
QUANTILE = 0.95


@dataclass(frozen=True)
class Attempt:
    """One request of a turn: the endpoint it goes to, and how to send it."""

    endpoint: str
    send: Callable[[], Awaitable[ModelResponse]]


def p95(samples: list[float]) -> float:
    """The nearest-rank 95th percentile of a non-empty list."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(QUANTILE * len(ordered)) - 1)]


class Hedger:
    """Latency windows per endpoint, the hedging bar, the race, and its counters."""

    def __init__(self, hedge_after: float, *, min_samples: int = MIN_SAMPLES,
                 window: int = WINDOW) -> None:
        if not (math.isfinite(hedge_after) and hedge_after > 1):
            raise ValueError(f"hedge_after must be a finite number > 1, got {hedge_after!r}")
        self.hedge_after = float(hedge_after)
        self.min_samples = min_samples
        self._window = window
        self._latencies: dict[str, deque[float]] = {}
        self._p95: dict[str, float] = {}  # endpoints with min_samples answers; refreshed
        self._ready: asyncio.Future[None] | None = None  # resolved once a bar is known
        self.hedges = 0
        self.hedge_wins = 0
        self.original_wins = 0
        self.both_failed = 0
        self.no_target = 0
        self.loser_prompt_tokens = 0
        self.loser_completion_tokens = 0
        hedging_enabled()  # its Prometheus counters exist, at 0, from now on

    # -- the bar ----------------------------------------------------------------------------

    def record(self, endpoint: str, seconds: float) -> None:
        """An answer from ``endpoint`` that took ``seconds`` from its own send."""
        window = self._latencies.setdefault(endpoint, deque(maxlen=self._window))
        window.append(seconds)
        if len(window) >= self.min_samples:
            self._p95[endpoint] = p95(list(window))
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)

    def endpoint_p95(self, endpoint: str) -> float | None:
        return self._p95.get(endpoint)

    def bar(self) -> float | None:
        """Seconds after which a turn in flight is hedged; None until an endpoint has
        ``min_samples`` answers."""
        if not self._p95:
            return None
        ordered = sorted(self._p95.values())
        return self.hedge_after * ordered[(len(ordered) - 1) // 2]

    def _ready_future(self) -> asyncio.Future[None]:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            if self._p95:
                self._ready.set_result(None)
        return self._ready

    # -- the race ---------------------------------------------------------------------------

    async def race(self, first: Attempt,
                   second: Callable[[float], Attempt | None]) -> ModelResponse:
        """``first``'s answer, or, once it is in flight past the bar, the first answer of it
        and ``second(bar)`` (None: no endpoint to hedge to). The loser is cancelled."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        call: asyncio.Future[ModelResponse] = asyncio.ensure_future(first.send())
        tasks: list[asyncio.Future[ModelResponse]] = [call]
        try:
            bar = await self._wait_past_bar(call, t0)
            if bar is not None:
                target = second(bar)
                if target is None:
                    self.no_target += 1
                else:
                    hedge: asyncio.Future[ModelResponse] = asyncio.ensure_future(target.send())
                    tasks.append(hedge)
                    self.hedges += 1
                    record_hedge_sent()
                    starts = {call: (first.endpoint, t0), hedge: (target.endpoint, loop.time())}
                    return await self._first_answer(starts, call, hedge)
            await asyncio.wait({call})
            response = call.result()  # its error, when it failed alone
            self.record(first.endpoint, loop.time() - t0)
            return response
        finally:
            await _cancel(tasks)  # the loser, or both when the caller gave up

    async def _wait_past_bar(self, call: asyncio.Future[ModelResponse],
                             t0: float) -> float | None:
        """The bar once ``call`` has been in flight past it; None if ``call`` ended first."""
        loop = asyncio.get_running_loop()
        while not call.done():
            bar = self.bar()
            if bar is None:
                either: set[asyncio.Future[Any]] = {call, self._ready_future()}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                continue
            left = t0 + bar - loop.time()
            if left <= 0:
                return bar
            await asyncio.wait({call}, timeout=left)  # the bar may move meanwhile: re-read
        return None

    async def _first_answer(self, starts: Mapping[asyncio.Future[ModelResponse], tuple[str, float]],
                            call: asyncio.Future[ModelResponse],
                            hedge: asyncio.Future[ModelResponse]) -> ModelResponse:
        """The first answer of the original ``call`` and its ``hedge``; a backend error
        only once both have failed (the original's)."""
        pending: set[asyncio.Future[ModelResponse]] = {call, hedge}
        errors: dict[asyncio.Future[ModelResponse], BaseException] = {}
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            answered = []
            for task in sorted(done, key=lambda t: t is not call):  # a tie goes to the original
                exc = None if task.cancelled() else task.exception()
                if exc is None and not task.cancelled():
                    answered.append(task)
                elif exc is not None and not isinstance(exc, BackendError):
                    raise exc  # not a backend's answer: nothing to race for
                elif exc is not None:
                    errors[task] = exc
            if not answered:
                continue
            winner = answered[0]
            endpoint, sent = starts[winner]
            self.record(endpoint, asyncio.get_running_loop().time() - sent)
            self._settled("hedge_won" if winner is hedge else "original_won")
            response = winner.result()
            lost: Usage | None = None
            if len(answered) > 1:  # both answered at once: the loser's tokens are known
                lost = answered[1].result().usage
            elif pending:  # cancelled by ``race``: its prompt was sent, its completion unknown
                lost = Usage(prompt_tokens=response.usage.prompt_tokens)
            if lost is None:  # the loser failed: a backend error, nothing to pay
                return response
            self._count_loser(lost.prompt_tokens, lost.completion_tokens)
            # the turn machine adds it to the agent's paid tokens: cost_usd and the spend
            return response.model_copy(update={"hedge_usage": Usage(
                prompt_tokens=lost.prompt_tokens, cached_tokens=lost.cached_tokens,
                completion_tokens=lost.completion_tokens)})
        self._settled("both_failed")
        raise errors.get(call) or next(iter(errors.values()))

    def _settled(self, outcome: str) -> None:
        """A hedged turn settled: ``hedge_won``, ``original_won`` or ``both_failed``."""
        if outcome == "hedge_won":
            self.hedge_wins += 1
        elif outcome == "original_won":
            self.original_wins += 1
        else:
            self.both_failed += 1
        record_hedge_outcome(outcome)

    def _count_loser(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The tokens of a hedged turn's losing request (called just before ``_settled``'s
        caller returns the winner's answer)."""
        self.loser_prompt_tokens += prompt_tokens
        self.loser_completion_tokens += completion_tokens
        record_hedge_loser_tokens(prompt_tokens, completion_tokens)

    def stats(self) -> dict[str, Any]:
        """Counters for ``handle.stats()["pool"]["hedge"]``; ``bar_s`` is the current bar."""
        return {
            "hedge_after": self.hedge_after,
            "min_samples": self.min_samples,
            "bar_s": self.bar(),
            "hedges": self.hedges,
            "hedge_wins": self.hedge_wins,
            "original_wins": self.original_wins,
            "both_failed": self.both_failed,
            "no_target": self.no_target,
            "loser_prompt_tokens": self.loser_prompt_tokens,
            "loser_completion_tokens": self.loser_completion_tokens,
        }


async def _cancel(calls: list[asyncio.Future[ModelResponse]]) -> None:
    """Cancel what is still running and wait for it: its HTTP request is closed before the
    turn goes on, so the server stops spending on it."""
    for call in calls:
        if not call.done():
            call.cancel()
    for call in calls:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await call
        if call.done() and not call.cancelled():
            call.exception()  # retrieved: no "exception was never retrieved" warning


def enable_hedging(backend: Backend, hedge_after: float | None) -> None:
    """Give the ``EndpointPool`` under ``backend``'s wrapping layers a ``Hedger`` (validation
    has made sure there is one, of >= 2 endpoints, when ``hedge_after`` is set).

    The embedded engine calls this for every batch it opens, so any pool's moves are counted
    in Prometheus from here too (``pool_moves.count_moves``), hedging or not."""
    from agentbatch.backends.pool_moves import count_moves

    count_moves(backend)
    if hedge_after is None:
        return
    from agentbatch.backends.pool import pool_under

    pool = pool_under(backend)
    if pool is None:
        raise TypeError(f"hedge_after needs a pool of endpoints, not {backend.name}")
    pool.hedger = Hedger(hedge_after)


def check_hedge_after(value: Any, backend: Any, *, pricing: str) -> None:
    """``hedge_after`` at submit: a finite number > 1, and only where it can apply (a pool of
    >= 2 endpoints, hostfiles expanded, with sync turns to hedge), on either engine (a worker
    hedges the turns it runs: ``distributed/workers/hedging.py``). Raises ``BatchSpecError``
    naming it."""
    if value is None:
        return
    from agentbatch.backends.setup import expand_backend_urls
    from agentbatch.core.errors import BatchSpecError

    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value <= 1):
        raise BatchSpecError(f"hedge_after must be a finite number > 1 (a multiple of the p95 "
                             f"turn latency) or None, got {value!r}")
    urls = expand_backend_urls([backend] if isinstance(backend, str) else list(backend))
    if len(urls) < 2:
        raise BatchSpecError(
            f"hedge_after cannot apply to backend {urls[0]!r}: it sends a slow turn again to "
            "another endpoint of a pool, so it needs a list of >= 2 endpoints "
            "(backend=[url1, url2, ...])")
    if pricing == "batch":
        raise BatchSpecError('hedge_after cannot apply with pricing="batch": no turn goes to '
                             "the pool's sync API (provider batch turns are hedged by "
                             'pricing="auto")')
