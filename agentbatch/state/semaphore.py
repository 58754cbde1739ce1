"""A fleet-wide cap on in-flight inference requests per backend.

Holders are members of a sorted set scored by expiry, renewed while the call runs; a killed
worker's slot frees itself when its score passes. Waiting backs off with jitter up to a short
cap: slots turn over every few hundred milliseconds, so polling stays cheap and fair enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from .keys import semaphore
from .redis_store import now_ms
from .scripts import Scripts


class RedisSemaphore:
    def __init__(self, client: Any, scripts: Scripts, name: str, limit: int, *,
                 ttl_ms: int = 30_000, max_backoff_s: float = 0.2) -> None:
        self._r = client
        self._s = scripts
        self.key = semaphore(name)
        self.limit = limit
        self.ttl_ms = ttl_ms
        self.max_backoff_s = max_backoff_s

    async def try_acquire(self, holder: str) -> bool:
        return bool(await self._s.sem_acquire(keys=[self.key],
                                              args=[holder, self.limit, self.ttl_ms, now_ms()]))

    async def release(self, holder: str) -> None:
        await self._r.zrem(self.key, holder)

    async def holders(self) -> int:
        await self._r.zremrangebyscore(self.key, "-inf", now_ms())
        return int(await self._r.zcard(self.key))

    @contextlib.asynccontextmanager
    async def slot(self, ready: Callable[[], Awaitable[None]] | None = None
                   ) -> AsyncIterator[str]:
        """Hold one slot for the body; ``ready`` (backpressure) is awaited before each try."""
        holder = uuid.uuid4().hex
        delay = 0.005
        while True:
            if ready is not None:
                await ready()
            if await self.try_acquire(holder):
                break
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, self.max_backoff_s)
        renewer = asyncio.create_task(self._renew(holder))
        try:
            yield holder
        finally:
            renewer.cancel()
            await asyncio.shield(self.release(holder))

    async def _renew(self, holder: str) -> None:
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            with contextlib.suppress(Exception):
                await self.try_acquire(holder)  # re-scores an existing holder
