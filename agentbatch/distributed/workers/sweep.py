"""The recovery sweep: find agents whose next task was really lost and send it again.

An agent's progress deadline is pushed forward by every claim, lease renewal, running tool
call and commit. When it passes with no lease held, the sweep decides (``recovery.py``) from
what Redis shows:

- the agent's current version was *started* (a claim or a tool call recorded it in the
  batch's ``started`` hash) and nothing
  committed or renewed since: its worker died mid-turn, so its task is re-sent at once;
- it was never started and its queue still holds messages: it is most likely still queued,
  so it is let wait once per version, ``QUEUED_GRACES - 1`` more queue graces (one script
  call per batch, ``defer.lua``, which records the version it let wait). Found due again at
  the same version, it is re-sent: a message lost while other batches keep the queue busy
  is re-sent ``QUEUED_GRACES`` x the queue grace after its commit at the latest. If it was
  only queued after all, the copy that runs second is dropped as stale or busy;
- it was never started and its queue is empty: the message is gone (a worker that had
  prefetched it died), so it is re-sent;
- its state entry cannot be read (written by another version, or damaged): it can never
  run, so it is ended with an ``internal`` error (``steps.end_damaged``);
- its batch's plan cannot be read by this worker (``WorkerContext.unreadable_batch``):
  workers like this one drop its tasks unclaimed, so they look lost and are re-sent, for a
  worker that can read it, until the ``max_resends`` cap ends the agent with kind ``config``
  (with the defaults, about 127 leases after its last progress).

A re-send is one script (``resend.lua``) that checks the version and lease, pushes the
message, moves the deadline and counts it, so nothing is counted that was not sent. An agent
re-sent ``max_resends`` times at one version without progress is ended with an ``internal``
error: no bug can make the fleet loop on it forever. Each batch, and each agent, is swept on
its own: one that fails is logged, its deadline moves on (so it is retried later, and the
``max_resends`` cap still counts), and the others are still swept.

One sweeper runs at a time, fleet-wide, under a Redis lock renewed while its pass runs. Should
the lock lapse anyway (a paused process), the pass is fenced per agent: a re-send carries the
deadline the sweep read, and ``resend.lua`` sends nothing if another sweeper moved it since.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.turns import Abandoned, step
from agentbatch.distributed.state.damaged import placeholder_state
from agentbatch.distributed.state.keys import ACTIVE_BATCHES, SWEEP_LOCK, WATCH, BatchKeys
from agentbatch.distributed.state.redis_store import BatchStore, Inspection, due_agents, now_ms
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS, TOOLS_QUEUE
from agentbatch.distributed.workers.app import app as celery_app
from agentbatch.distributed.workers.context import LoadedBatch, WorkerContext
from agentbatch.distributed.workers.dispatch import envelopes, followups_for
from agentbatch.distributed.workers.envelope import queue_key
from agentbatch.distributed.workers.steps import commit, end_damaged, finish_tools

log = logging.getLogger(__name__)

QUEUED_GRACES = 3
"""A never-started agent whose queue stays busy is re-sent at the latest this many queue
graces after its commit (the first look, then one wait of the rest): a lost message is not
held up by other batches' load for ever, and an agent only queued that long gets one cheap
duplicate (the copy that runs second is dropped as stale or busy)."""


async def sweep_once(ctx: WorkerContext, *, limit: int = 500) -> int:
    """One pass over the agents due (at most ``limit``, earliest first, whatever batch they
    belong to); returns how many tasks were re-sent. Its cost is O(agents due): the deadlines
    of every batch live in one zset, so 500 idle active batches cost nothing."""
    token = uuid.uuid4().hex
    lock_ms = int(max(ctx.settings.sweep_interval_s * 3, 5) * 1000)
    if not await ctx.redis.set(SWEEP_LOCK, token, nx=True, px=lock_ms):
        return 0
    try:
        async with _lock_renewal(ctx, token, lock_ms):
            return await _sweep_due(ctx, limit)
    finally:
        await ctx.scripts.release(keys=[SWEEP_LOCK], args=[token])


@contextlib.asynccontextmanager
async def _lock_renewal(ctx: WorkerContext, token: str, lock_ms: int) -> AsyncIterator[None]:
    """Keep the sweep lock while the pass runs, however long it takes: another sweeper
    starting mid-pass would look at the same agents (the re-send fence still holds if the
    renewal itself stalls)."""
    async def renew() -> None:
        while True:
            await asyncio.sleep(lock_ms / 3000)
            try:
                if not await ctx.scripts.lock_renew(keys=[SWEEP_LOCK], args=[token, lock_ms]):
                    log.warning("sweep lock lost mid-pass; its re-sends are fenced")
                    return
            except Exception:  # a Redis blip: the next renewal may still be in time
                log.debug("sweep lock renewal failed", exc_info=True)

    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        task.cancel()


async def _sweep_due(ctx: WorkerContext, limit: int) -> int:
    """The pass itself, under the lock."""
    due = await due_agents(ctx.redis, limit)
    if not due:
        return 0
    waiting = await _queue_waiting(ctx)
    if all(waiting.values()):
        due = await _still_queued_later(ctx, due)
    by_batch: dict[str, list[int]] = {}
    for batch_id, index in due:
        by_batch.setdefault(batch_id, []).append(index)
    sent = 0
    for batch_id, indices in by_batch.items():
        try:
            sent += await _sweep_batch(ctx, batch_id, indices, waiting)
        except Exception:  # one bad batch never stops the recovery of the others
            log.exception("sweeping batch %s failed; the other batches are swept", batch_id)
    return sent


async def _still_queued_later(ctx: WorkerContext,
                              due: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """With messages waiting on both queues, an agent whose version was never started is
    still queued, most likely (what ``_sweep_batch`` would conclude after reading its state,
    lease and started mark: five commands each): let each wait once per version, in one
    script call per batch (``defer.lua``, which reads the started marks itself). A big batch
    queued longer than the grace no longer costs the sweep a read per agent per pass.
    Returns the agents still to look at one by one: the started ones, and those already let
    wait at their version."""
    by_batch: dict[str, list[int]] = {}
    for batch_id, index in due:
        by_batch.setdefault(batch_id, []).append(index)
    again: set[tuple[str, int]] = set()
    for batch_id, indices in by_batch.items():
        store = BatchStore(ctx.redis, ctx.scripts, batch_id)
        again.update((batch_id, i) for i in await store.defer(indices, _deferred_until(ctx)))
    return [row for row in due if row in again]


def _deferred_until(ctx: WorkerContext) -> int:
    """Where a never-started agent's deadline goes when it is let wait on a busy queue."""
    return now_ms() + (QUEUED_GRACES - 1) * ctx.settings.queue_grace_ms


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
    # a plan this worker cannot read: its dropped tasks are re-sent (for a worker that can)
    # until the re-send cap ends the agents with kind ``config`` (``_resend``)
    loaded = await ctx.batch(batch_id) or await ctx.unreadable_batch(batch_id)
    if loaded is None:
        keys = BatchKeys(batch_id)
        members = [keys.member(i) for i in indices]
        if await ctx.redis.exists(keys.state):  # still being submitted: look again later
            later = now_ms() + ctx.settings.queue_grace_ms
            await ctx.redis.zadd(WATCH, dict.fromkeys(members, later), xx=True)
            return 0
        await ctx.redis.zrem(WATCH, *members)  # deleted or expired under its agents
        await ctx.redis.srem(ACTIVE_BATCHES, batch_id)
        return 0
    sent = 0
    wait: list[int] = []
    for index in indices:
        try:
            sent += await _sweep_agent(ctx, loaded, index, waiting, wait)
        except Exception:  # one bad agent never stops the sweep of the others
            log.exception("sweeping agent %s of batch %s failed; looking again later", index,
                          batch_id)
            with contextlib.suppress(Exception):  # a moved deadline: no hot loop on it
                await loaded.store.push_deadline(index, now_ms() + ctx.settings.queue_grace_ms)
    if wait:
        await loaded.store.defer(wait, _deferred_until(ctx))
    if sent:
        log.warning("sweep re-sent %d task(s) for batch %s", sent, batch_id)
    return sent


async def _sweep_agent(ctx: WorkerContext, loaded: LoadedBatch, index: int,
                       waiting: dict[str, int], wait: list[int]) -> int:
    """Decide for one due agent; returns the tasks re-sent. Appends to ``wait`` an agent to
    let wait on its busy queue (``defer``, once per batch)."""
    store = loaded.store
    seen: Inspection = await store.inspect(index)
    state = seen.state
    if not seen.damage and (state is None or state.terminal):
        await store.unwatch(index)
        return 0
    if seen.score is not None and seen.score > now_ms():
        return 0  # its deadline moved since the pass read it: not due (any more)
    if seen.leased:  # a live worker holds it; look again when the lease would have run out
        await store.push_deadline(index, now_ms() + ctx.settings.lease_ttl_ms)
        return 0
    if seen.damage:  # it cannot run anywhere: end it, or its batch never finishes
        await end_damaged(ctx, loaded, placeholder_state(index, seen.entry), seen.damage)
        return 0
    if state is None:  # gone (handled above); for the type checker
        return 0
    queue = TOOLS_QUEUE if state.status is AgentStatus.AWAITING_TOOLS else INFERENCE_QUEUE
    if not seen.started and waiting[queue] > 0 and not seen.deferred:
        wait.append(index)  # never started, queue busy: still queued, most likely
        return 0
    return await _resend(ctx, loaded, state, seen.score)


async def _resend(ctx: WorkerContext, loaded: LoadedBatch, state: AgentState,
                  seen_score: int | None) -> int:
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
                           max_resends=ctx.settings.max_resends, audit=ctx.settings.audit,
                           seen_score=seen_score)
    if n == -2:
        await commit(ctx, loaded, state, step(loaded.policy, state, _given_up(ctx, loaded,
                                                                              state)))
        return 0
    if n > 0:
        ctx.stats["recovered"] += 1
        return len(followups)
    return 0


def _given_up(ctx: WorkerContext, loaded: LoadedBatch, state: AgentState) -> Abandoned:
    """How an agent re-sent ``max_resends`` times without progress ends: ``config`` when no
    worker that looked could read its batch's plan (each dropped its task unclaimed), else
    ``internal`` (a worker died or failed on it each time)."""
    times = ctx.settings.max_resends
    if loaded.plan_unreadable:
        event = Abandoned("config", f"{loaded.error}; its task was re-sent {times} times and "
                                    "no worker that could read the plan took it")
    else:
        event = Abandoned("internal", f"the agent's turn was re-sent {times} times without "
                                      "progress (a worker died or failed on it each time); "
                                      "giving up on it")
    log.error("agent %s of batch %s: %s", state.index, loaded.plan.batch_id, event.message)
    return event
