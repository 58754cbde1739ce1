"""The embedded engine's ``/metrics``: the workers' names, its gauges read from this
process's running batches."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from agentbatch.metrics.collectors import STATES, gauge_families
from agentbatch.metrics.server import HOST_ENV, serve


class EmbeddedGauges:
    """The same names from this process's running embedded batches."""

    def collect(self) -> Iterator[Any]:
        from agentbatch.embedded.handle import _live

        queue, agents = gauge_families()
        counts = dict.fromkeys(STATES, 0)
        waiting = 0
        for handle in list(_live):
            engine = handle.engine
            if engine is None or handle.buffer.finished:
                continue
            for state, n in engine.counts().items():
                counts[state] = counts.get(state, 0) + n
            waiting += engine.slots.waiting  # turns queued for an inference slot
        queue.add_metric(["inference", "0"], waiting)
        queue.add_metric(["tools", "0"], 0)  # tool calls start at once: no queue
        for state, n in counts.items():
            agents.add_metric([state], n)
        yield queue
        yield agents


def serve_embedded(port: int) -> Any:
    """The embedded engine's ``/metrics``: the same names as a worker's, its gauges read from
    this process's running batches. One server per process and port, kept for the process's
    life (counters keep counting across batches, as Prometheus expects)."""
    host = os.environ.get(HOST_ENV) or "127.0.0.1"
    return serve(port, host, [EmbeddedGauges()])
