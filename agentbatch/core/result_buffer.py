"""Results in arrival order, readable from any thread or event loop, any number of times."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

from agentbatch.core.results import AgentResult


class ResultBuffer:
    """Append-only. Readers keep their own cursor, so leaving one reader early loses nothing."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._items: list[AgentResult] = []
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._closed = False
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def finished(self) -> bool:
        return self._closed or len(self._items) >= self.total

    def put(self, result: AgentResult) -> None:
        with self._cond:
            self._items.append(result)
            self._notify_locked()

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._closed = True
            self._error = self._error or error
            self._notify_locked()

    def _notify_locked(self) -> None:
        self._cond.notify_all()
        for loop, event in self._async_waiters:
            loop.call_soon_threadsafe(event.set)
        self._async_waiters.clear()

    def _raise_if_failed(self, cursor: int) -> None:
        if cursor >= len(self._items) and self._error is not None:
            raise self._error

    def iter(self, start: int = 0, timeout: float | None = None) -> Iterator[AgentResult]:
        cursor = start
        while True:
            with self._cond:
                while cursor >= len(self._items) and not self.finished:
                    if not self._cond.wait(timeout):
                        raise TimeoutError(f"no result within {timeout}s")
                self._raise_if_failed(cursor)
                if cursor >= len(self._items):
                    return
                item = self._items[cursor]
            cursor += 1
            yield item

    async def aiter(self, start: int = 0) -> AsyncIterator[AgentResult]:
        cursor = start
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                self._raise_if_failed(cursor)
                if cursor < len(self._items):
                    item = self._items[cursor]
                elif self.finished:
                    return
                else:
                    event = asyncio.Event()
                    self._async_waiters.append((loop, event))
                    item = None
            if item is None:
                await event.wait()
                continue
            cursor += 1
            yield item
