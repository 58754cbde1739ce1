"""Fleet-wide AIMD on the Redis semaphore: two RedisSemaphore instances ("workers") sharing
one key on a real redis-server, with the scripts' time injected through the clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.semaphore import RedisSemaphore

pytestmark = [pytest.mark.redis]

START_MS = 1_700_000_000_000


class Clock:
    def __init__(self) -> None:
        self.ms = START_MS

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Any]:
    r = async_client(redis_url)
    yield r
    await r.aclose()


def worker(client: Any, clock: Clock, limit: int = 8, **kw: Any) -> RedisSemaphore:
    return RedisSemaphore(client, Scripts(client), "backend-x", limit, clock=clock,
                          cooldown_ms=2000, quiet_ms=30_000, **kw)


async def acquired(sem: RedisSemaphore, n: int, tag: str) -> int:
    return sum([await sem.try_acquire(f"{tag}{i}") for i in range(n)])


async def test_a_throttle_seen_by_one_worker_lowers_the_limit_for_both(client: Any) -> None:
    clock = Clock()
    a, b = worker(client, clock), worker(client, clock)
    assert await a.effective_limit() == 8  # no dynamic limit yet
    assert await a.on_throttle() is True
    assert await client.hgetall(a.aimd_key) == {
        "limit": "4", "last_throttle_ms": str(START_MS), "last_decrease_ms": str(START_MS)}
    assert await b.effective_limit() == 4
    assert await acquired(b, 6, "b") == 4  # B alone cannot go past the shared limit
    assert await acquired(a, 2, "a") == 0  # ... and neither can A beside it
    assert await b.try_acquire("b0") is True  # a current holder still renews
    assert b.seen_limit == 4


async def test_a_shrinking_limit_evicts_no_holder(client: Any) -> None:
    clock = Clock()
    a, b = worker(client, clock), worker(client, clock)
    assert await acquired(a, 8, "a") == 8
    await b.on_throttle()
    assert await a.holders() == 8  # the 8 keep their slots ...
    await a.release("a0")
    assert await acquired(b, 1, "b") == 0  # ... but nobody new gets one until below 4
    for i in range(1, 5):
        await a.release(f"a{i}")
    assert await acquired(b, 2, "b") == 1


async def test_cooldown_prevents_halving_twice_for_one_burst(client: Any) -> None:
    clock = Clock()
    a, b = worker(client, clock, limit=64), worker(client, clock, limit=64)
    assert await a.on_throttle() is True  # 64 -> 32
    clock.ms += 500
    assert await b.on_throttle() is False  # same burst, seen by the other worker
    clock.ms += 1499
    assert await a.on_throttle() is False  # still 1999 ms after the halving
    assert await a.effective_limit() == 32
    clock.ms += 1
    assert await b.on_throttle() is True  # 2000 ms after the halving: 32 -> 16
    assert await b.effective_limit() == 16
    assert (a.throttles, a.decreases, b.throttles, b.decreases) == (2, 1, 2, 1)


async def test_the_limit_never_drops_below_one(client: Any) -> None:
    clock = Clock()
    a = worker(client, clock, limit=3)
    for _ in range(5):
        await a.on_throttle()
        clock.ms += 2000
    assert await a.effective_limit() == 1
    assert await acquired(a, 2, "a") == 1


async def test_recovery_adds_one_after_each_quiet_period(client: Any) -> None:
    clock = Clock()
    a, b = worker(client, clock, limit=4), worker(client, clock, limit=4)
    await a.on_throttle()  # 4 -> 2
    clock.ms += 1000
    await b.on_throttle()  # within the cooldown: no halving, but it restarts the quiet period
    assert await b.effective_limit() == 2
    clock.ms += 29_999
    assert await a.on_success() is False  # 29.999 s after B's throttle
    clock.ms += 1
    assert await a.on_success() is True  # quiet for 30 s: 2 -> 3
    assert await b.on_success() is False  # the fleet grows by one per quiet period
    assert await b.effective_limit() == 3
    clock.ms += 30_000
    assert await b.on_success() is True  # 3 -> 4
    clock.ms += 30_000
    assert await a.on_success() is False  # capped at the configured limit
    assert await a.effective_limit() == 4
    assert (a.increases, b.increases) == (1, 1)
    assert await acquired(b, 5, "b") == 4


async def test_success_without_any_throttle_changes_nothing(client: Any) -> None:
    clock = Clock()
    a = worker(client, clock)
    assert await a.on_success() is False  # first call asks Redis: no dynamic limit
    assert await client.exists(a.aimd_key) == 0
    assert await a.try_acquire("h") is True and a.seen_limit is None


async def test_the_effective_limit_is_the_smaller_of_configured_and_shared(
    client: Any,
) -> None:
    clock = Clock()
    big, small = worker(client, clock, limit=16), worker(client, clock, limit=2)
    await big.on_throttle()  # shared limit 8
    assert await big.effective_limit() == 8
    assert await small.effective_limit() == 2  # its own cap is lower still
    assert await small.on_throttle() is False  # within the cooldown: nothing changes
    assert await big.effective_limit() == 8
    clock.ms += 2000
    assert await small.on_throttle() is True  # halves min(8, its own 2): 1, fleet-wide
    assert await big.effective_limit() == 1


async def test_slot_respects_the_shared_limit(client: Any) -> None:
    clock = Clock()
    a, b = worker(client, clock, limit=4), worker(client, clock, limit=4)
    await a.on_throttle()  # 2 slots fleet-wide
    async with a.slot() as h1, b.slot() as h2:
        assert h1 != h2
        assert await acquired(b, 1, "extra") == 0
    assert await a.holders() == 0
