"""The fleet-wide deadline zset: a sweep pass reads only the agents due, keeps the deadlines
of a batch still being submitted, and drops those of a batch whose keys are gone."""

from __future__ import annotations

import asyncio

import redis

from agentbatch.distributed.state.keys import WATCH, BatchKeys
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, TOOLS_QUEUE
from agentbatch.distributed.workers.context import WorkerContext
from agentbatch.distributed.workers.envelope import queue_key
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.distributed.workers.sweep import sweep_once


def _sweep(redis_url: str) -> int:
    """One sweep pass by a worker context of its own; how many tasks it re-sent."""
    ctx = WorkerContext(WorkerSettings(redis_url=redis_url))

    async def sweep() -> int:
        try:
            return await sweep_once(ctx)
        finally:
            await ctx.redis.aclose()

    return asyncio.run(sweep())


def test_sweep_keeps_a_staging_batchs_deadlines_and_drops_a_gone_batchs(redis_url: str) -> None:
    r = redis.from_url(redis_url, decode_responses=True)
    staging, gone = BatchKeys("staging"), BatchKeys("gone")
    r.hset(staging.state, mapping={0: "0:{}", 1: "0:{}"})  # staged agents, no plan yet
    r.zadd(WATCH, {staging.member(0): 0, staging.member(1): 0, gone.member(0): 0,
                   gone.member(1): 0})
    assert _sweep(redis_url) == 0
    now_ms = int(r.time()[0]) * 1000
    scores = dict(r.zrange(WATCH, 0, -1, withscores=True))
    assert set(scores) == {staging.member(0), staging.member(1)}  # the gone batch's dropped
    assert all(score > now_ms for score in scores.values())  # looked at again later


def test_with_both_queues_busy_unstarted_agents_are_let_wait_in_one_script_per_batch(
        redis_url: str) -> None:
    r = redis.from_url(redis_url, decode_responses=True)
    queued, gone = BatchKeys("queued2"), BatchKeys("gone2")  # gone2: no keys at all
    r.hset(queued.state, "0", "0:{}")  # its version is all the deferral reads
    r.zadd(WATCH, {queued.member(0): 0, gone.member(1): 0})  # neither marked started
    for queue in (INFERENCE_QUEUE, TOOLS_QUEUE):
        r.lpush(queue_key(queue, 9), "{}")  # messages waiting on both queues
    r.config_resetstat()
    assert _sweep(redis_url) == 0
    now_ms = int(r.time()[0]) * 1000
    scores = dict(r.zrange(WATCH, 0, -1, withscores=True))
    # the queued one was let wait without being inspected one by one, its version recorded;
    # the gone one (no state to defer) was looked at on its own and dropped with its batch
    assert set(scores) == {queued.member(0)}
    assert scores[queued.member(0)] > now_ms
    assert r.hget(queued.resends, "q:0") == "0"
    calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
    assert calls.get("cmdstat_zadd") == 1 and calls.get("cmdstat_zscore") is None, calls
