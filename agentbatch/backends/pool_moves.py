"""A pool's moves counted where they happen: Prometheus, and whoever else listens.

``EndpointPool`` counts a turn routed off its agent's home endpoint (``moves()``: ``load`` /
``failover``) and tells each of its move listeners (``add_move_listener``) as it routes the
turn. An operator's metrics, and a distributed batch's stats, need each move as it happens, in
the task that routed the turn (the distributed engine tells whose turn it is by a context
variable: ``distributed/workers/hedging.py``); ``count_moves`` adds those listeners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agentbatch.backends.base import Backend
from agentbatch.metrics import pool_moves_enabled, record_pool_move

OnMove = Callable[[str, int], None]  # (reason, n)


@dataclass(frozen=True)
class _EachMove:
    """``on_move(reason, 1)`` as a pool's move listener; equal for the same ``on_move``, so
    the pool adds it once however often it is given."""

    on_move: OnMove

    def __call__(self, reason: str) -> None:
        self.on_move(reason, 1)


def _record(reason: str) -> None:
    record_pool_move(reason, 1)


def count_moves(backend: Backend, on_move: OnMove | None = None) -> bool:
    """Count each move of the ``EndpointPool`` under ``backend``'s wrapping layers in
    ``agentbatch_pool_moves_total`` (once per pool, however often called) and, if given, call
    ``on_move`` too. False (nothing done) when there is no pool under it."""
    from agentbatch.backends.pool import pool_under

    pool = pool_under(backend)
    if pool is None:
        return False
    pool_moves_enabled()  # the counters exist at 0 from now on
    pool.add_move_listener(_record)
    if on_move is not None:
        pool.add_move_listener(_EachMove(on_move))
    return True
