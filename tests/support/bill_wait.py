"""A tool for distributed tests of what provider batches bill for hedged turns the sync API
won: importable by worker processes as ``tests.support.bill_wait:wait_for_fleet_bill``."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from agentbatch import ToolContext, tool
from agentbatch.distributed.state.keys import BatchKeys
from tests.support.tools import counting_redis_url

BILL_WAIT_S = 120.0  # how long the tool waits for the bill at most


@tool
async def wait_for_fleet_bill(key: str, ctx: ToolContext) -> str:
    """Return once a provider batch's bill for hedged turns is on the batch's spend in Redis
    (``stat:hedge_lost_batch_paid``, written with the spend in one step), or after
    ``BILL_WAIT_S``.

    Args:
        key: any key.
    """
    client = aioredis.from_url(counting_redis_url())
    meta = BatchKeys(ctx.batch_id).meta
    try:
        stop = time.monotonic() + BILL_WAIT_S
        while time.monotonic() < stop:
            if await client.hget(meta, "stat:hedge_lost_batch_paid"):
                return f"{key}: billed"
            await asyncio.sleep(0.1)
        return f"{key}: no bill after {BILL_WAIT_S:g}s"
    finally:
        await client.aclose()
