"""One asyncio loop per worker process, fed by Celery's task threads.

Celery tasks are synchronous; the inference and tool IO underneath is async (aiohttp or httpx,
redis.asyncio). Each process runs a single loop in a daemon thread and task threads submit
coroutines to it, so thousands of in-flight calls share one loop and one connection pool.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid: int | None = None


def process_loop() -> asyncio.AbstractEventLoop:
    """The loop of this process (a fresh one after fork)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="agentbatch-loop",
                                      daemon=True)
            thread.start()
            _loop, _pid = loop, os.getpid()
        return _loop


def run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the process loop from a task thread and wait for its result."""
    future = asyncio.run_coroutine_threadsafe(coro, process_loop())
    try:
        return future.result(timeout)
    except BaseException:
        future.cancel()
        raise
