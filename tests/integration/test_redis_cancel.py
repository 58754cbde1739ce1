"""A task cancelled while its Redis command is sent ends cancelled, every time.

Before Python 3.12, ``asyncio.wait_for`` (which redis-py's asyncio connection sends each
command under) returns the inner result when the cancel lands just as the send completes, and
the cancel is lost (CPython gh-86296). A semaphore waiter cancelled that way went on polling
until the holder's 30 s slot expired and then took it: CI failed twice at
test_fleet_slot_queue's dead-waiter test (``holders: [('dies', ...)]``). Real redis-server;
the cancel lands at a random point of many commands, so a swallowed one shows.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import pytest

from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.semaphore import RedisSemaphore

pytestmark = [pytest.mark.redis]


async def test_a_cancel_that_lands_while_a_command_is_sent_is_never_swallowed(
        redis_client: Any) -> None:
    await redis_client.set("k", "v")
    lost = 0
    for _ in range(1500):
        task = asyncio.ensure_future(redis_client.get("k"))
        for _ in range(random.randint(0, 3)):  # land the cancel anywhere in the send
            await asyncio.sleep(0)
        if not task.cancel():
            continue  # it had already answered: nothing to cancel
        await asyncio.gather(task, return_exceptions=True)
        lost += not task.cancelled()
    assert lost == 0
    assert await redis_client.get("k") == "v"  # no reply was left behind for the next command


async def test_a_cancelled_slot_waiter_stops_and_takes_no_slot(redis_client: Any) -> None:
    async def wait_for_slot(s: RedisSemaphore) -> None:
        async with s.slot(holder="waiter", priority=0, deadline=time.monotonic() + 30,
                          keep=True):
            pass

    for _ in range(60):
        s = RedisSemaphore(redis_client, Scripts(redis_client), f"cancel-{uuid.uuid4().hex[:8]}", 1)
        assert await s.try_acquire("holder")
        task = asyncio.ensure_future(wait_for_slot(s))
        stop = time.monotonic() + 10
        while await redis_client.zcard(s.wait_key) != 1:
            assert time.monotonic() < stop, "the waiter never queued"
        await asyncio.sleep(random.uniform(0, 0.003))
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
        assert task.cancelled()
        assert await redis_client.zrange(s.key, 0, -1) == ["holder"]
        assert await redis_client.zcard(s.wait_key) == 0
