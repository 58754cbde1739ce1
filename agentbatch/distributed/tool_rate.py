"""Fleet-wide per-tool rate limits for the distributed engine: one token bucket in Redis.

``@tool(rate_limit=...)`` protects an external API, and that API counts calls from the whole
fleet, not from one worker process: a per-process bucket lets N tool workers run at N times
the limit. Here every worker reserves its token from one key per tool (``rate_take.lua``, GCRA
on Redis ``TIME``, so worker clocks never matter) and sleeps exactly until the script says
its token is due: one round trip per execution, no polling. A waiter cancelled while asleep
does not hand its token back (the bucket only runs slow by that one token).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentbatch.core.tool import Tool
from agentbatch.distributed.state.keys import PREFIX
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.toolpool.ratelimit import check_bucket

__all__ = ["RedisTokenBucket", "rate_key", "redis_buckets"]


def rate_key(tool: Tool) -> str:
    """One bucket per tool identity (import path + version), whatever the batch."""
    return f"{PREFIX}:rate:{tool.identity}"


class RedisTokenBucket:
    """``rate`` tokens per second fleet-wide, holding at most ``burst``; ``acquire`` waits."""

    def __init__(self, client: Any, scripts: Scripts, key: str, rate: float,
                 burst: float = 1.0) -> None:
        check_bucket(rate, burst)
        self._r = client
        self._s = scripts
        self.key = key
        self.rate = rate
        self.burst = burst
        self.waited_s = 0.0  # total time this process slept for tokens

    async def reserve(self) -> float:
        """Take the fleet's next token; returns how long to wait until it is due (seconds)."""
        wait_us = await self._s.rate_take(keys=[self.key],
                                          args=[1_000_000 / self.rate, self.burst])
        return int(wait_us) / 1_000_000

    async def acquire(self) -> float:
        """Wait for a token; returns the seconds slept (0 when one was free)."""
        delay = await self.reserve()
        if delay > 0:
            await asyncio.sleep(delay)
            self.waited_s += delay
        return delay


def redis_buckets(client: Any, scripts: Scripts) -> Any:
    """A ``ToolPool`` ``bucket_factory`` that gives each rate-limited tool the fleet's bucket."""

    def make(tool: Tool) -> RedisTokenBucket:
        assert tool.rate_limit is not None
        return RedisTokenBucket(client, scripts, rate_key(tool), tool.rate_limit)

    return make
