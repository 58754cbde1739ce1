"""The fleet-wide deadline zset: a sweep pass reads only the agents due, keeps the deadlines
of a batch still being submitted, drops those of a batch whose keys are gone, and parks the
agents only queued in commands that do not grow with them."""

from __future__ import annotations

import asyncio

import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import WATCH, BatchKeys, parked_key
from agentbatch.distributed.workers.context import WorkerContext
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.distributed.workers.sweep import LISTS, sweep_once
from tests.support.tools import Answer


def _sweep(redis_url: str) -> int:
    """One sweep pass by a worker context of its own; how many tasks it re-sent."""
    ctx = WorkerContext(WorkerSettings(redis_url=redis_url, worker_imports=("tests.support",)))

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


def _parking_commands(redis_url: str, sim_url: str, n: int) -> dict[str, int]:
    """Redis commands (by name, Lua's own included) of the sweep pass that finds ``n``
    agents of a batch due, never started, their messages waiting in their list."""
    r = redis.from_url(redis_url, decode_responses=True)
    r.flushdb()
    handle = submit_batch("Agent {i}.", [{"i": i} for i in range(n)], model="sim-model",
                          output_schema=Answer, backend=sim_url, redis_url=redis_url)
    keys = BatchKeys(handle.batch_id)
    r.zadd(WATCH, {keys.member(i): 0 for i in range(n)}, xx=True)  # all due now
    r.config_resetstat()
    assert _sweep(redis_url) == 0  # nothing re-sent: they are only queued
    calls = {k.removeprefix("cmdstat_"): v["calls"]
             for k, v in r.info("commandstats").items()}
    parked = sum(r.zcard(parked_key(key)) for key in LISTS)
    assert parked == n, (parked, n)
    now_ms = int(r.time()[0]) * 1000
    scores = dict(r.zrange(WATCH, 0, -1, withscores=True))
    assert len(scores) == n and all(s > now_ms for s in scores.values())  # looked at later
    assert r.hget(keys.resends, "q:0").startswith("0:")  # parked at version 0
    return {k: v for k, v in calls.items() if k not in ("config|resetstat", "info", "time")}


def test_unstarted_agents_waiting_in_their_list_are_parked_in_commands_that_do_not_grow(
        redis_url: str, sim_url: str) -> None:
    _parking_commands(redis_url, sim_url, 1)  # the scripts loaded (a first EVALSHA fails)
    few, many = _parking_commands(redis_url, sim_url, 3), _parking_commands(redis_url,
                                                                            sim_url, 60)
    # the same commands for 3 agents as for 60: batched reads and one park script, no
    # per-agent inspection (ZSCORE, EXISTS: inspect) and no re-send (RPUSH: resend.lua)
    assert few == many, (few, many)
    assert "zscore" not in many and "rpush" not in many and "exists" in many, many
