"""A cancel that Python 3.11's ``asyncio.wait_for`` swallowed, raised again.

redis-py's asyncio connection sends each command under ``asyncio.wait_for(send,
socket_timeout)``. Before Python 3.12, ``wait_for`` returns the inner result when a cancel
arrives just as the send completes (CPython gh-86296), so the task's ``cancel()`` is lost: a
``slot()`` waiter cancelled by its turn went on polling until the holder's slot expired, then
took it (tests/integration/test_redis_cancel.py; CI failed on it twice). The task still
counts the cancel (``Task.cancelling()``), so a send that returns with that count risen
raises it again, after dropping the connection: the command's reply is still to come and
must never be read as the next command's. (Python 3.10 has no such count: there the mixin
changes nothing.)
"""

from __future__ import annotations

import asyncio
from typing import Any

from agentbatch.core.wait_for import cancels


class CancelSafeSend:
    """Mixin for a ``redis.asyncio`` connection class: a cancel is never swallowed by a
    command's send."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        task = asyncio.current_task()
        before = cancels(task)
        await super().send_packed_command(command, check_health)  # type: ignore[misc]
        if cancels(task) > before:
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise asyncio.CancelledError("cancelled while the command was sent")

