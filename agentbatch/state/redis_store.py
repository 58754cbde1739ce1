"""Versioned agent state in Redis: every transition is one compare-and-set script call.

The version is the fencing token. A stale or duplicate task, or a worker whose lease lapsed,
fails the compare-and-set and its work is dropped, so a turn is never applied twice.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..model_io import ToolOutcome
from ..orchestrator.agent_state import AgentState, AgentStatus
from ..orchestrator.plan import BatchPlan
from .keys import ACTIVE_BATCHES, TOMBSTONE_S, BatchKeys
from .scripts import Scripts

TOOL_RESULTS_TTL_S = 7 * 24 * 3600  # a backstop: the commit that consumes a round deletes it
DEFAULT_RETENTION_S = 7 * 24 * 3600.0  # AGENTBATCH_RETENTION_S (workers/settings.py)


CLOCK_RESYNC_S = 60.0  # how long a process carries Redis's time forward on its own
_clock: tuple[float, float] | None = None  # (Redis ms, time.monotonic()) at the last sync


def now_ms() -> int:
    """Redis's clock (TIME) as of the last ``sync_clock``, carried forward by this process's
    monotonic clock; the wall clock only before the first sync.

    Progress deadlines (the watch zset) are written by one worker and compared by another (the
    sweep): with each worker's wall clock, one running 31 s ahead re-sent live agents as lost
    or hid a dead worker's agent for 31 s more. One process talks to one Redis, so one offset.
    """
    if _clock is None:
        return int(time.time() * 1000)
    base_ms, base_mono = _clock
    return int(base_ms + (time.monotonic() - base_mono) * 1000)


def note_redis_time(reply: Any, sent_mono: float) -> None:
    """Adopt a ``TIME`` reply (seconds, microseconds) sent at ``sent_mono`` as our clock."""
    global _clock
    secs, micros = reply
    received = time.monotonic()
    _clock = (int(secs) * 1000 + int(micros) / 1000, (sent_mono + received) / 2)


async def sync_clock(client: Any, *, force: bool = False) -> None:
    """Ask Redis for the time unless we did less than ``CLOCK_RESYNC_S`` ago."""
    if not force and _clock is not None and time.monotonic() - _clock[1] < CLOCK_RESYNC_S:
        return
    sent = time.monotonic()
    note_redis_time(await client.time(), sent)


def sync_clock_blocking(client: Any) -> None:
    """``sync_clock`` for a synchronous client (the submitting process), always."""
    sent = time.monotonic()
    note_redis_time(client.time(), sent)


@dataclass(frozen=True)
class Claim:
    """The answer to "may I run this agent's turn at this version?"."""

    kind: str  # ok | stale | busy | gone
    state: AgentState | None = None
    cancelled: bool = False
    busy_ms: int = 0  # busy: how long the other holder's lease still lives


class BatchStore:
    """One batch's state, through an async Redis client (worker side)."""

    def __init__(self, client: Any, scripts: Scripts, batch_id: str) -> None:
        self.r = client
        self.s = scripts
        self.k = BatchKeys(batch_id)
        self.batch_id = batch_id

    async def load_plan(self) -> BatchPlan | None:
        raw = await self.r.get(self.k.plan)
        return BatchPlan.model_validate_json(raw) if raw else None

    async def claim_turn(self, index: int, version: int, token: str, ttl_ms: int) -> Claim:
        k = self.k
        await sync_clock(self.r)
        reply = await self.s.claim(keys=[k.ver, k.state, k.lease(index), k.watch, k.meta, k.run],
                                   args=[index, version, token, ttl_ms, now_ms()])
        if reply[0] == "busy":
            return Claim(kind="busy", busy_ms=max(int(reply[1]), 0))
        if reply[0] != "ok":
            return Claim(kind=reply[0])
        state = AgentState.model_validate_json(reply[1])
        return Claim(kind="ok", state=state, cancelled=reply[2] == "1")

    async def renew(self, index: int, token: str, ttl_ms: int) -> bool:
        return bool(await self.s.renew(keys=[self.k.lease(index), self.k.watch],
                                       args=[token, ttl_ms, now_ms(), index]))

    async def release(self, index: int, token: str) -> None:
        await self.s.release(keys=[self.k.lease(index)], args=[token])

    async def commit(self, old: AgentState, new: AgentState, *, token: str = "",
                     result_json: str = "", deadline_ms: int = 0, audit: bool = False,
                     enqueue: Sequence[tuple[str, str]] = (),
                     retention_s: float = DEFAULT_RETENTION_S) -> bool:
        """Write ``new`` only if the stored version is still ``old.version``; on success push
        the ``enqueue`` task messages (list key, payload) in the same atomic step.

        A terminal agent is stored without its conversation (its result, written in the same
        step, is what readers get); the commit that finishes the batch sets its retention
        TTL (``retention_s`` only for a batch submitted without one)."""
        k = self.k
        terminal = new.status.terminal
        stored = terminal_state(new) if terminal else new
        ok = await self.s.commit(
            keys=[k.ver, k.state, k.lease(old.index), k.watch, k.meta, k.results,
                  ACTIVE_BATCHES, k.audit, k.resends, k.plan, k.run,
                  k.tool_results(old.index, old.version), k.gone,
                  *(key for key, _ in enqueue)],
            args=[old.index, old.version, new.version, stored.model_dump_json(), token,
                  old.status.value, new.status.value, "1" if terminal else "0", result_json,
                  deadline_ms, self.batch_id, "1" if audit else "0",
                  retention_ms(retention_s), TOMBSTONE_S * 1000,
                  *(payload for _, payload in enqueue)],
        )
        return bool(ok)

    async def cancelled(self) -> bool:
        """Whether the batch was cancelled (asked by turns waiting for capacity)."""
        return await self.r.hget(self.k.meta, "cancelled") == "1"

    async def load_for_tool(self, index: int, version: int,
                            call_id: str) -> tuple[AgentState | None, bool, bool]:
        """(state if still at ``version``, outcome already recorded, batch cancelled)."""
        k = self.k
        async with self.r.pipeline(transaction=False) as p:
            p.hget(k.ver, index)
            p.hget(k.state, index)
            p.hexists(k.tool_results(index, version), call_id)
            p.hget(k.meta, "cancelled")
            ver, raw, have, cancelled = await p.execute()
        if ver is None or int(ver) != version or raw is None:
            return None, bool(have), cancelled == "1"
        return AgentState.model_validate_json(raw), bool(have), cancelled == "1"

    async def record_tool(self, index: int, version: int, outcome: ToolOutcome,
                          expected: int) -> dict[str, ToolOutcome] | int:
        """Every outcome of the round once all ``expected`` are recorded; else how many are
        (-1 if the agent moved on)."""
        k = self.k
        reply = await self.s.record_tool(
            keys=[k.ver, k.tool_results(index, version)],
            args=[index, version, outcome.call_id, outcome.model_dump_json(), TOOL_RESULTS_TTL_S,
                  expected],
        )
        if isinstance(reply, list):
            return {reply[i]: ToolOutcome.model_validate_json(reply[i + 1])
                    for i in range(0, len(reply), 2)}
        return int(reply)

    async def tool_outcomes(self, index: int, version: int) -> dict[str, ToolOutcome]:
        raw = await self.r.hgetall(self.k.tool_results(index, version))
        return {cid: ToolOutcome.model_validate_json(v) for cid, v in raw.items()}

    async def due(self, limit: int = 200) -> list[int]:
        """Agents whose progress deadline has passed (by Redis's clock)."""
        await sync_clock(self.r)
        found = await self.r.zrangebyscore(self.k.watch, "-inf", now_ms(), start=0, num=limit)
        return [int(i) for i in found]

    async def inspect(self, index: int) -> tuple[AgentState | None, bool, bool]:
        """(current state, lease held, current version started) for the recovery sweep."""
        k = self.k
        async with self.r.pipeline(transaction=False) as p:
            p.hget(k.state, index)
            p.exists(k.lease(index))
            p.hget(k.run, index)
            raw, leased, run = await p.execute()
        state = AgentState.model_validate_json(raw) if raw else None
        started = state is not None and run is not None and int(run) == state.version
        return state, bool(leased), started

    async def resend(self, state: AgentState, enqueue: Sequence[tuple[str, str]], *,
                     recheck_ms: int, max_resends: int, audit: bool = False) -> int:
        """Push a lost agent's task messages, count the re-send and move its deadline, in one
        script. Returns -1 (moved on or leased: nothing sent), -2 (``max_resends`` reached:
        nothing sent) or the number of re-sends at this version."""
        k = self.k
        return int(await self.s.resend(
            keys=[k.ver, k.lease(state.index), k.watch, k.resends, k.run, k.meta, k.audit,
                  *(key for key, _ in enqueue)],
            args=[state.index, state.version, now_ms(), recheck_ms, max_resends,
                  "1" if audit else "0", *(payload for _, payload in enqueue)],
        ))

    async def tool_running(self, index: int, version: int, ttl_ms: int) -> bool:
        """A tool call of this round runs: mark the version started, deadline now + ttl."""
        await sync_clock(self.r)
        return bool(await self.s.tool_touch(keys=[self.k.ver, self.k.watch, self.k.run],
                                            args=[index, version, now_ms() + ttl_ms]))

    async def push_deadline(self, index: int, deadline_ms: int) -> None:
        await self.r.zadd(self.k.watch, {str(index): deadline_ms}, xx=True)



def retention_ms(retention_s: float) -> int:
    return max(1, math.ceil(retention_s * 1000))


def terminal_state(state: AgentState) -> AgentState:
    """What a terminal agent keeps in ``state``: its scalars and error, not its conversation,
    pending calls or tool log. The result stream entry written in the same commit holds
    everything a reader gets; the state only answers claims and the sweep (``terminal``)."""
    return state.model_copy(update={"messages": [], "pending_calls": [], "tool_log": []})


def initial_meta(plan: BatchPlan, retention_s: float = DEFAULT_RETENTION_S) -> dict[str, Any]:
    return {
        "total": plan.total,
        "delivered": 0,
        "cancelled": 0,
        "finished": 1 if plan.total == 0 else 0,
        f"n:{AgentStatus.NEEDS_MODEL.value}": plan.total,
        "created_at": plan.created_at,
        "retention_ms": retention_ms(retention_s),
    }
