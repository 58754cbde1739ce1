"""The fleet semaphore and the progress deadlines on one real redis-server: Redis's clock, not
the workers', and a holder that loses its slot learns it (issue 10, item 4).

Two ``RedisSemaphore`` instances stand for two workers sharing one key; one is given a clock
31 s ahead through the class's ``clock`` argument (what a worker with a skewed wall clock did
to the scripts when they took ``now`` as an argument).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentbatch.distributed.state import redis_store
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.redis_store import BatchStore
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.semaphore import RedisSemaphore

pytestmark = [pytest.mark.redis]

SKEW_MS = 31_000


def wall_ms() -> int:
    return int(time.time() * 1000)


def skewed_ms() -> int:
    return wall_ms() + SKEW_MS


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Any]:
    r = async_client(redis_url)
    yield r
    await r.aclose()


def sem(client: Any, name: str, limit: int = 1, **kw: Any) -> RedisSemaphore:
    return RedisSemaphore(client, Scripts(client), name, limit, **kw)


async def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_a_worker_with_a_clock_31s_ahead_cannot_evict_a_live_holder(client: Any) -> None:
    a = sem(client, "skew-1", clock=wall_ms)
    b = sem(client, "skew-1", clock=skewed_ms)
    assert await a.try_acquire("a") is True
    assert await b.try_acquire("b") is False  # the live holder "a" still has the only slot
    assert await client.zrange(a.key, 0, -1) == ["a"]


async def test_skewed_workers_never_run_more_than_the_limit(client: Any) -> None:
    workers = [sem(client, "skew-2", clock=wall_ms), sem(client, "skew-2", clock=skewed_ms)]
    running = 0
    peak = 0

    async def request(s: RedisSemaphore) -> None:
        nonlocal running, peak
        async with s.slot(deadline=time.monotonic() + 30):
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.02)
            running -= 1

    await asyncio.wait_for(
        asyncio.gather(*(request(workers[i % 2]) for i in range(20))), 60)
    assert peak == 1


async def test_a_holder_deleted_mid_hold_learns_it_and_is_readmitted_when_free(
        client: Any) -> None:
    s = sem(client, "lost-1", ttl_ms=600)  # renewed every 0.2 s
    async with s.slot() as held:
        assert not held.lost.is_set()
        await client.zrem(s.key, held.holder)
        assert await wait_for(held.lost.is_set)
        assert s.lost == 1
        assert await wait_for(lambda: held.readmitted == 1)  # the slot was free again
        assert held.holder in await client.zrange(s.key, 0, -1)
    assert await client.zcard(s.key) == 0


async def test_a_lost_slot_is_not_taken_back_past_the_limit(client: Any) -> None:
    a = sem(client, "lost-2", ttl_ms=600)
    # b holds long: only a needs the short renewal cycle, and a stalled test must not see b
    # expire and a take its slot back
    b = sem(client, "lost-2", ttl_ms=60_000)
    async with a.slot() as held:
        await client.zrem(a.key, held.holder)
        assert await b.try_acquire("b") is True  # the freed slot goes to another request
        assert await wait_for(held.lost.is_set)
        for _ in range(3):
            await asyncio.sleep(0.25)  # more renewal rounds: still no room for "a"
            assert await client.zrange(a.key, 0, -1) == ["b"]
            await b.try_acquire("b")  # b's request renews its own slot
        assert held.readmitted == 0 and a.lost == 1
        await b.release("b")
        assert await wait_for(lambda: held.readmitted == 1)


async def redis_ms(client: Any) -> float:
    secs, micros = await client.time()
    return int(secs) * 1000 + int(micros) / 1000


@pytest.fixture
def skewed_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process plays a worker whose wall clock runs 31 s ahead of everyone else's."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + SKEW_MS / 1000)
    monkeypatch.setattr(redis_store, "_clock", None, raising=False)  # not synced yet


@pytest.mark.usefixtures("skewed_worker")
async def test_progress_deadlines_a_skewed_worker_writes_are_in_redis_time(client: Any) -> None:
    store = BatchStore(client, Scripts(client), "skew-lease")
    await client.hset(store.k.state, "0", "1:{}")
    await client.zadd(store.k.watch, {store.k.member(0): 0})
    assert await store.tool_running(0, 1, ttl_ms=3000) == 1
    score = await client.zscore(store.k.watch, store.k.member(0))
    assert abs(score - (await redis_ms(client) + 3000)) < 2000, score


@pytest.mark.usefixtures("skewed_worker")
async def test_a_sweeper_with_a_skewed_clock_sees_no_live_agent_as_due(client: Any) -> None:
    store = BatchStore(client, Scripts(client), "skew-sweep")
    live = await redis_ms(client) + 5000  # its lease runs 5 more seconds
    await client.zadd(store.k.watch, {store.k.member(0): live,
                                      store.k.member(1): await redis_ms(client) - 1})
    # only the agent whose deadline really passed
    assert await redis_store.due_agents(client) == [("skew-sweep", 1)]
