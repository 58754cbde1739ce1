"""Queue depths and agents by state, read from Redis when a worker's ``/metrics`` is scraped:
one pipelined round trip, bounded whatever the fleet's size."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from agentbatch.distributed.state.connection import sync_client
from agentbatch.distributed.state.keys import ACTIVE_BATCHES, BatchKeys
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS, TOOLS_QUEUE
from agentbatch.metrics.collectors import STATES, gauge_families, int_or_zero, queue_lists

log = logging.getLogger(__name__)

# Batches read per scrape (``ab:batches``, the live ones): one HMGET each, so a scrape costs
# at most this many commands in one pipeline, whatever the fleet holds.
MAX_BATCHES = 200
META_FIELDS = ["total", "delivered", *(f"n:{s}" for s in STATES if s != "needs_model")]


class RedisGauges:
    """``agentbatch_queue_depth`` and ``agentbatch_agents`` from Redis, in one pipeline."""

    def __init__(self, redis_url: str) -> None:
        self.client = sync_client(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.lists = [(q, p, name) for q in (INFERENCE_QUEUE, TOOLS_QUEUE)
                      for p, name in queue_lists(q, PRIORITY_STEPS)]

    def collect(self) -> Iterator[Any]:
        queue, agents = gauge_families()
        try:
            batch_ids = self.client.srandmember(ACTIVE_BATCHES, MAX_BATCHES) or []
            pipe = self.client.pipeline(transaction=False)
            for _q, _p, name in self.lists:
                pipe.llen(name)
            for batch_id in batch_ids:
                bid = batch_id.decode() if isinstance(batch_id, bytes) else str(batch_id)
                pipe.hmget(BatchKeys(bid).meta, META_FIELDS)
            replies = pipe.execute()
        except Exception as exc:  # Redis away: the scrape still answers, without these
            log.warning("metrics: could not read queue depths from Redis: %s", exc)
            return
        for (q, p, _name), depth in zip(self.lists, replies, strict=False):
            queue.add_metric([q, p], int_or_zero(depth))
        counts = dict.fromkeys(STATES, 0)
        for meta in replies[len(self.lists):]:
            values = dict(zip(META_FIELDS, (int_or_zero(v) for v in meta), strict=True))
            live = values["total"] - values["delivered"]
            counts["needs_model"] += max(live - values["n:awaiting_tools"], 0)
            for s in STATES:
                if s != "needs_model":
                    counts[s] += values[f"n:{s}"]
        for state, n in counts.items():
            agents.add_metric([state], n)
        yield queue
        yield agents
