"""The recovery sweep: find agents whose next task was lost and send it again.

An agent's progress deadline is pushed forward by every claim, lease renewal and commit. When
it passes with no lease held, the agent's worker died mid-turn or its follow-up never reached
the queue; the sweep re-sends what the state machine says comes next. A duplicate is harmless:
the version check drops it. One sweeper runs at a time, fleet-wide, under a Redis lock.
"""

from __future__ import annotations

import logging
import uuid

from ..orchestrator.agent_state import AgentStatus
from ..state.keys import ACTIVE_BATCHES, SWEEP_LOCK
from ..state.redis_store import now_ms
from .context import WorkerContext
from .dispatch import Followup, followups_for
from .steps import finish_tools

log = logging.getLogger(__name__)


async def sweep_once(ctx: WorkerContext, *, limit: int = 500) -> list[Followup]:
    token = uuid.uuid4().hex
    lock_ms = int(max(ctx.settings.sweep_interval_s * 3, 5) * 1000)
    if not await ctx.redis.set(SWEEP_LOCK, token, nx=True, px=lock_ms):
        return []
    try:
        followups: list[Followup] = []
        for batch_id in await ctx.redis.smembers(ACTIVE_BATCHES):
            followups += await _sweep_batch(ctx, batch_id, limit)
        return followups
    finally:
        await ctx.scripts.release(keys=[SWEEP_LOCK], args=[token])


async def _sweep_batch(ctx: WorkerContext, batch_id: str, limit: int) -> list[Followup]:
    loaded = await ctx.batch(batch_id)
    if loaded is None:
        await ctx.redis.srem(ACTIVE_BATCHES, batch_id)
        return []
    store = loaded.store
    followups: list[Followup] = []
    for index in await store.due(limit):
        state, leased = await store.inspect(index)
        if state is None or state.terminal:
            await ctx.redis.zrem(store.k.watch, index)
            continue
        if leased:  # a live worker holds it; look again when the lease would have run out
            await store.push_deadline(index, now_ms() + ctx.settings.lease_ttl_ms)
            continue
        skip: list[str] = []
        if state.status is AgentStatus.AWAITING_TOOLS:
            outcomes = await store.tool_outcomes(index, state.version)
            if all(c.id in outcomes for c in state.pending_calls):
                followups += await finish_tools(ctx, loaded, state)
                continue
            skip = list(outcomes)
        followups += followups_for(batch_id, loaded.policy, state, skip_calls=skip)
        # Back off per agent while it makes no progress: if nothing consumes the queue (all
        # workers of that kind down), re-sending every grace period would only pile
        # duplicates onto it. Progress (a new version) starts the count again.
        resends = await _count_resend(ctx, store.k.resends, index, state.version)
        backoff = ctx.settings.queue_grace_ms * 2 ** min(resends - 1, 5)
        await store.push_deadline(index, now_ms() + backoff)
        await ctx.note(batch_id, "recovered")
    if followups:
        log.warning("sweep re-sent %d task(s) for batch %s", len(followups), batch_id)
    return followups


async def _count_resend(ctx: WorkerContext, key: str, index: int, version: int) -> int:
    """Re-sends of this agent at this version, this one included."""
    previous = await ctx.redis.hget(key, str(index))
    seen_version, _, count = (previous or "").partition(":")
    resends = int(count) + 1 if seen_version == str(version) and count else 1
    await ctx.redis.hset(key, str(index), f"{version}:{resends}")
    return resends
