"""What a ``Router`` has observed, set up the same way wherever a test needs it."""

from __future__ import annotations

from agentbatch.turnloop.batch_routing import Router


def seen_sizes(router: Router, small: int) -> None:
    """Sync turns took 0.05 s (a 1 s margin); provider batches of 8 turns 8..10 s (20 seen)
    and, ``small`` of each, 4 turns 6.5..7 s, 2 turns 5..5.5 s and 1 turn 3..4 s."""
    for _ in range(5):
        router.sync_latency.add(0.05)
    for i in range(20):
        router.batch_latency.add(8.0 + i / 10, 8)
    for size, fastest, spread in ((4, 6.5, 0.5), (2, 5.0, 0.5), (1, 3.0, 1.0)):
        for i in range(small):
            router.batch_latency.add(fastest + spread * i / small, size)
