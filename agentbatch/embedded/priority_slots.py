"""A priority semaphore for inference slots.

Waiters with fewer turns left are granted first (near-done agents finish and free memory
sooner); ties go in arrival order. Capacity can change at run time (adaptive concurrency).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class PrioritySlots:
    def __init__(self, capacity: int) -> None:
        self._capacity = max(1, capacity)
        self._in_use = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self.peak = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def waiting(self) -> int:
        return sum(1 for *_, f in self._waiters if not f.done())

    def set_capacity(self, capacity: int) -> None:
        """Shrinking never evicts holders; it only delays new grants."""
        self._capacity = max(1, capacity)
        self._wake()

    async def acquire(self, priority: int) -> None:
        if self._in_use < self._capacity and not self._waiters:
            self._grant()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled in the same tick: hand it on
            raise

    def release(self) -> None:
        self._in_use -= 1
        self._wake()

    def slot(self, priority: int) -> _Slot:
        """``async with slots.slot(priority):`` holds one slot for the block."""
        return _Slot(self, priority)

    def _grant(self) -> None:
        self._in_use += 1
        self.peak = max(self.peak, self._in_use)

    def _wake(self) -> None:
        while self._waiters and self._in_use < self._capacity:
            _, _, fut = heapq.heappop(self._waiters)
            if fut.done():
                continue
            self._grant()
            fut.set_result(None)


class _Slot:
    """One held slot, as a plain class: an ``asynccontextmanager`` made an async generator
    and its wrapper on every model turn (issue 26 item 5)."""

    __slots__ = ("_priority", "_slots")

    def __init__(self, slots: PrioritySlots, priority: int) -> None:
        self._slots = slots
        self._priority = priority

    async def __aenter__(self) -> None:
        await self._slots.acquire(self._priority)

    async def __aexit__(self, *exc_info: object) -> None:
        self._slots.release()
