"""Versioned agent state in Redis: every transition is one compare-and-set script call.

The version is the fencing token. A stale or duplicate task, or a worker whose lease lapsed,
fails the compare-and-set and its work is dropped, so a turn is never applied twice.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..model_io import ToolOutcome
from ..orchestrator.agent_state import AgentState, AgentStatus
from ..orchestrator.plan import BatchPlan
from .keys import ACTIVE_BATCHES, BatchKeys
from .scripts import Scripts

TOOL_RESULTS_TTL_S = 7 * 24 * 3600


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Claim:
    """The answer to "may I run this agent's turn at this version?"."""

    kind: str  # ok | stale | busy | gone
    state: AgentState | None = None
    cancelled: bool = False


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
        reply = await self.s.claim(keys=[k.ver, k.state, k.lease(index), k.watch, k.meta],
                                   args=[index, version, token, ttl_ms, now_ms()])
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
                     enqueue: Sequence[tuple[str, str]] = ()) -> bool:
        """Write ``new`` only if the stored version is still ``old.version``; on success push
        the ``enqueue`` task messages (list key, payload) in the same atomic step."""
        k = self.k
        terminal = new.status.terminal
        ok = await self.s.commit(
            keys=[k.ver, k.state, k.lease(old.index), k.watch, k.meta, k.results,
                  ACTIVE_BATCHES, k.audit, *(key for key, _ in enqueue)],
            args=[old.index, old.version, new.version, new.model_dump_json(), token,
                  old.status.value, new.status.value, "1" if terminal else "0", result_json,
                  deadline_ms, self.batch_id, "1" if audit else "0",
                  *(payload for _, payload in enqueue)],
        )
        return bool(ok)

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
        """Agents whose progress deadline has passed."""
        found = await self.r.zrangebyscore(self.k.watch, "-inf", now_ms(), start=0, num=limit)
        return [int(i) for i in found]

    async def inspect(self, index: int) -> tuple[AgentState | None, bool]:
        """(current state, lease held) for the recovery sweep."""
        k = self.k
        async with self.r.pipeline(transaction=False) as p:
            p.hget(k.state, index)
            p.exists(k.lease(index))
            raw, leased = await p.execute()
        return (AgentState.model_validate_json(raw) if raw else None), bool(leased)

    async def push_deadline(self, index: int, deadline_ms: int) -> None:
        await self.r.zadd(self.k.watch, {str(index): deadline_ms}, xx=True)



def initial_meta(plan: BatchPlan) -> dict[str, Any]:
    return {
        "total": plan.total,
        "delivered": 0,
        "cancelled": 0,
        "finished": 1 if plan.total == 0 else 0,
        f"n:{AgentStatus.NEEDS_MODEL.value}": plan.total,
        "created_at": plan.created_at,
    }
