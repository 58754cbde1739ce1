"""Three simulator processes for the hedging tests: two fast, one slow (the last)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from agentbatch.sim import SimConfig
from agentbatch.sim.process import SimProcess, free_port

FAST_MS = 5.0
SLOW_MS = 3000.0  # orders of magnitude past the fast servers' p95, however loaded the box


@contextmanager
def slow_pool() -> Iterator[tuple[list[SimProcess], SimProcess]]:
    """The three processes, started, and the slow one; all stopped on exit."""
    procs = [SimProcess(SimConfig(fixed_ms=FAST_MS, port=free_port())) for _ in range(2)]
    procs.append(SimProcess(SimConfig(fixed_ms=SLOW_MS, port=free_port())))
    try:
        for p in procs:
            p.start()
        yield procs, procs[-1]
    finally:
        for p in procs:
            p.stop()
