"""Run sync tool functions on threads nobody joins, so a timed-out call frees its batch.

``asyncio.to_thread`` uses the loop's default executor: ``asyncio.run`` joins that executor on
the way out, and ``concurrent.futures`` joins its threads at interpreter exit. A sync tool
stuck past its timeout then held ``run_batch`` and the whole process until it returned, and
one that never returned held them forever. Python cannot stop a running thread, so here each
call gets a daemon thread and a future on the caller's loop: on timeout the caller stops
waiting, the thread runs on until the function returns, and its result is dropped.

Live threads are capped per process (``MAX_THREADS``). When every one is taken (say, by
stuck calls) a new call waits for one to free; that wait counts against the tool's timeout,
so it ends as that tool's usual timeout error.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

MAX_THREADS = 64
_POLL_MAX_S = 0.1

_threads = threading.BoundedSemaphore(MAX_THREADS)
_warned = threading.Event()


async def run_sync(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``await fn(*args, **kwargs)`` on a daemon thread, with the caller's contextvars.

    Cancelling the await (a timeout) abandons the call: the thread is not joined by anyone.
    """
    await _acquire_thread()
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def target() -> None:
        try:
            outcome: tuple[bool, Any] = (True, context.run(fn, *args, **kwargs))
        except BaseException as exc:  # handed to the awaiting caller, as to_thread does
            outcome = (False, exc)
        finally:
            _threads.release()
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone: drop the result
            loop.call_soon_threadsafe(_settle, future, outcome)

    name = f"agentbatch-sync-tool-{getattr(fn, '__name__', 'fn')}"
    try:
        threading.Thread(target=target, name=name, daemon=True).start()
    except BaseException:
        _threads.release()
        raise
    return await future


def _settle(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if future.done():  # the caller stopped waiting (timeout, cancel): the result is dropped
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


async def _acquire_thread() -> None:
    """Take a thread slot; poll while all are taken (only ever the case with stuck calls)."""
    delay = 0.005
    while not _threads.acquire(blocking=False):
        if not _warned.is_set():
            _warned.set()
            log.warning("all %d sync tool threads are busy (stuck tool calls?); new sync "
                        "tool calls wait for one to finish", MAX_THREADS)
        await asyncio.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)
