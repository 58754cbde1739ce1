"""``hedge_after=`` on the distributed engine: each worker process hedges the turns it runs.

A worker opens one pool per (backend URLs, ``hedge_after``) and shares it among the batches
that name them, so its ``Hedger`` (``backends/hedge.py``) keeps one latency window per
server whichever batch asked: the bar is this process's view of the typical endpoint's p95,
known once this process has had 20 answers from one endpoint. The race happens inside the
pool's ``complete``, so the turn machine sees one reply; the versioned commit keeps one
result per turn whatever else a re-sent task did.

The counters a process's ``Hedger`` keeps mix batches and are not visible outside it. So each
batch's runtime gets its pool through ``BatchTagged``, which says whose turn a model call is
(a context variable, read where the count happens: the race and the routing run in the
caller's task, and the hedge's task inherits the variable), and ``BatchHedger`` counts each
settled hedge on that batch: ``stat:hedges`` and one of ``stat:hedge_wins`` (the hedge
answered first), ``stat:hedge_original_wins``, ``stat:hedge_both_failed``, and the losing
request's tokens, ``stat:hedge_loser_prompt_tokens`` and ``stat:hedge_loser_completion_tokens``
(as on the embedded engine: exact when both answered, else the loser's prompt). Those tokens
are paid as well: the race hands them to the turn with its winning reply
(``ModelResponse.hedge_usage``), so the agent's ``cost_usd`` counts them, and the winning
turn's commit adds their cost to the batch's ``spend`` in Redis in the same atomic step as
the compare-and-set (``core/budget.turn_spend``), as for any reply: the caps see them. Every
``BatchTagged`` pool's moves are counted the same way (``count_batch_moves``):
``stat:pool_moves_load`` and ``stat:pool_moves_failover``. They reach the batch's ``meta`` in
the worker's next stats flush (``batch_stats.py``: half a second at most, one round trip for
all batches, never one per turn), add up over the fleet, and show in ``handle.status()`` and
``agentbatch status``; a worker's Prometheus endpoint counts them as they happen
(``agentbatch_hedges_total``, ``agentbatch_hedge_outcomes_total``,
``agentbatch_hedge_loser_tokens_total``, ``agentbatch_pool_moves_total``). A hedge whose turn
was cancelled (the turn's timeout, the batch cancelled) before either answer is counted
there as sent, and on no batch.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

from agentbatch.backends.base import Backend, BackendWrapper
from agentbatch.backends.hedge import Hedger
from agentbatch.backends.pool import pool_under
from agentbatch.backends.pool_moves import count_moves
from agentbatch.core.model_io import ModelRequest, ModelResponse

Count = Callable[[str, str, int], None]  # (batch id, stat field, n): ``BatchStats.add``

_batch: ContextVar[str | None] = ContextVar("agentbatch_hedged_batch", default=None)
# a settled hedge's outcome -> its batch stat (the names hedging has always counted under)
_OUTCOME_STATS = {"hedge_won": "hedge_wins", "original_won": "hedge_original_wins",
                  "both_failed": "hedge_both_failed"}


class BatchHedger(Hedger):
    """A ``Hedger`` that also counts each settled hedge on the batch whose turn it raced."""

    def __init__(self, hedge_after: float, count: Count) -> None:
        super().__init__(hedge_after)
        self._count = count

    def _settled(self, outcome: str) -> None:
        super()._settled(outcome)
        batch_id = _batch.get()
        if batch_id is not None:
            self._count(batch_id, "hedges", 1)
            self._count(batch_id, _OUTCOME_STATS[outcome], 1)

    def _count_loser(self, prompt_tokens: int, completion_tokens: int) -> None:
        super()._count_loser(prompt_tokens, completion_tokens)
        batch_id = _batch.get()
        if batch_id is not None:
            self._count(batch_id, "hedge_loser_prompt_tokens", prompt_tokens)
            self._count(batch_id, "hedge_loser_completion_tokens", completion_tokens)


class BatchTagged(BackendWrapper):
    """A shared pool as one batch's runtime sees it: each model call says whose turn it is,
    for ``BatchHedger``'s and the moves' counters. Everything else is the pool's."""

    def __init__(self, inner: Backend, batch_id: str) -> None:
        super().__init__(inner)
        self.batch_id = batch_id

    async def complete(self, request: ModelRequest) -> ModelResponse:
        token = _batch.set(self.batch_id)
        try:
            return await self._inner.complete(request)
        finally:
            _batch.reset(token)


def enable_batch_hedging(backend: Backend, hedge_after: float, count: Count) -> None:
    """Give the ``EndpointPool`` under ``backend``'s wrapping layers a ``BatchHedger``
    (submit has checked it is a pool of >= 2 endpoints, as on the embedded engine)."""
    pool = pool_under(backend)
    if pool is None:
        raise TypeError(f"hedge_after needs a pool of endpoints, not {backend.name}")
    pool.hedger = BatchHedger(hedge_after, count)


def count_batch_moves(backend: Backend, count: Count) -> bool:
    """Count the moves of the ``EndpointPool`` under ``backend`` in Prometheus and on the
    batch whose turn each was (``stat:pool_moves_<reason>``); False without a pool."""

    def on_move(reason: str, n: int) -> None:
        batch_id = _batch.get()
        if batch_id is not None:
            count(batch_id, f"pool_moves_{reason}", n)

    return count_moves(backend, on_move)
