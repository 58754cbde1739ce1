"""A worker's background batch counters (``distributed/workers/batch_stats.py``) on a real
redis-server: many counts, one round trip; a gone batch is not brought back; a failed
flush keeps its counts. Commands are counted with MONITOR, never timed."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.workers.batch_stats import BatchStats
from agentbatch.sim.process import free_port
from tests.support.redis_monitor import MonitorRecorder

pytestmark = [pytest.mark.redis]

ADDS = 50


def test_many_counts_reach_meta_in_one_transaction_of_one_note_per_field(
        redis_url: str) -> None:
    live, gone = BatchKeys("live"), BatchKeys("gone")

    async def scenario() -> dict[str, str]:
        client = async_client(redis_url)
        stats = BatchStats(client, Scripts(client), flush_s=3600)  # flushed by hand here
        await client.hset(live.meta, "total", 1)
        for _ in range(ADDS):  # what 50 hedged turns and 50 moves would add
            stats.add("live", "pool_moves_load")
            stats.add("live", "hedges")
            stats.add("gone", "hedges")
        stats.add("live", "hedge_loser_prompt_tokens", 120)
        stats.add("live", "hedge_loser_completion_tokens", 0)  # nothing to write
        with MonitorRecorder(redis_url) as seen:
            await stats.flush()
        assert stats.pending() == {}
        evalsha = [c for c in seen.commands if c and c[0].upper() == b"EVALSHA"]
        assert len(evalsha) == 4, evalsha  # one per (batch, field), not one per count
        names = [c[0].upper() for c in seen.commands]
        assert names.count(b"MULTI") == 1 and names.count(b"EXEC") == 1, names
        assert await client.exists(gone.meta) == 0  # a batch gone is not brought back
        meta = {str(k): str(v) for k, v in (await client.hgetall(live.meta)).items()}
        if stats._task is not None:
            stats._task.cancel()
        await client.aclose()
        return meta

    meta = asyncio.run(scenario())
    assert meta["stat:pool_moves_load"] == str(ADDS)
    assert meta["stat:hedges"] == str(ADDS)
    assert meta["stat:hedge_loser_prompt_tokens"] == "120"
    assert "stat:hedge_loser_completion_tokens" not in meta


def test_counts_are_flushed_in_the_background_and_kept_when_redis_is_away(
        redis_url: str) -> None:
    live = BatchKeys("live")

    async def scenario() -> None:
        down = aioredis.Redis(port=free_port(), socket_connect_timeout=1)
        away = BatchStats(down, Scripts(down), flush_s=3600)
        away.add("live", "hedges", 3)
        await away.flush()  # nobody listens: the counts wait for the next flush
        assert away.pending() == {"live": {"hedges": 3}}
        if away._task is not None:
            away._task.cancel()
        await down.aclose()

        client = async_client(redis_url)
        await client.hset(live.meta, "total", 1)
        stats = BatchStats(client, Scripts(client), flush_s=0.05)
        stats.add("live", "pool_moves_failover", 2)
        deadline = time.monotonic() + 30
        while str(await client.hget(live.meta, "stat:pool_moves_failover")) != "2":
            assert time.monotonic() < deadline, "the background flush never wrote"
            await asyncio.sleep(0.05)
        await client.aclose()

    asyncio.run(scenario())
