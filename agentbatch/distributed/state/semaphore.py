"""A fleet-wide cap on in-flight inference requests per backend, with fleet-wide AIMD.

Holders are members of a sorted set scored by expiry in Redis's own time, renewed while the
call runs, so a killed worker's slot frees itself. The AIMD limit is shared (``<sem key>:aimd``)
because hosted APIs throttle per account, not per worker. Waiters queue in ``<sem key>:wait``
by priority, then first try, so a freed slot goes to the request with the fewest turns left
(as the embedded engine's ``PrioritySlots``); ``<sem key>:freed`` wakes them. A wait ends at
the turn's deadline (``ServerBusy``) or on cancel (``BatchCancelled``); a holder that finds
its slot gone is marked ``Slot.lost`` and re-admitted within the limit. The details and the
incidents behind them: docs/design-notes.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentbatch.core.errors import BatchCancelled, ServerBusy
from agentbatch.core.wait_for import wait_for
from agentbatch.distributed.state.keys import semaphore
from agentbatch.distributed.state.note_hub import NoteHub
from agentbatch.distributed.state.redis_store import SlotAsk
from agentbatch.distributed.state.scripts import Scripts

log = logging.getLogger(__name__)

Clock = Callable[[], int]
CancelCheck = Callable[[], Awaitable[bool]]
CANCEL_CHECK_S = 0.5  # how often a waiting slot() asks ``cancelled()``
WAIT_TTL_MS = 5_000  # a waiter that stops asking (its worker died) loses its place after this
POLL_S = 0.005  # the first waiter asks about this often; the n-th waiter n times less often
MAX_PRIORITY = 800  # priority * 1e13 + Redis ms stays an exact double (< 2**53)
FREED = "freed"  # the message on ``<sem key>:freed`` when a holder releases its slot
# A woken waiter asks at least this often anyway: for slots freed by expiry (a dead holder),
# which nobody announces, and for an announcement lost while its subscription reconnected.
WOKEN_POLL_S = 1.0
AIMD_IDLE_MS = 10 * 60 * 1000  # the AIMD hash expires this long after its last write


@dataclass
class Slot:
    """What ``slot()`` yields: ``lost`` is set once the holder was found gone from the zset
    (and stays set: the request ran uncounted for a while, even if later re-admitted)."""

    holder: str
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    readmitted: int = 0  # times the renewer got a lost slot back (a free slot was there)


class RedisSemaphore:
    """``async with sem.slot(): ...`` holds one of ``limit`` fleet-wide slots (or fewer, while
    the shared AIMD limit is lower). ``on_throttle`` / ``on_success`` feed that AIMD limit."""

    def __init__(self, client: Any, scripts: Scripts, name: str, limit: int, *,
                 ttl_ms: int = 30_000, max_backoff_s: float = 0.2,
                 cooldown_ms: int = 2000, quiet_ms: int = 30_000,
                 idle_ms: int = AIMD_IDLE_MS, clock: Clock | None = None,
                 woken: bool = False) -> None:
        if limit < 1:
            raise ValueError("semaphore limit must be >= 1")
        if idle_ms < 1:
            raise ValueError("semaphore idle_ms must be >= 1")
        self._r = client
        self._s = scripts
        self.key = semaphore(name)
        self.aimd_key = f"{self.key}:aimd"
        self.wait_key = f"{self.key}:wait"
        self.wait_expiry_key = f"{self.key}:wait:exp"
        # woken: queued turns sleep until a release is announced on this channel (one pub/sub
        # connection per process), not polling every few ms; ``WOKEN_POLL_S`` still bounds
        # each sleep
        self.freed_channel = f"{self.key}:freed"
        self._hub = NoteHub(client, self.freed_channel) if woken else None
        self.limit = limit
        self.ttl_ms = ttl_ms
        self.max_backoff_s = max_backoff_s
        self.cooldown_ms = cooldown_ms
        self.quiet_ms = quiet_ms
        self.idle_ms = idle_ms
        self._clock: Clock | None = clock  # AIMD test hook; None: Redis TIME
        # The shared AIMD limit as last seen by this process (None: none set), once seen. It
        # lets ``on_success`` skip the Redis round trip while there is nothing to recover.
        self.seen_limit: int | None = None
        self._seen = False
        self.throttles = 0  # on_throttle calls
        self.decreases = 0  # ... that halved the shared limit
        self.increases = 0  # on_success calls that raised it
        self.lost = 0  # held slots found gone by their renewer

    def _note(self, dynamic: Any) -> int | None:
        value = int(dynamic)
        self.seen_limit = value if value >= 0 else None
        self._seen = True
        return self.seen_limit

    async def try_acquire(self, holder: str) -> bool:
        """Take a slot if one is free beyond those owed to queued waiters (never queues)."""
        return (await self._acquire(holder, None))[0]

    async def _acquire(self, holder: str, priority: int | None) -> tuple[bool, int]:
        """(acquired, waiters ahead); with a ``priority`` the holder joins the queue."""
        rank = "" if priority is None else min(max(int(priority), 0), MAX_PRIORITY)
        ok, dynamic, ahead = await self._s.sem_acquire(
            keys=[self.key, self.aimd_key, self.wait_key, self.wait_expiry_key],
            args=[holder, self.limit, self.ttl_ms, rank, WAIT_TTL_MS],
        )
        self._note(dynamic)
        return bool(ok), int(ahead)

    async def leave_queue(self, holder: str) -> None:
        """Give up a place in the queue (deadline, cancel): the next waiter moves up now."""
        await self._r.zrem(self.wait_key, holder)
        await self._r.zrem(self.wait_expiry_key, holder)

    async def release(self, holder: str) -> None:
        if await self._r.zrem(self.key, holder):
            await self.announce_release()

    async def announce_release(self) -> None:
        """Wake the queued turns (``woken``): a slot was freed. The worker's commit releases
        its slot in its own script and calls this after it only while slots are scarce (the
        turn waited, or its slot filled half of them), so an uncontended fleet pays
        no extra command per turn."""
        await self._r.publish(self.freed_channel, FREED)

    async def renew(self, holder: str) -> bool:
        """Push a held slot's expiry; False when the holder is no longer in the zset."""
        return bool(await self._s.sem_renew(keys=[self.key], args=[holder, self.ttl_ms]))

    def _now_arg(self) -> int | str:
        return self._clock() if self._clock is not None else ""

    async def holders(self) -> int:
        secs, micros = await self._r.time()
        await self._r.zremrangebyscore(self.key, "-inf", int(secs) * 1000 + int(micros) // 1000)
        return int(await self._r.zcard(self.key))

    async def effective_limit(self) -> int:
        """``min(limit, shared AIMD limit)``: how many slots the fleet may hold right now."""
        dynamic = self._note(await self._r.hget(self.aimd_key, "limit") or -1)
        return self.limit if dynamic is None else min(self.limit, dynamic)

    async def on_throttle(self) -> bool:
        """A 429/throttle was seen: halve the shared limit (once per cooldown); True if now."""
        self.throttles += 1
        halved, dynamic = await self._s.sem_throttle(
            keys=[self.aimd_key],
            args=[self.limit, self._now_arg(), self.cooldown_ms, self.idle_ms]
        )
        self._note(dynamic)
        if halved:
            self.decreases += 1
        return bool(halved)

    async def on_success(self) -> bool:
        """A call succeeded: +1 once ``quiet_ms`` passed since the last throttle and increase.

        No Redis call while the shared limit this process last saw (every ``try_acquire``
        refreshes it) was unset or at the cap: there is nothing to recover then, and a
        throttle since then starts a quiet period that forbids an increase anyway.
        """
        if self._seen and (self.seen_limit is None or self.seen_limit >= self.limit):
            return False
        increased, dynamic = await self._s.sem_success(
            keys=[self.aimd_key], args=[self.limit, self._now_arg(), self.quiet_ms, self.idle_ms]
        )
        self._note(dynamic)
        if increased:
            self.increases += 1
        return bool(increased)

    def ask(self) -> SlotAsk:
        """What a claim needs to take a slot in its own script (``BatchStore.claim_turn``)."""
        return SlotAsk(self.key, self.aimd_key, self.limit, self.ttl_ms, self.wait_key)

    def claimed(self, aimd_limit: int) -> None:
        """Note the shared AIMD limit a claim that asked for a slot saw."""
        self._note(aimd_limit)

    @contextlib.asynccontextmanager
    async def slot(self, ready: Callable[[], Awaitable[None]] | None = None, *,
                   deadline: float | None = None,
                   cancelled: CancelCheck | None = None, holder: str | None = None,
                   held: bool = False, keep: bool = False,
                   priority: int = 0) -> AsyncIterator[Slot]:
        """Hold one slot for the body; ``ready`` (backpressure) is awaited before each try.

        ``priority``: place in the fleet-wide queue while no slot is free (lower first: the
        turns the agent has left, as Celery's message priority). ``deadline``
        (``time.monotonic()``) bounds the wait: past it, ``ServerBusy``. ``cancelled()`` is
        asked every ``CANCEL_CHECK_S`` while waiting: ``BatchCancelled``. ``held``:
        ``holder`` already has the slot (a claim took it); ``keep``: leave it held on a
        normal exit, for the commit that follows to release in its own script (it is still
        released here when the body raises).
        """
        holder = holder or uuid.uuid4().hex
        next_check = time.monotonic() + CANCEL_CHECK_S
        queued = False
        ahead = 0
        try:
            while not held:
                if ready is not None:
                    await ready()
                freed = await self._hub.expect(FREED) if self._hub is not None else None
                try:
                    acquired, ahead = await self._acquire(holder, priority)
                    queued = not acquired
                    if acquired:
                        break
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        raise ServerBusy(f"no inference slot of {await self.effective_limit()}"
                                         f" (fleet-wide) was free before the turn's deadline")
                    if cancelled is not None and now >= next_check:
                        next_check = now + CANCEL_CHECK_S
                        if await cancelled():
                            raise BatchCancelled("the batch was cancelled")
                    await self._until_freed(freed, ahead)
                finally:
                    if freed is not None and self._hub is not None:
                        self._hub.forget(FREED, freed)
        except BaseException:
            if queued:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.leave_queue(holder))
            raise
        slot = Slot(holder)
        renewer = asyncio.create_task(self._renew(slot))
        released = False
        try:
            if held and ready is not None:
                await ready()  # the claim took the slot on the gate's last reading; ask now
            yield slot
        except BaseException:
            released = True
            renewer.cancel()
            await asyncio.shield(self.release(holder))
            raise
        finally:
            renewer.cancel()
            if not keep and not released:
                await asyncio.shield(self.release(holder))

    async def _until_freed(self, freed: asyncio.Future[None] | None, ahead: int) -> None:
        """Sleep until it is worth asking again. Woken: at the next announced release (those
        more than ``limit`` places back let that many releases go by first), at most
        ``WOKEN_POLL_S``. Polling: the first in line asks every few ms, the n-th n times
        less often, so a long queue costs Redis little."""
        if freed is None or self._hub is None:
            delay = min(POLL_S * (1 + ahead), self.max_backoff_s)
            await asyncio.sleep(random.uniform(delay / 2, delay))
            return
        deadline = time.monotonic() + max(self.max_backoff_s, WOKEN_POLL_S)
        releases = max(1, ahead - self.limit + 1)
        while releases > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(asyncio.shield(freed), left)
            if not freed.done():
                return
            releases -= 1
            if releases > 0:
                self._hub.forget(FREED, freed)
                freed = await self._hub.expect(FREED)

    async def _renew(self, held: Slot) -> None:
        """Keep the slot alive; notice (and report) when it is gone, and re-admit it."""
        counted = True  # the holder is in the zset, as far as we know
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            try:
                if counted:
                    if await self.renew(held.holder):
                        continue
                    counted = False
                    held.lost.set()
                    self.lost += 1
                    log.warning("inference slot %s of %s was lost (expired or evicted) while "
                                "held: this request runs uncounted until a slot is free",
                                held.holder, self.key)
                if await self.try_acquire(held.holder):  # only when the fleet has room
                    counted = True
                    held.readmitted += 1
                    log.info("lost inference slot %s of %s re-admitted", held.holder, self.key)
            except Exception as exc:  # Redis unreachable: the next round tries again
                log.debug("renewing slot %s failed: %s", held.holder, exc)
