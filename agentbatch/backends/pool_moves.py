"""A pool's moves counted where they happen: Prometheus, and whoever else listens.

``EndpointPool`` counts a turn routed off its agent's home endpoint (``moves()``: ``load`` /
``failover``) in a counter of its own, read only when asked (``handle.stats()["pool"]``).
An operator's metrics, and a distributed batch's stats, need each move as it happens, in the
task that routed the turn (the distributed engine tells whose turn it is by a context
variable: ``distributed/workers/hedging.py``). The pool offers no callback, so its counter
is replaced by one that calls ``on_move(reason, n)`` at each increment; it counts exactly
as before, so ``moves()`` is unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from agentbatch.backends.base import Backend, BackendWrapper
from agentbatch.metrics import pool_moves_enabled, record_pool_move

OnMove = Callable[[str, int], None]  # (reason, n)


class _MoveCounter(Counter[str]):
    """The pool's move counter, calling its listeners on each increment."""

    def __init__(self, counts: Counter[str], listeners: list[OnMove]) -> None:
        super().__init__(counts)
        self.listeners = listeners

    def __setitem__(self, key: str, value: Any) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if isinstance(delta, int) and delta > 0:
            for listener in self.listeners:
                listener(key, delta)


def _record(reason: str, n: int) -> None:
    record_pool_move(reason, n)


def count_moves(backend: Backend, on_move: OnMove | None = None) -> bool:
    """Count each move of the ``EndpointPool`` under ``backend``'s wrapping layers in
    ``agentbatch_pool_moves_total`` (once per pool, however often called) and, if given, call
    ``on_move`` too. False (nothing done) when there is no pool under it."""
    from agentbatch.backends.pool import EndpointPool

    while isinstance(backend, BackendWrapper):
        backend = backend.inner
    if not isinstance(backend, EndpointPool):
        return False
    moves = backend._moves
    if not isinstance(moves, _MoveCounter):
        moves = backend._moves = _MoveCounter(moves, [_record])
        pool_moves_enabled()
    if on_move is not None and on_move not in moves.listeners:
        moves.listeners.append(on_move)
    return True
