"""``batch_routing.Router`` near a short deadline (both engines): where an agent's last turn
goes (``route_q``, the break-even chance of the batch answering before the turn's hedge:
the batch price over the sync price, ``ROUTE_Q`` without a price table),
and that the hedges due inside the last margin (``Router.safety``) still go. Decisions
given what the router observed: no I/O, no sleeps, a fixed router clock."""

from __future__ import annotations

from agentbatch.turnloop.batch_routing import (
    ROUTE_Q,
    ROUTE_Q_RANGE,
    SAFETY_MIN_S,
    WINDOW_S,
    Router,
    route_q_for,
)

NOW = 1000.0
PRICES = {"m": {"prompt": 1.0, "completion": 2.0, "batch_prompt": 0.5, "batch_completion": 1.0}}


def _auto(deadline: float, route_q: float = ROUTE_Q) -> Router:
    """An ``"auto"`` router whose probe has answered (sync turns 0.1 s), having seen ten
    provider batches of 8 turns take 5, 6, ..., 14 s: median 9 s, p90 13 s."""
    router = Router("auto", deadline, total=100, clock=lambda: NOW, concurrency=8,
                    route_q=route_q)
    for _ in range(3):
        router.sync_latency.add(0.1)
    for seconds in range(5, 15):
        router.batch_latency.add(float(seconds), 8)
    # one provider batch size (8 turns), so no turn is sent in a small batch to learn the
    # latency of another (test_batch_routing_sizes.py)
    router.min_items = router.max_items
    return router


def test_a_last_turn_that_fits_at_the_batch_median_goes_to_the_batch() -> None:
    # fits at the median (9 s), not at the p90 (13 s): the batch, at half price, pays
    router = _auto(NOW + 9.0 + WINDOW_S + SAFETY_MIN_S + 1.0)
    assert router.route(1, 100) == "batch"
    assert router.stats["routed_batch"] == 1 and router.stats["routed_sync_deadline"] == 0


def test_a_last_turn_that_misses_at_the_batch_median_goes_to_the_sync_api() -> None:
    router = _auto(NOW + 9.0 + WINDOW_S + SAFETY_MIN_S - 1.0)
    assert router.route(1, 100) == "sync"
    assert router.stats["routed_sync_deadline"] == 1


def test_due_hedges_inside_the_safety_margin_are_not_refused() -> None:
    """1.5 s before the deadline (inside the 2 s prior margin), on a sync path seen answering ten
    turns a second: the twelve turns due go (15 fit before the deadline), none left to
    wait on a provider batch that answers past it."""
    router = Router("batch", NOW + 1.5, total=100, clock=lambda: NOW)
    for _ in range(3):
        router.sync_latency.add(0.1)
    router.sync_path.done, router.sync_path.busy_s = 100.0, 10.0
    assert router.hedge_cap() == 15
    sent = []
    for turn in range(12):
        at = router.hedge_at(NOW - 10.0, 1.0, 4, waiting=11, turn=turn)
        if at is not None and at <= NOW:
            sent.append(turn)
    assert sent == list(range(12))
    assert router.stats["hedge_capped"] == 0


def test_the_quantile_is_the_batch_price_over_the_sync_price() -> None:
    # fits at the median (9 s) but not at the p80 (~12 s): at half price the batch pays, at
    # 80% of the sync price a turn must be answered in time 4 times in 5 to pay
    deadline = NOW + 10.0 + WINDOW_S + SAFETY_MIN_S
    assert _auto(deadline, route_q_for(PRICES)).route(1, 100) == "batch"
    dear = {"m": {**PRICES["m"], "batch_prompt": 0.8, "batch_completion": 1.6}}
    assert route_q_for(dear) == 0.8
    assert _auto(deadline, route_q_for(dear)).route(1, 100) == "sync"


def test_the_dearer_kind_decides_and_no_table_means_half_price() -> None:
    mixed = {"m": {**PRICES["m"], "batch_completion": 1.5}}  # completion at 75%
    assert route_q_for(mixed) == 0.75
    assert route_q_for(None) == ROUTE_Q == 0.5
    assert route_q_for({"m": {"prompt": 1.0, "completion": 2.0}}) == ROUTE_Q  # no batch_*
    free = {"m": {**PRICES["m"], "prompt": 0.0, "batch_prompt": 0.0}}
    assert route_q_for(free) == 1.0  # nothing to save on a free prompt: clamped below
    assert Router("auto", NOW + 60, total=1, route_q=1.0).route_q == ROUTE_Q_RANGE[1]
