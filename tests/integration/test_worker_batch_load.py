"""A worker loads a batch once, however many of its task threads ask for it at the same time.

A fresh worker's first tasks of a batch all arrive together (one per task thread). Each used
to read the plan, import its tools and open its backend on its own connection, and on a
loaded machine the tasks arriving while those loads ran loaded it again (0.46 plan GETs per
task at 1,000 agents)."""

from __future__ import annotations

import asyncio

import redis

from agentbatch import submit_batch
from agentbatch.distributed.workers.context import LoadedBatch, WorkerContext
from agentbatch.distributed.workers.settings import WorkerSettings
from tests.support.tools import Answer, lookup

ASKERS = 16  # the task threads of one worker (bench_distributed's --concurrency)


def _load_together(redis_url: str, batch_id: str) -> list[LoadedBatch | None]:
    ctx = WorkerContext(WorkerSettings(redis_url=redis_url, worker_imports=("tests.support",)))

    async def load() -> list[LoadedBatch | None]:
        try:
            return list(await asyncio.gather(*(ctx.batch(batch_id) for _ in range(ASKERS))))
        finally:
            await ctx.redis.aclose()

    return asyncio.run(load())


def test_tasks_asking_for_a_batch_while_it_loads_share_one_load(redis_url: str,
                                                                 sim_url: str) -> None:
    r = redis.from_url(redis_url, decode_responses=True)
    handle = submit_batch("Agent {i}.", [{"i": i} for i in range(2)], model="sim-model",
                          tools=[lookup], output_schema=Answer, backend=sim_url,
                          redis_url=redis_url)
    r.config_resetstat()
    loaded = _load_together(redis_url, handle.batch_id)
    plan_reads = r.info("commandstats").get("cmdstat_get", {}).get("calls", 0)
    assert all(b is not None and b.runtime is not None for b in loaded), loaded
    assert len({id(b) for b in loaded}) == 1  # one LoadedBatch: one tool pool, one backend
    assert plan_reads == 1, plan_reads


def test_a_batch_that_is_not_there_is_none_for_every_asker(redis_url: str) -> None:
    assert _load_together(redis_url, "no-such-batch") == [None] * ASKERS
