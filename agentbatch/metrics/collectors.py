"""The gauges read when Prometheus scrapes: queue depths and agents by state.

Workers read them from Redis (``distributed/queue_gauges.py``: one pipelined round trip,
bounded whatever the fleet's size); the embedded engine from its live batches in memory
(``embedded/metrics.py``). Both export these families, so one dashboard serves either engine.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.core import GaugeMetricFamily

from agentbatch.core.agent_state import AgentStatus

STATES = [s.value for s in AgentStatus]


def gauge_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    queue = GaugeMetricFamily("agentbatch_queue_depth", "Tasks waiting in a broker queue, by "
                              "queue and priority list (Redis LLEN at scrape time).",
                              labels=["queue", "priority"])
    agents = GaugeMetricFamily("agentbatch_agents", "Agents of live batches, by state.",
                               labels=["state"])
    return queue, agents


def queue_lists(queue: str, steps: list[int]) -> list[tuple[str, str]]:
    """(priority, Redis list) of one Celery queue: kombu keeps each priority step in a list
    of its own, ``queue`` for the first and ``queue + "\\x06\\x16" + step`` for the rest
    (shared CELERY_NOTES.md; the same names as k8s/keda.yaml)."""
    return [(str(s), queue if i == 0 else f"{queue}\x06\x16{s}") for i, s in enumerate(steps)]


def int_or_zero(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
