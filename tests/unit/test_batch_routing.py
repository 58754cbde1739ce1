"""batch_routing.Router, the routing and hedge time both engines share: the decisions given
what it has observed (no I/O, no sleeps)."""

from __future__ import annotations

import time

from agentbatch.turnloop.batch_routing import PRIOR_SYNC_S, SAFETY_S, Router


def test_no_deadline_hedge_while_the_sync_probe_is_out() -> None:
    # On the 5 s prior, 50 turns waiting behind each other put the hedge time far in the
    # past: a worker claiming turns as its probe left hedged every one of them.
    router = Router("auto", time.monotonic() + 100.0, total=100)
    assert router.route(3, 100) == "sync"  # the probe
    assert router.stats["routed_sync_probe"] == 1
    assert router.hedge_at(time.monotonic(), 3, None, waiting=50) is None
    with router.timed_sync(routed=True):
        pass  # the probe answered
    at = router.hedge_at(time.monotonic(), 3, None, waiting=50)
    assert at is not None and at > time.monotonic()  # measured: the deadline is far


def test_a_failed_probe_does_not_stop_deadline_hedging() -> None:
    router = Router("auto", time.monotonic() + 100.0, total=100)
    assert router.route(3, 100) == "sync"
    try:
        with router.timed_sync(routed=True):
            raise ConnectionError("the probe failed")
    except ConnectionError:
        pass
    assert not router.sync_latency.samples
    assert router.hedge_at(time.monotonic(), 3, None, waiting=0) is not None


def test_batch_mode_has_no_probe_and_hedges_on_the_prior() -> None:
    deadline = time.monotonic() + 30.0
    router = Router("batch", deadline, total=10)
    assert router.route(3, 10) == "batch"
    at = router.hedge_at(time.monotonic(), 1, None, waiting=0)
    assert at is not None
    assert at <= deadline - PRIOR_SYNC_S - SAFETY_S + 1e-6


def test_an_unsent_routed_turn_leaves_the_sync_backlog() -> None:
    router = Router("auto", time.monotonic() + 100.0, total=100)
    router.route(3, 100)  # the probe joins the backlog
    assert router.sync_path.backlog == 1
    router.unroute()  # refused before its request
    assert router.sync_path.backlog == 0 and router.routed_sync == 0


def test_an_unsent_probe_is_sent_again_by_the_next_turn() -> None:
    router = Router("auto", time.monotonic() + 100.0, total=100)
    assert router.route(3, 100) == "sync"
    router.unroute()  # e.g. the turn was in a provider batch already (a re-sent turn)
    assert router.route(3, 100) == "sync"
    assert router.stats["routed_sync_probe"] == 2
