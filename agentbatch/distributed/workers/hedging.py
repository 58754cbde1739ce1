"""``hedge_after=`` on the distributed engine: each worker process hedges the turns it runs.

A worker opens one pool per (backend URLs, ``hedge_after``) and shares it among the batches
that name them, so its ``Hedger`` (``backends/hedge.py``) keeps one latency window per
server whichever batch asked: the bar is this process's view of the typical endpoint's p95,
known once this process has had 20 answers from one endpoint. The race happens inside the
pool's ``complete``, so the turn machine sees one reply; the versioned commit keeps one
result per turn whatever else a re-sent task did.

The counters a process's ``Hedger`` keeps mix batches and are not visible outside it. So each
batch's runtime gets the pool through ``BatchTagged``, which says whose turn a model call is
(a context variable, read in the race: the race runs in the caller's task), and
``BatchHedger`` counts each settled hedge on that batch's ``meta`` through the worker's
``note``: ``stat:hedges`` and one of ``stat:hedge_wins`` (the hedge answered first),
``stat:hedge_original_wins``, ``stat:hedge_both_failed``. They add up over the fleet and show
in ``handle.status()`` and ``agentbatch status``, and in the worker's
``agentbatch_events_total`` metric. A hedge whose turn was cancelled (the turn's timeout, the
batch cancelled) before either answer is not counted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from agentbatch.backends.base import Backend, BackendWrapper
from agentbatch.backends.hedge import Attempt, Hedger
from agentbatch.backends.pool import EndpointPool
from agentbatch.core.errors import BackendError
from agentbatch.core.model_io import ModelRequest, ModelResponse

Note = Callable[[str, str], Awaitable[None]]  # (batch id, event): ``WorkerContext.note``

_batch: ContextVar[str | None] = ContextVar("agentbatch_hedged_batch", default=None)


class BatchHedger(Hedger):
    """A ``Hedger`` that counts each settled hedge on the batch whose turn it raced."""

    def __init__(self, hedge_after: float, note: Note) -> None:
        super().__init__(hedge_after)
        self._note = note

    async def race(self, first: Attempt,
                   second: Callable[[float], Attempt | None]) -> ModelResponse:
        batch_id = _batch.get()
        sent = False
        hedge_answers: list[ModelResponse] = []

        def hedge_to(bar: float) -> Attempt | None:
            nonlocal sent
            target = second(bar)
            if target is None:
                return None
            sent = True

            async def send() -> ModelResponse:
                reply = await target.send()
                hedge_answers.append(reply)
                return reply

            return Attempt(target.endpoint, send)

        outcome: str | None = None
        try:
            reply = await super().race(first, hedge_to)
            won = bool(hedge_answers) and reply is hedge_answers[0]
            outcome = "hedge_wins" if won else "hedge_original_wins"
            return reply
        except BackendError:  # with a hedge sent, raised only once both have failed
            outcome = "hedge_both_failed"
            raise
        finally:
            if sent and outcome is not None and batch_id is not None:
                await self._note(batch_id, "hedges")
                await self._note(batch_id, outcome)


class BatchTagged(BackendWrapper):
    """A shared hedging pool as one batch's runtime sees it: each model call says whose turn
    it is, for ``BatchHedger``'s counters. Everything else is the pool's."""

    def __init__(self, inner: Backend, batch_id: str) -> None:
        super().__init__(inner)
        self.batch_id = batch_id

    async def complete(self, request: ModelRequest) -> ModelResponse:
        token = _batch.set(self.batch_id)
        try:
            return await self._inner.complete(request)
        finally:
            _batch.reset(token)


def enable_batch_hedging(backend: Backend, hedge_after: float, note: Note) -> None:
    """Give the ``EndpointPool`` under ``backend``'s wrapping layers a ``BatchHedger``
    (submit has checked it is a pool of >= 2 endpoints, as on the embedded engine)."""
    inner = backend
    while isinstance(inner, BackendWrapper):
        inner = inner.inner
    if not isinstance(inner, EndpointPool):
        raise TypeError(f"hedge_after needs a pool of endpoints, not {inner.name}")
    inner.hedger = BatchHedger(hedge_after, note)
