"""Gauges read when Prometheus scrapes: queue depths and agents by state.

Workers read them from Redis (``RedisGauges``: one pipelined round trip, bounded whatever
the fleet's size); the embedded engine from its live batches in memory (``EmbeddedGauges``).
Both export the same names, so one dashboard serves either engine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from agentbatch.core.agent_state import AgentStatus

log = logging.getLogger(__name__)

# Batches read per scrape (``ab:batches``, the live ones): one HMGET each, so a scrape costs
# at most this many commands in one pipeline, whatever the fleet holds.
MAX_BATCHES = 200
_STATES = [s.value for s in AgentStatus]
_META_FIELDS = ["total", "delivered", *(f"n:{s}" for s in _STATES if s != "needs_model")]


def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
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


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


class RedisGauges:
    """``agentbatch_queue_depth`` and ``agentbatch_agents`` from Redis, in one pipeline."""

    def __init__(self, redis_url: str) -> None:
        from agentbatch.distributed.state.connection import sync_client
        from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS, TOOLS_QUEUE

        self.client = sync_client(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.lists = [(q, p, name) for q in (INFERENCE_QUEUE, TOOLS_QUEUE)
                      for p, name in queue_lists(q, PRIORITY_STEPS)]

    def collect(self) -> Iterator[Any]:
        from agentbatch.distributed.state.keys import ACTIVE_BATCHES, BatchKeys

        queue, agents = _families()
        try:
            batch_ids = self.client.srandmember(ACTIVE_BATCHES, MAX_BATCHES) or []
            pipe = self.client.pipeline(transaction=False)
            for _q, _p, name in self.lists:
                pipe.llen(name)
            for batch_id in batch_ids:
                bid = batch_id.decode() if isinstance(batch_id, bytes) else str(batch_id)
                pipe.hmget(BatchKeys(bid).meta, _META_FIELDS)
            replies = pipe.execute()
        except Exception as exc:  # Redis away: the scrape still answers, without these
            log.warning("metrics: could not read queue depths from Redis: %s", exc)
            return
        for (q, p, _name), depth in zip(self.lists, replies, strict=False):
            queue.add_metric([q, p], _int(depth))
        counts = dict.fromkeys(_STATES, 0)
        for meta in replies[len(self.lists):]:
            values = dict(zip(_META_FIELDS, (_int(v) for v in meta), strict=True))
            live = values["total"] - values["delivered"]
            counts["needs_model"] += max(live - values["n:awaiting_tools"], 0)
            for s in _STATES:
                if s != "needs_model":
                    counts[s] += values[f"n:{s}"]
        for state, n in counts.items():
            agents.add_metric([state], n)
        yield queue
        yield agents


class EmbeddedGauges:
    """The same names from this process's running embedded batches."""

    def collect(self) -> Iterator[Any]:
        from agentbatch.embedded.handle import _live

        queue, agents = _families()
        counts = dict.fromkeys(_STATES, 0)
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
