"""A rate-limited tool for the fleet-wide rate limit test: each execution records its start
time (Redis ``TIME``, one clock for every worker) in ``test:rate:<tag>``."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from agentbatch import tool
from tests.support.tools import counting_redis_url

RATE = 5.0
_clients: dict[int, aioredis.Redis] = {}


def _redis() -> aioredis.Redis:
    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None:
        client = _clients[loop_id] = aioredis.from_url(counting_redis_url())
    return client


@tool(rate_limit=RATE)
async def limited_fetch(tag: str, n: int) -> str:
    """Fetch page ``n`` from an API that allows 5 calls per second (for the whole fleet).

    Args:
        tag: the test run.
        n: which page.
    """
    secs, micros = await _redis().time()
    await _redis().rpush(f"test:rate:{tag}", f"{secs}.{micros:06d}")
    return f"page-{n}"
