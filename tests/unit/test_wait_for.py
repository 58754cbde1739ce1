"""``core.wait_for``: a cancel landing in the same loop pass as the awaited result is raised,
where Python 3.11's ``asyncio.wait_for`` returns the result and drops it (gh-86296)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from agentbatch.core.wait_for import wait_for

Waiter = Callable[[Awaitable[Any], float], Awaitable[Any]]


async def _cancel_as_result_lands(waiter: Waiter) -> str:
    """A task waits on a future; the future's result and the task's cancel arrive in the
    same loop pass. What the task then did: ``"cancelled"`` or ``"returned"``."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()

    async def wait() -> str:
        await waiter(fut, 10.0)
        return "returned"

    task = asyncio.create_task(wait())
    await asyncio.sleep(0)  # the task is waiting on fut
    fut.set_result(1)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12) or sys.version_info < (3, 11),
                    reason="the swallow is Python 3.11's (3.12 fixed it; 3.10 cannot tell)")
def test_plain_wait_for_swallows_the_cancel_on_3_11() -> None:
    """The bug this module exists for, shown with the standard library's own."""
    assert asyncio.run(_cancel_as_result_lands(asyncio.wait_for)) == "returned"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.10 has no Task.cancelling()")
def test_our_wait_for_raises_the_cancel() -> None:
    assert asyncio.run(_cancel_as_result_lands(wait_for)) == "cancelled"


def test_it_still_returns_and_times_out() -> None:
    async def main() -> None:
        assert await wait_for(asyncio.sleep(0, result=7), 1.0) == 7
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(asyncio.sleep(5), 0.01)

    asyncio.run(main())


def test_a_cancel_taken_back_earlier_is_not_raised_again() -> None:
    """A task that caught an earlier cancel (and uncancelled) waits normally afterwards."""
    async def main() -> int:
        task = asyncio.current_task()
        assert task is not None
        inner = asyncio.ensure_future(asyncio.sleep(5))
        asyncio.get_running_loop().call_soon(task.cancel)
        try:
            await inner
        except asyncio.CancelledError:
            if hasattr(task, "uncancel"):
                task.uncancel()
        return await wait_for(asyncio.sleep(0, result=3), 1.0)

    assert asyncio.run(main()) == 3
