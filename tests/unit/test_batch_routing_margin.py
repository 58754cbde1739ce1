"""The margin a ``Router`` keeps free before the deadline (``safety``): in units of the sync
latency it observed, not a constant. The 2 s constant (``SAFETY_S``, now only the prior) sent
turns that fitted to the sync API at the sync price when sync turns take a tenth of a second
(bench_cost's scaled deadline), and would keep nothing to speak of where they take 30 s.
Decisions given what the router observed: no I/O, no sleeps, a fixed router clock."""

from __future__ import annotations

import pytest

from agentbatch.turnloop.batch_routing import (
    SAFETY_MIN_S,
    SAFETY_MULT,
    SAFETY_S,
    WINDOW_S,
    Router,
)

NOW = 1000.0


def _auto(deadline: float, sync_s: float | None) -> Router:
    """An ``"auto"`` router whose provider batches took 5..14 s (median 9 s) and whose sync
    turns took ``sync_s`` (None: none answered yet)."""
    router = Router("auto", deadline, total=100, clock=lambda: NOW, concurrency=8)
    if sync_s is not None:
        for _ in range(5):
            router.sync_latency.add(sync_s)
    for seconds in range(5, 15):
        router.batch_latency.add(float(seconds), 8)
    # one provider batch size (8 turns), so no turn is sent in a small batch to learn the
    # latency of another (test_batch_routing_sizes.py)
    router.min_items = router.max_items
    return router


@pytest.mark.parametrize(("sync_s", "margin"), [
    (None, SAFETY_S),  # nothing seen: the prior
    (0.05, SAFETY_MIN_S),  # fast sync turns: the floor
    (30.0, SAFETY_MULT * 30.0),  # slow ones: a margin that means something to them
])
def test_the_margin_follows_the_observed_sync_latency(sync_s: float | None,
                                                      margin: float) -> None:
    assert _auto(NOW + 100.0, sync_s).safety() == pytest.approx(margin)


def test_a_last_turn_that_fits_with_the_measured_margin_goes_to_the_batch() -> None:
    # a 9 s median batch turn leaves 1.5 s before the deadline: more than the measured
    # margin (its 1 s floor for 0.05 s sync turns), less than the old constant 2 s, which
    # sent it to sync
    deadline = NOW + 9.0 + WINDOW_S + 1.5
    router = _auto(deadline, 0.05)
    assert router.route(1, 100) == "batch"
    assert router.stats["routed_sync_deadline"] == 0
    # the same turn before any sync latency is known keeps the prior 2 s: sync
    unknown = _auto(deadline, None)
    unknown._probed = True  # its probe is out (the first routed turn would be the probe)
    assert unknown.route(1, 100) == "sync"


def test_slow_sync_turns_keep_a_larger_margin() -> None:
    # 5 s sync turns: the margin is 20 s, so a last turn that fits the 9 s batch median with
    # 15 s to spare goes to the sync API (5 s); the old constant 2 s kept it in the batch
    router = _auto(NOW + 9.0 + WINDOW_S + 15.0, 5.0)
    assert router.safety() == pytest.approx(20.0)
    assert router.route(1, 100) == "sync"


def test_a_failed_item_may_go_to_the_sync_api_until_the_margin() -> None:
    router = Router("batch", NOW + 1.5, total=10, clock=lambda: NOW)
    assert not router.allows_sync()  # the 2 s prior
    for _ in range(5):
        router.sync_latency.add(0.05)
    assert router.allows_sync()  # a 1 s margin, 1.5 s left
