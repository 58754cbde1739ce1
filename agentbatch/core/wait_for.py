"""``asyncio.wait_for`` that never swallows its caller's cancel.

Before Python 3.12, ``asyncio.wait_for`` returns the inner result when a cancel of the
waiting task arrives in the same loop pass as that result (CPython gh-86296): the task's
``cancel()`` is lost and it runs on as if never cancelled -- a cancelled agent's tool or
turn would go on to commit, a cancelled waiter would go on waiting. The task still counts
the cancel (``Task.cancelling()``, 3.11+), so ``wait_for`` here raises ``CancelledError``
when that count rose while it waited. Python 3.12+ needs nothing (its ``wait_for`` is built
on ``asyncio.timeout``); 3.10 has no count, so there it is the plain ``wait_for``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["cancels", "wait_for"]


def cancels(task: asyncio.Task[Any] | None) -> int:
    """The cancels requested of ``task`` and not taken back (Python 3.11+; else 0)."""
    count = getattr(task, "cancelling", None)
    return int(count()) if count is not None else 0


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``asyncio.wait_for(aw, timeout)``; a cancel of the caller that arrived as ``aw``
    finished is raised, not dropped (its result is discarded)."""
    if sys.version_info >= (3, 12):
        return await asyncio.wait_for(aw, timeout)
    task = asyncio.current_task()
    before = cancels(task)
    result = await asyncio.wait_for(aw, timeout)
    if cancels(task) > before:
        raise asyncio.CancelledError("cancelled as the awaited result arrived")
    return result
