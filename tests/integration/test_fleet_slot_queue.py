"""The fleet's inference slots are handed out in priority order, on one real redis-server.

A distributed batch on llama.cpp is capped at the server's slot count (as the embedded engine
is), and a freed slot goes to the turn with the fewest turns left, then to the one that has
waited longest: not to whichever worker polls first, and not to a claim that arrives at the
right moment. On llama-server this decides whether an agent's next turn finds its first turn
in the prompt cache (``agentbatch/distributed/state/semaphore.py``; bench_engine's
``distributed`` system).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from agentbatch import submit_batch
from agentbatch.core.agent_state import AgentState
from agentbatch.distributed.state.redis_store import BatchStore, stored_state
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.semaphore import WAIT_TTL_MS, RedisSemaphore
from tests.integration.test_backend_llamacpp import WORKER_ENV, FakeLlamaServer
from tests.support.tools import ShortAnswer

pytestmark = [pytest.mark.redis]


def sem(redis_client: Any, name: str, limit: int = 1, woken: bool = False) -> RedisSemaphore:
    return RedisSemaphore(redis_client, Scripts(redis_client), name, limit, woken=woken)


async def until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("woken", [False, True], ids=["polling", "woken"])
async def test_a_freed_slot_goes_to_the_waiter_with_fewest_turns_left(redis_client: Any,
                                                                      woken: bool) -> None:
    """Polling, or woken by the release's pub/sub note (what workers do)."""
    s = sem(redis_client, f"prio-1-{woken}", woken=woken)
    assert await s.try_acquire("holder")
    order: list[str] = []

    async def turn(name: str, turns_left: int) -> None:
        async with s.slot(holder=name, priority=turns_left, deadline=time.monotonic() + 30):
            order.append(name)
            await asyncio.sleep(0.05)

    first_turns = []
    for i in range(3):  # one at a time, so the order they arrive in is known
        first_turns.append(asyncio.create_task(turn(f"first-{i}", 3)))
        await until(lambda n=i + 1: _queued(redis_client, s, n))
    next_turn = asyncio.create_task(turn("next-turn", 1))  # arrives last, nearer done
    await until(lambda: _queued(redis_client, s, 4))
    await s.release("holder")
    await asyncio.wait_for(asyncio.gather(*first_turns, next_turn), 30)
    # then the first turns in the order they arrived
    assert order == ["next-turn", "first-0", "first-1", "first-2"]
    assert await redis_client.exists(s.wait_key, s.wait_expiry_key) == 0  # nothing left behind


async def test_a_woken_waiter_takes_a_released_slot_at_once(redis_client: Any) -> None:
    """Released by release.lua (a turn that failed) or ``release()``: the queued
    turn hears it and asks again at once, not after its 10 s poll."""
    s = RedisSemaphore(redis_client, Scripts(redis_client), "prio-wake", 1, woken=True,
                       max_backoff_s=10.0)
    store = BatchStore(redis_client, Scripts(redis_client), "prio-wake")
    for release in ("script", "method"):
        assert await s.try_acquire("holder")
        waiter = asyncio.create_task(_hold(s, "waiter", 1))
        await until(lambda: _queued(redis_client, s, 1))
        started = time.monotonic()
        if release == "script":
            await store.release(0, "holder", s.key)
        else:
            await s.release("holder")
        await asyncio.wait_for(waiter, 5)
        assert time.monotonic() - started < 5  # not the 10 s poll
        await s.release("waiter")


async def _queued(redis_client: Any, s: RedisSemaphore, n: int) -> bool:
    return int(await redis_client.zcard(s.wait_key)) == n


async def test_a_claim_does_not_overtake_a_queued_turn(redis_client: Any) -> None:
    """Whether the queued turn polls first or the claim asks first, the slot is its."""
    s = sem(redis_client, f"prio-2-{uuid.uuid4().hex[:8]}")
    store = BatchStore(redis_client, Scripts(redis_client), "prio-claim")
    await redis_client.hset(store.k.state, "0", "1:" + stored_state(AgentState(index=0, input={})))
    assert await s.try_acquire("holder")
    waiting = asyncio.create_task(_hold(s, "queued", 2))
    await until(lambda: _queued(redis_client, s, 1))
    await s.release("holder")  # one free slot, owed to "queued"
    try:
        claim = await store.claim_turn(0, 1, "claimer", 30_000, slot=s.ask())
        assert claim.kind == "ok" and claim.slot is False
        assert await s.try_acquire("newcomer") is False
        await asyncio.wait_for(waiting, 10)
        assert await redis_client.zrange(s.key, 0, -1) == ["queued"]
    finally:
        waiting.cancel()


async def _hold(s: RedisSemaphore, holder: str, turns_left: int) -> None:
    async with s.slot(holder=holder, priority=turns_left, deadline=time.monotonic() + 30,
                      keep=True):
        pass


async def test_a_dead_waiter_loses_its_place_and_the_queue_keys_expire(redis_client: Any) -> None:
    s = sem(redis_client, f"prio-3-{uuid.uuid4().hex[:8]}")
    assert await s.try_acquire("holder")
    task = asyncio.create_task(_hold(s, "dies", 0))
    await until(lambda: _queued(redis_client, s, 1))
    task.cancel()  # a clean exit leaves the queue at once ...
    await asyncio.gather(task, return_exceptions=True)
    assert await redis_client.zcard(s.wait_key) == 0
    # ... a killed worker's place is written and never asked about again
    asked_ms = await _redis_ms(redis_client)
    await s._acquire("killed", 0)
    await s.release("holder")
    assert await s.try_acquire("newcomer") is False  # still owed to "killed"
    assert 0 < await redis_client.pttl(s.wait_key) <= WAIT_TTL_MS
    # The place lapses WAIT_TTL_MS after the waiter's last ask in Redis's clock (TIME), the
    # only clock the script reads; wait on that clock, not on this process's sleep (CI failed
    # once at this line after a 5.2 s local sleep).
    deadline = time.monotonic() + WAIT_TTL_MS / 1000 + 30
    while await _redis_ms(redis_client) < asked_ms + WAIT_TTL_MS + 50:
        assert time.monotonic() < deadline, "Redis's clock did not pass the waiter's expiry"
        await asyncio.sleep(0.1)
    acquired = await s.try_acquire("newcomer")
    assert acquired is True, await _queue_state(redis_client, s)
    assert await redis_client.exists(s.wait_key, s.wait_expiry_key) == 0


async def _redis_ms(redis_client: Any) -> int:
    secs, micros = await redis_client.time()
    return int(secs) * 1000 + int(micros) // 1000


async def _queue_state(redis_client: Any, s: RedisSemaphore) -> dict[str, Any]:
    """What the semaphore's keys hold, for an assertion message."""
    return {"redis_ms": await _redis_ms(redis_client),
            "holders": await redis_client.zrange(s.key, 0, -1, withscores=True),
            "waiters": await redis_client.zrange(s.wait_key, 0, -1, withscores=True),
            "waiter_expiry": await redis_client.zrange(s.wait_expiry_key, 0, -1, withscores=True),
            "pttl": await redis_client.pttl(s.wait_key)}


class SlowLlama(FakeLlamaServer):
    """The fake llama-server (4 slots), taking 0.3 s per chat turn; counts turns in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.inflight = 0
        self.peak = 0

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            await asyncio.sleep(0.3)
            return await super()._chat(request)
        finally:
            self.inflight -= 1


@pytest.fixture
def slow_llama() -> Iterator[SlowLlama]:
    with SlowLlama() as server:
        yield server


def test_a_distributed_batch_keeps_llamacpps_slot_count_in_flight(
        slow_llama: SlowLlama, redis_url: str, start_workers: Any) -> None:
    """2 workers x 8 concurrent turns, 16 agents: without the cap all 16 were sent at once
    and waited in llama-server's first-come queue."""
    start_workers(2, concurrency=8, env=WORKER_ENV)
    handle = submit_batch("Question {i}", [{"i": i} for i in range(16)], model="smol",
                          backend=slow_llama.url + "?stream=0", output_schema=ShortAnswer,
                          redis_url=redis_url, warm_prefix=False)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:2]
    assert [r.output.answer for r in results] == [f"a{i}" for i in range(16)]
    assert slow_llama.peak == 4, slow_llama.peak
