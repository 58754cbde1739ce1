"""The recovery sweep: find agents whose next task was really lost and send it again.

An agent's progress deadline is pushed forward by every claim, lease renewal, running tool
call and commit. When it passes with no lease held, the sweep decides (``recovery.py``) from
what Redis shows:

- the agent's current version was *started* (a claim or a tool call marked it) and nothing
  committed or renewed since: its worker died mid-turn, so its task is re-sent at once;
- it was never started and its queue still holds messages: it is most likely still queued,
  so nothing is sent (re-sending would only pile duplicates onto a busy queue); when both
  queues hold messages, every such agent of the pass is looked at again later in one
  command, without reading its state (the started mark is the deadline's parity);
- it was never started and its queue is empty: the message is gone (a worker that had
  prefetched it died), so it is re-sent.

A re-send is one script (``resend.lua``) that checks the version and lease, pushes the
message, moves the deadline and counts it, so nothing is counted that was not sent. An agent
re-sent ``max_resends`` times at one version without progress is ended with an ``internal``
error: no bug can make the fleet loop on it forever. Each batch is swept on its own; one
that fails is logged and the others are still swept. One sweeper runs at a time, fleet-wide,
under a Redis lock.
"""

from __future__ import annotations

import logging
import uuid

from ..orchestrator.agent_state import AgentState, AgentStatus
from ..orchestrator.turns import Abandoned, step
from ..state.keys import ACTIVE_BATCHES, SWEEP_LOCK, WATCH, BatchKeys
from ..state.redis_store import deadline_score, due_marked, now_ms
from .app import INFERENCE_QUEUE, PRIORITY_STEPS, TOOLS_QUEUE
from .app import app as celery_app
from .context import LoadedBatch, WorkerContext
from .dispatch import envelopes, followups_for
from .envelope import queue_key
from .steps import commit, finish_tools

log = logging.getLogger(__name__)


async def sweep_once(ctx: WorkerContext, *, limit: int = 500) -> int:
    """One pass over the agents due (at most ``limit``, earliest first, whatever batch they
    belong to); returns how many tasks were re-sent. Its cost is O(agents due): the deadlines
    of every batch live in one zset, so 500 idle active batches cost nothing."""
    token = uuid.uuid4().hex
    lock_ms = int(max(ctx.settings.sweep_interval_s * 3, 5) * 1000)
    if not await ctx.redis.set(SWEEP_LOCK, token, nx=True, px=lock_ms):
        return 0
    try:
        due = await due_marked(ctx.redis, limit)
        if not due:
            return 0
        waiting = await _queue_waiting(ctx)
        if all(waiting.values()):
            due = await _still_queued_later(ctx, due)
        by_batch: dict[str, list[int]] = {}
        for batch_id, index, _ in due:
            by_batch.setdefault(batch_id, []).append(index)
        sent = 0
        for batch_id, indices in by_batch.items():
            try:
                sent += await _sweep_batch(ctx, batch_id, indices, waiting)
            except Exception:  # one bad batch never stops the recovery of the others
                log.exception("sweeping batch %s failed; the other batches are swept", batch_id)
        return sent
    finally:
        await ctx.scripts.release(keys=[SWEEP_LOCK], args=[token])


async def _still_queued_later(ctx: WorkerContext,
                              due: list[tuple[str, int, bool]]) -> list[tuple[str, int, bool]]:
    """With messages waiting on both queues, an agent whose version was never started is
    still queued, most likely (what ``_sweep_batch`` would conclude after reading its state,
    lease and mark: four commands each): look at all of them again a queue grace later in
    one command. A big batch queued longer than the grace no longer costs the sweep a read
    per agent per pass. Returns the agents still to look at one by one."""
    queued = [BatchKeys(b).member(i) for b, i, started in due if not started]
    if queued:
        later = deadline_score(now_ms() + ctx.settings.queue_grace_ms, started=False)
        await ctx.redis.zadd(WATCH, dict.fromkeys(queued, later), xx=True)
    return [row for row in due if row[2]]


async def _queue_waiting(ctx: WorkerContext) -> dict[str, int]:
    """Messages waiting on each queue (all priority lists), read once per pass."""
    async with ctx.redis.pipeline(transaction=False) as p:
        for queue in (INFERENCE_QUEUE, TOOLS_QUEUE):
            for pri in PRIORITY_STEPS:
                p.llen(queue_key(queue, pri))
        lengths = await p.execute()
    n = len(PRIORITY_STEPS)
    return {INFERENCE_QUEUE: sum(lengths[:n]), TOOLS_QUEUE: sum(lengths[n:])}


async def _sweep_batch(ctx: WorkerContext, batch_id: str, indices: list[int],
                       waiting: dict[str, int]) -> int:
    loaded = await ctx.batch(batch_id)
    if loaded is None:
        keys = BatchKeys(batch_id)
        members = [keys.member(i) for i in indices]
        if await ctx.redis.exists(keys.state):  # still being submitted: look again later
            later = deadline_score(now_ms() + ctx.settings.queue_grace_ms, started=False)
            await ctx.redis.zadd(WATCH, dict.fromkeys(members, later), xx=True)
            return 0
        await ctx.redis.zrem(WATCH, *members)  # deleted or expired under its agents
        await ctx.redis.srem(ACTIVE_BATCHES, batch_id)
        return 0
    store = loaded.store
    sent = 0
    for index in indices:
        state, leased, started = await store.inspect(index)
        if state is None or state.terminal:
            await store.unwatch(index)
            continue
        if leased:  # a live worker holds it; look again when the lease would have run out
            await store.push_deadline(index, now_ms() + ctx.settings.lease_ttl_ms, started=True)
            continue
        queue = TOOLS_QUEUE if state.status is AgentStatus.AWAITING_TOOLS else INFERENCE_QUEUE
        if not started and waiting[queue] > 0:
            # Never started and its queue is busy: still queued, most likely. Look again later.
            await store.push_deadline(index, now_ms() + ctx.settings.queue_grace_ms,
                                      started=False)
            continue
        sent += await _resend(ctx, loaded, state)
    if sent:
        log.warning("sweep re-sent %d task(s) for batch %s", sent, batch_id)
    return sent


async def _resend(ctx: WorkerContext, loaded: LoadedBatch, state: AgentState) -> int:
    store = loaded.store
    skip: list[str] = []
    if state.status is AgentStatus.AWAITING_TOOLS:
        outcomes = await store.tool_outcomes(state.index, state.version)
        if all(c.id in outcomes for c in state.pending_calls):
            await finish_tools(ctx, loaded, state, outcomes)  # its completer died: finish it
            return 0
        skip = list(outcomes)
    followups = followups_for(loaded.plan.batch_id, loaded.policy, state, skip_calls=skip)
    if not followups:
        return 0
    n = await store.resend(state, envelopes(celery_app, followups),
                           recheck_ms=ctx.settings.lease_ttl_ms,
                           max_resends=ctx.settings.max_resends, audit=ctx.settings.audit)
    if n == -2:
        reason = (f"the agent's turn was re-sent {ctx.settings.max_resends} times without "
                  "progress (a worker died or failed on it each time); giving up on it")
        log.error("agent %s of batch %s: %s", state.index, loaded.plan.batch_id, reason)
        await commit(ctx, loaded, state, step(loaded.policy, state, Abandoned("internal",
                                                                               reason)))
        return 0
    if n > 0:
        ctx.stats["recovered"] += 1
        return len(followups)
    return 0
