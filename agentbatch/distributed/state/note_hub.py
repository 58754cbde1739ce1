"""Wake-ups through Redis pub/sub: one subscription per process and channel.

Waiters ask for a future before they look at the state they wait on (no lost wake-up), and
still bound each wait by a timeout: a message lost while the subscription reconnects costs
a waiter one timeout, never a hang. Used for tool results (``redis_coalesce``) and freed
inference slots (``semaphore``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from agentbatch.core.wait_for import wait_for

log = logging.getLogger(__name__)


class NoteHub:
    """One pub/sub subscription per process and channel; routes each note (the message) to
    the waiters that expect it."""

    def __init__(self, client: Any, channel: str) -> None:
        self._client = client
        self.channel = channel
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def _listen(self) -> None:
        while True:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._ready.set()
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self._wake(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception:  # reconnect; waiters fall back on their timeouts meanwhile
                log.warning("pub/sub on %s lost; resubscribing", self.channel, exc_info=True)
                self._ready.clear()
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _wake(self, note: str) -> None:
        for fut in self._waiters.pop(note, []):
            if not fut.done():
                fut.set_result(None)

    async def expect(self, note: str) -> asyncio.Future[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._listen(), name=f"agentbatch-hub-{self.channel}")
        with contextlib.suppress(asyncio.TimeoutError):
            await wait_for(self._ready.wait(), 2.0)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(note, []).append(fut)
        return fut

    def forget(self, note: str, fut: asyncio.Future[None]) -> None:
        waiters = self._waiters.get(note)
        if waiters and fut in waiters:
            waiters.remove(fut)
            if not waiters:
                del self._waiters[note]
