"""``Router(concurrency=N)``: where the sync path's concurrency is known (the embedded engine's
in-flight cap), its throughput is at least N per request latency.

Without it, one sync probe answered looked like a sync path that answers one turn at a time:
each waiting batch turn's hedge time came early, and in bench_cost (1,000 agents, 3 turns, a
deadline at 2x the all-batch wall) 393 to 984 turns were hedged in five runs, each paid at the
sync price for a deadline the all-batch pass met. Decisions given what the router observed:
no I/O, no sleeps, a fixed router clock."""

from __future__ import annotations

from agentbatch.turnloop.batch_routing import Router, SyncThroughput

NOW = 1000.0
SYNC_S = 0.05


def test_a_known_concurrency_sets_the_sync_paths_throughput_floor() -> None:
    # one answered at a time, as the probe was: the prior and the probe give 20 a second
    assert SyncThroughput().rate(SYNC_S) == 2.0 / (2 * SYNC_S)
    # 64 in flight at once: at least 64 per request latency, before any burst was seen
    assert SyncThroughput(concurrency=64).rate(SYNC_S) == 64 / SYNC_S


def test_waiting_turns_are_not_hedged_early_when_the_sync_path_can_take_them() -> None:
    # 400 turns waiting in 50 open provider batches, each older than any that has ended, so
    # all are expected still waiting at the hedge (``late_turns``), 60 s before the deadline.
    # Seen one at a time, the sync path would take 400 / 20 = 20 s for them, so their hedge
    # is due 20 s early; with 64 in flight, 400 / 1280 s: due about a second before the
    # deadline (the margin aside).
    for concurrency, earliest, latest in ((1, NOW + 30.0, NOW + 40.0),
                                          (64, NOW + 57.5, NOW + 59.5)):
        router = Router("auto", NOW + 60.0, total=1000, clock=lambda: NOW,
                        running=lambda: [(5.0, 8)] * 50, concurrency=concurrency)
        for seconds in (1.0, 2.0, 3.0):
            router.batch_latency.add(seconds)
        router.sync_latency.add(SYNC_S)
        router.sync_path.done, router.sync_path.busy_s = 1.0, SYNC_S
        assert router.late_turns(50.0) == 400
        at = router.hedge_at(NOW - 5.0, 1.0, 8, waiting=400)
        assert at is not None and earliest <= at <= latest, (concurrency, at - NOW)
