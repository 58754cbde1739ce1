"""The hedge cap of ``batch_routing.Router`` (both engines): with a deadline, the turns whose
hedge time has come race the sync API only while the sync path's outstanding work is under
its observed throughput times the time left; the rest keep waiting in their provider batch
(``hedge_capped``, once per turn). Decisions given what the router observed: no I/O, no
sleeps, a fixed router clock."""

from __future__ import annotations

import pytest

from agentbatch.turnloop import batch_routing
from agentbatch.turnloop.batch_routing import Router

NOW = 1000.0
WAITING = 20


def _router(left_s: float | None) -> Router:
    """A router whose sync path was seen answering one turn a second (1 s each, one at a
    time), ``left_s`` before its deadline; None: no deadline."""
    deadline = None if left_s is None else NOW + left_s
    router = Router("batch", deadline, total=100, clock=lambda: NOW)
    for _ in range(3):
        router.sync_latency.add(1.0)
    router.sync_path.done, router.sync_path.busy_s = 10.0, 10.0  # with the prior: 1 a second
    return router


def _due(router: Router, turns: range) -> list[int]:
    """The turns (all waiting together, submitted 10 s ago) whose hedge goes now."""
    sent = []
    for turn in turns:
        at = router.hedge_at(NOW - 10.0, 1.0, 4, waiting=WAITING - 1, turn=turn)
        if at is not None and at <= NOW:
            sent.append(turn)
    return sent


def test_due_hedges_beyond_throughput_times_time_left_keep_waiting() -> None:
    router = _router(8.5)
    assert router.hedge_cap() == 8  # 1 turn a second, 8.5 s left
    sent = _due(router, range(WAITING))
    assert sent == list(range(8))  # the hedge time came for all 20: 8 go
    assert router.stats["hedge_capped"] == WAITING - 8
    assert _due(router, range(8, WAITING)) == []  # asked again: still at the cap
    assert router.stats["hedge_capped"] == WAITING - 8  # counted once per turn
    # one hedge's request ends: the sync path has room for one more
    with router.timed_sync():
        pass
    assert _due(router, range(8, WAITING))[:1] == [8]


def test_a_hedge_decided_counts_until_its_request_starts_and_then_in_the_backlog() -> None:
    router = _router(3.5)
    assert _due(router, range(WAITING)) == [0, 1, 2]
    assert router.outstanding() == 3  # decided, not started
    with router.timed_sync():  # one starts: it moves into the sync path's backlog
        assert router.outstanding() == 3
        assert router.sync_path.backlog == 1
    assert router.outstanding() == 2


def test_a_decided_hedge_whose_request_never_starts_stops_counting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    router = _router(3.5)
    assert _due(router, range(WAITING)) == [0, 1, 2]
    monkeypatch.setattr(batch_routing, "GRANT_S", -1.0)  # their batches answered first
    assert router.outstanding() == 0
    monkeypatch.undo()
    assert _due(router, range(3, WAITING)) == [3, 4, 5]


def test_past_the_deadline_one_hedge_at_a_time_still_goes() -> None:
    router = _router(-5.0)
    assert router.hedge_cap() == 1
    assert _due(router, range(WAITING)) == [0]
    assert router.stats["hedge_capped"] == WAITING - 1


def test_without_a_deadline_the_p90_hedge_is_not_capped() -> None:
    router = _router(None)
    for _ in range(5):
        router.batch_latency.add(5.0, 4)
    assert len(_due(router, range(WAITING))) == WAITING  # 10 s waited, past the 5 s p90
    assert router.stats["hedge_capped"] == 0


def test_routed_sync_turns_fill_the_cap_too() -> None:
    router = _router(4.5)
    for _ in range(3):  # three turns routed to the sync API, their requests out
        router.sync_path.joined()
    assert _due(router, range(WAITING)) == [0]


def _open_router(age_s: float, ended_s: float = 20.0) -> Router:
    """15 s before the deadline; the sync path one turn a second; ten ended provider
    batches, each took ``ended_s``; five open batches of 4 turns, ``age_s`` old."""
    opened = [(age_s, 4)] * 5
    router = Router("batch", NOW + 15.0, total=100, clock=lambda: NOW, running=lambda: opened)
    for _ in range(3):
        router.sync_latency.add(1.0)
    router.sync_path.done, router.sync_path.busy_s = 10.0, 10.0
    for _ in range(10):
        router.batch_latency.add(ended_s, 4)
    return router


def test_turns_on_course_do_not_pull_a_hedge_early() -> None:
    """20 turns wait in batches 1 s old, and every batch seen took 20 s: by the latest hedge
    time (12 s from now) none will have ended, so all 20 are counted as joining the hedge.
    With the batches seen ending at 5 s, they will all have ended: none joins, and the
    hedge is not pulled early by them."""
    router = _open_router(1.0)
    assert router.late_turns(12.0) == 20
    at = router.hedge_at(NOW - 1.0, 1.0, 4, waiting=WAITING - 1, turn="a")
    assert at is not None and at <= NOW  # 20 turns of 1 s sync work, 15 s left
    quick = _open_router(1.0, ended_s=5.0)
    assert quick.late_turns(12.0) == 0
    at = quick.hedge_at(NOW - 1.0, 1.0, 4, waiting=WAITING - 1, turn="a")
    # its own sync turn (1 s) and the margin (4 x the 1 s p99) before the deadline only
    assert at is not None and at > NOW + 9.0


def test_late_turns_weighs_each_open_batch_by_its_chance_to_still_be_open() -> None:
    """Ended batches took 2, 4, 6, 8 s, and the two open ones are censored at 3 and 7 s
    (Kaplan-Meier: S = 5/6 from 2 s, 5/8 from 4 s, 5/12 from 6 s, 0 from 8 s). The batch 3 s
    old is still open 2 s later with chance S(5)/S(3) = 0.75; the one 7 s old has ended by
    9 s for sure (S(9) = 0)."""
    router = Router("batch", NOW + 15.0, total=100, clock=lambda: NOW,
                    running=lambda: [(3.0, 3), (7.0, 4)])
    for t in (2.0, 4.0, 6.0, 8.0):
        router.batch_latency.add(t, 4)
    assert router.late_turns(0.0) == 7
    assert router.late_turns(2.0) == 3  # ceil(3 x 0.75 + 4 x 0)
    assert router.late_turns(10.0) == 0


def test_late_turns_is_unknown_without_open_batches_and_all_before_any_ended() -> None:
    router = Router("batch", NOW + 15.0, total=100, clock=lambda: NOW)
    assert router.late_turns(5.0) is None
    router = Router("batch", NOW + 15.0, total=100, clock=lambda: NOW,
                    running=lambda: [(1.0, 4), (2.0, 3)])
    assert router.late_turns(5.0) == 7
