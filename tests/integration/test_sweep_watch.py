"""The fleet-wide deadline zset: a sweep pass reads only the agents due, keeps the deadlines
of a batch still being submitted, and drops those of a batch whose keys are gone."""

from __future__ import annotations

import asyncio

import redis

from agentbatch.state.keys import WATCH, BatchKeys
from agentbatch.workers.context import WorkerContext
from agentbatch.workers.settings import WorkerSettings
from agentbatch.workers.sweep import sweep_once


def test_sweep_keeps_a_staging_batchs_deadlines_and_drops_a_gone_batchs(redis_url: str) -> None:
    r = redis.from_url(redis_url, decode_responses=True)
    staging, gone = BatchKeys("staging"), BatchKeys("gone")
    r.hset(staging.state, mapping={0: "0:{}", 1: "0:{}"})  # staged agents, no plan yet
    r.zadd(WATCH, {staging.member(0): 0, staging.member(1): 0, gone.member(0): 0,
                   gone.member(1): 0})
    ctx = WorkerContext(WorkerSettings(redis_url=redis_url))

    async def sweep() -> int:
        try:
            return await sweep_once(ctx)
        finally:
            await ctx.redis.aclose()

    assert asyncio.run(sweep()) == 0
    now_ms = int(r.time()[0]) * 1000
    scores = dict(r.zrange(WATCH, 0, -1, withscores=True))
    assert set(scores) == {staging.member(0), staging.member(1)}  # the gone batch's dropped
    assert all(score > now_ms for score in scores.values())  # looked at again later
