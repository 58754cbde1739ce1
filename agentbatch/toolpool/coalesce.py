"""In-flight coalescing: identical concurrent tool calls execute once and share the result.

Thousands of agents running the same task often issue the same call at the same moment
(the same search, the same file). The shared execution runs as its own task and every caller,
the one that started it included, waits on it through ``asyncio.shield``. So a caller that is
cancelled or times out only stops *its own* wait: the execution and the other callers carry
on, and a failure of the execution reaches every caller as that error, never as a hang.

The execution is handed the ``Lease`` it runs under (its fencing token, and whether it still
leads), so a tool with side effects can refuse to act once another worker has taken over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from agentbatch.core.errors import ToolError
from agentbatch.core.tool_context import Lease, LocalLease

__all__ = ["Coalescer", "InflightCoalescer", "NoCoalescing", "Thunk"]

Thunk = Callable[[Lease], Awaitable[str]]  # the execution, given the lease it runs under


@runtime_checkable
class Coalescer(Protocol):
    """Runs ``thunk`` once per key among concurrent callers (in-process or fleet-wide).

    Returns ``(result, shared)``; ``shared`` is True when this caller got the result of an
    execution someone else started. An exception from the execution is raised to every caller.
    Cancelling one caller must never cancel the execution for the others. ``lock_ttl`` is how
    long (seconds) a leader that stops renewing keeps the call (None: the coalescer's default).
    """

    async def run(self, key: str, thunk: Thunk, *,
                  lock_ttl: float | None = None) -> tuple[str, bool]: ...


class InflightCoalescer:
    """Coalescing within one event loop; the key is cleared as soon as the execution ends."""

    def __init__(self) -> None:
        self._inflight: dict[str, asyncio.Task[str]] = {}
        self._waiters: dict[str, int] = {}

    async def run(self, key: str, thunk: Thunk, *,
                  lock_ttl: float | None = None) -> tuple[str, bool]:
        task = self._inflight.get(key)
        shared = task is not None and not task.done()
        if not shared:
            # (``ensure_future`` of a coroutine is this, after checks the coroutine passes)
            task = asyncio.get_running_loop().create_task(self._execute(key, thunk))
            self._inflight[key] = task
            task.add_done_callback(self._finished)
        assert task is not None
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(task), shared
        except asyncio.CancelledError:
            if task.cancelled() and not _caller_cancelled():
                # The execution itself was cancelled (not by us): an error, not our cancellation.
                raise ToolError("error: the tool execution was cancelled") from None
            raise
        finally:
            left = self._waiters[key] - 1
            if left:
                self._waiters[key] = left
            else:
                del self._waiters[key]

    def waiters(self, key: str) -> int:
        """How many callers are waiting on ``key`` right now (for tests and introspection)."""
        return self._waiters.get(key, 0)

    def inflight(self) -> int:
        """How many distinct executions are running."""
        return len(self._inflight)

    async def _execute(self, key: str, thunk: Thunk) -> str:
        try:
            return await thunk(LocalLease())
        finally:
            # Cleared synchronously with completion: a call arriving afterwards runs fresh.
            if self._inflight.get(key) is asyncio.current_task():
                del self._inflight[key]

    @staticmethod
    def _finished(task: asyncio.Task[str]) -> None:
        # Every caller may have gone (all cancelled); mark the outcome as seen so asyncio does
        # not log "exception was never retrieved" for an error that was handled by design.
        if not task.cancelled():
            task.exception()


class NoCoalescing:
    """Every call executes on its own (for tools or tests that must not share executions)."""

    async def run(self, key: str, thunk: Thunk, *,
                  lock_ttl: float | None = None) -> tuple[str, bool]:
        return await thunk(LocalLease()), False


def _caller_cancelled() -> bool:
    """Whether the current task has a pending cancellation request (Python 3.11+)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if cancelling is None:  # Python 3.10: assume the execution, not the caller, was cancelled
        return False
    return cancelling() > 0
