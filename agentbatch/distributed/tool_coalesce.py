"""Fleet-wide coalescing and caching of tool calls through Redis.

Identical calls on any worker run once: the first caller takes a lock keyed by the call,
runs it, stores the outcome briefly and publishes a note; the others wait on that note
(pub/sub, no polling). A leader that dies stops renewing its lock; when it expires a waiter
takes over, so no call waits forever.

That makes execution at-least-once: a leader that was only paused (GC, SIGSTOP, VM freeze)
past its lock wakes up still running. Taking the lock also takes the next fencing token
(``INCR`` on a per-call counter), and ``RedisLease.still_held`` checks the lock, so the tool
can tell it has been superseded (see ``ToolContext.still_leader``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import uuid
from typing import Any

from agentbatch.core.errors import ToolError
from agentbatch.core.wait_for import wait_for
from agentbatch.distributed.state.keys import (
    TOOL_DONE_CHANNEL,
    tool_cache,
    tool_fence,
    tool_hash,
    tool_lock,
    tool_result,
)
from agentbatch.distributed.state.note_hub import NoteHub
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.toolpool.coalesce import Thunk

log = logging.getLogger(__name__)


def key_hash(key: str) -> str:
    """Where one call's keys live (``tool_hash``): under its batch unless fleet-shared."""
    return tool_hash(_batch_of(key), hashlib.sha1(key.encode()).hexdigest())


_CALL_SCOPE = re.compile(r"call:(.*?):\d+:\d+:")  # ToolContext's "<batch>:<agent>:<turn>:<id>"


def _batch_of(key: str) -> str | None:
    """The batch a ``ToolPool.call_key`` belongs to, or None for a fleet-shared call (or a
    key of another shape)."""
    try:
        scope = json.loads(key)[0]
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    if not isinstance(scope, str):
        return None
    if scope.startswith("batch:"):
        return scope[len("batch:"):]
    call = _CALL_SCOPE.match(scope)
    return call.group(1) if call else None


class RedisLease:
    """Leadership of one call: the lock, our token in it and the fencing token taken with it
    (here for a shared call; by ``tool_start.lua`` for an unshared one)."""

    def __init__(self, client: Any, lock: str, token: str, fencing_token: int) -> None:
        self._r = client
        self.lock = lock
        self.token = token
        self.fencing_token = fencing_token
        self.lost = False  # set when a renewal found the lock gone or taken

    async def still_held(self) -> bool:
        """Whether the lock still carries our token (asks Redis: a pause is invisible here)."""
        held = await self._r.get(self.lock) == self.token
        self.lost |= not held
        return held


class RedisCoalescer:
    """Implements the ``Coalescer`` protocol across every worker sharing one Redis."""

    def __init__(self, client: Any, scripts: Scripts, hub: NoteHub, *,
                 lock_ttl_ms: int = 30_000, result_ttl_s: int = 120) -> None:
        self._r = client
        self._s = scripts
        self._hub = hub
        self.lock_ttl_ms = lock_ttl_ms  # default; a tool's ``lock_ttl`` overrides it per call
        self.result_ttl_s = result_ttl_s

    async def run(self, key: str, thunk: Thunk, *,
                  lock_ttl: float | None = None) -> tuple[str, bool]:
        h = key_hash(key)
        token = uuid.uuid4().hex
        ttl_ms = self.lock_ttl_ms if lock_ttl is None else max(int(lock_ttl * 1000), 1)
        while True:
            lead, leader, pttl, fence = await self._s.tool_lead(
                keys=[tool_lock(h), tool_fence(h)], args=[token, ttl_ms])
            if int(lead) == 1:
                lease = RedisLease(self._r, tool_lock(h), token, int(fence))
                return await self._lead(h, lease, ttl_ms, thunk), False
            if not leader:
                continue  # the lock vanished between SET and GET: try again
            payload = await self._wait(h, leader, max(int(pttl), 100), ttl_ms)
            if payload is not None:
                if payload["ok"]:
                    return payload["text"], True
                raise ToolError(payload["error"])
            # the leader's lock expired without an outcome: it died or stalled; try to lead

    async def _lead(self, h: str, lease: RedisLease, ttl_ms: int, thunk: Thunk) -> str:
        # The shared run is its own task: a leader whose caller is cancelled must not
        # cancel the run for the other workers' waiters.
        task = asyncio.ensure_future(self._lead_run(h, lease, ttl_ms, thunk))
        return await asyncio.shield(task)

    async def _lead_run(self, h: str, lease: RedisLease, ttl_ms: int, thunk: Thunk) -> str:
        token = lease.token
        renewer = asyncio.create_task(self._renew(h, lease, ttl_ms))
        payload: dict[str, Any] = {"ok": False,
                                   "error": "the shared tool execution was interrupted"}
        try:
            text = await thunk(lease)
            payload = {"ok": True, "text": text}
            return text
        except ToolError as exc:
            payload = {"ok": False, "error": str(exc)}
            raise
        finally:
            renewer.cancel()
            await asyncio.shield(self._finish(h, token, payload))

    async def _finish(self, h: str, token: str, payload: dict[str, Any]) -> None:
        """Publish the outcome; a lock found no longer ours (checked in the same script,
        after the run: the renewer stopped before it could notice) is logged at ERROR."""
        held = await self._s.tool_finish(
            keys=[tool_lock(h), tool_result(h, token)],
            args=[token, json.dumps(payload), self.result_ttl_s, TOOL_DONE_CHANNEL,
                  f"{h}:{token}"],
        )
        if not int(held):
            log.error("shared tool call %s: the lock was lost while it ran; another worker "
                      "took it over and may have run it too", h[:12])

    async def _renew(self, h: str, lease: RedisLease, ttl_ms: int) -> None:
        """Keep the lock while the tool runs; a lock found lost is logged, never re-taken."""
        while not lease.lost:
            await asyncio.sleep(ttl_ms / 3000)
            try:
                held = await self._s.lock_renew(keys=[tool_lock(h)], args=[lease.token, ttl_ms])
            except Exception:  # a Redis blip: the next renewal may still be in time
                log.warning("tool lock renewal failed", exc_info=True)
                continue
            if not int(held):
                lease.lost = True
                log.warning("tool call %s: lock lost while running (fencing token %d); "
                            "another worker may run it too", h[:12], lease.fencing_token)

    async def _wait(self, h: str, leader: str, pttl_ms: int,
                    ttl_ms: int) -> dict[str, Any] | None:
        note = f"{h}:{leader}"
        fut = await self._hub.expect(note)  # subscribe before looking: no lost wake-up
        try:
            raw = await self._r.get(tool_result(h, leader))
            if raw is None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await wait_for(asyncio.shield(fut), pttl_ms / 1000 + 0.5)
                raw = await self._r.get(tool_result(h, leader))
                if raw is None and await self._r.get(tool_lock(h)) == leader:
                    return await self._wait(h, leader, ttl_ms, ttl_ms)  # renewed: keep waiting
        finally:
            self._hub.forget(note, fut)
        return json.loads(raw) if raw else None


class RedisResultCache:
    """``ResultCache`` for cacheable tools, shared by the fleet, with a TTL per entry."""

    def __init__(self, client: Any) -> None:
        self._r = client

    async def get(self, key: str) -> str | None:
        return await self._r.get(tool_cache(key_hash(key)))

    async def set(self, key: str, value: str, ttl: float | None = None) -> None:
        px = max(int(ttl * 1000), 1) if ttl else None
        await self._r.set(tool_cache(key_hash(key)), value, px=px)
