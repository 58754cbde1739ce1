"""In-flight coalescing: identical concurrent tool calls execute once and share the result.

Thousands of agents running the same task often issue the same call at the same moment
(the same search, the same file). The shared execution runs as its own task and every caller,
the one that started it included, waits on a future of its own that the execution resolves
when it ends. So a caller that is cancelled or times out only stops *its own* wait: the
execution and the other callers carry on, and a failure of the execution reaches every caller
as that error, never as a hang.

The execution is handed the ``Lease`` it runs under (its fencing token, and whether it still
leads), so a tool with side effects can refuse to act once another worker has taken over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol, cast, runtime_checkable

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
    """Coalescing within one event loop; the key is cleared as soon as the execution ends.

    Each caller waits on a future of its own, which the execution's task resolves when it
    ends (no ``shield``, no done callbacks: the single caller of a call nobody joins pays one
    task and one future). Cancelling a caller cancels only that future: the execution and the
    other callers carry on. ``timeout`` (seconds) bounds this caller's wait the same way: it
    ends with ``asyncio.TimeoutError`` while the execution runs on for the others.
    """

    def __init__(self) -> None:
        self._inflight: dict[str, _Execution] = {}

    async def run(self, key: str, thunk: Thunk, *, lock_ttl: float | None = None,
                  timeout: float | None = None) -> tuple[str, bool]:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[str] = loop.create_future()
        execution = self._inflight.get(key)
        shared = execution is not None
        if execution is None:
            execution = self._inflight[key] = _Execution(waiter)
            # the task is held by the entry (the loop keeps only a weak reference) until the
            # execution ends; it resolves every waiter then
            execution.task = loop.create_task(self._execute(key, thunk, execution))
        else:
            execution.waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            # (a cancel arriving with the outcome is raised all the same; the task's wakeup
            # has read the outcome, so an error is not logged as never retrieved)
            return await waiter, shared
        finally:
            if timer is not None:
                timer.cancel()

    def waiters(self, key: str) -> int:
        """How many callers are waiting on ``key`` right now (for tests and introspection)."""
        execution = self._inflight.get(key)
        if execution is None:
            return 0
        return sum(1 for w in execution.waiters if not w.done())

    def inflight(self) -> int:
        """How many distinct executions are running."""
        return len(self._inflight)

    async def _execute(self, key: str, thunk: Thunk, execution: _Execution) -> None:
        try:
            result = await thunk(LocalLease())
        except asyncio.CancelledError:
            # The execution itself was cancelled (a caller's cancel never reaches it): an
            # error for every waiter, not their cancellation.
            self._settle(key, execution, None, ToolError("error: the tool execution was "
                                                         "cancelled"))
            raise
        except BaseException as exc:  # every waiter gets the execution's error
            self._settle(key, execution, None, exc)
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the loop's to handle, as before
        else:
            self._settle(key, execution, result, None)

    def _settle(self, key: str, execution: _Execution, result: str | None,
                error: BaseException | None) -> None:
        # Cleared synchronously with completion: a call arriving afterwards runs fresh.
        if self._inflight.get(key) is execution:
            del self._inflight[key]
        for waiter in execution.waiters:
            if not waiter.done():  # not cancelled, not timed out
                if error is None:
                    waiter.set_result(cast(str, result))
                else:
                    waiter.set_exception(error)


class _Execution:
    """One running execution: its task and the futures of the callers waiting on it."""

    __slots__ = ("task", "waiters")

    def __init__(self, first: asyncio.Future[str]) -> None:
        self.waiters = [first]
        self.task: asyncio.Task[None] | None = None


def _expire(waiter: asyncio.Future[str]) -> None:
    """A caller's ``timeout`` passed: its wait ends (the execution is not touched)."""
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class NoCoalescing:
    """Every call executes on its own (for tools or tests that must not share executions)."""

    async def run(self, key: str, thunk: Thunk, *,
                  lock_ttl: float | None = None) -> tuple[str, bool]:
        return await thunk(LocalLease()), False

