"""The recovery sweep: find agents whose next task was really lost and send it again.

An agent's progress deadline is pushed forward by every claim, lease renewal, running tool
call and commit. When it passes with no lease held, the sweep decides (``recovery.py``) from
what Redis shows:

- the agent's current version was *started* (a claim or a tool call recorded it in the
  batch's ``started`` hash) and nothing
  committed or renewed since: its worker died mid-turn, so its task is re-sent at once;
- it was never started and its queue list holds messages: its message is most likely
  waiting there, so it is *parked*: its list's ``PARKED`` zset records when it was found
  waiting (``park.lua``, one script call per batch whatever the number of agents). Every
  task message carries the time it was sent (``dispatch.SENT_KEY``) and a list is first in,
  first out, so once the oldest message left in the list was sent after that time, every
  message pushed before it has left the list: taken by a worker, or lost with one. Then
  ``wake.lua`` brings the agent's deadline back, one queue grace on: a worker that took its
  message has started it by then (its lease is watched from there), and one still not
  started is re-sent. An agent only queued thus costs the sweep nothing while it waits, however
  long its list is starved by higher priorities; a lost message is re-sent once its list
  has moved past the time it was found due (a list nothing consumes holds it, as it would
  hold a copy). Its deadline while parked is a backstop (``PARKED_LOOK_GRACES``): found due
  again with its list not yet moved past it, it is parked again;
- it was never started and its list is empty: the message is gone (a worker that had
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
from agentbatch.distributed.state.keys import (
    ACTIVE_BATCHES,
    SWEEP_LOCK,
    WATCH,
    BatchKeys,
    parked_key,
    watch_member,
)
from agentbatch.distributed.state.redis_store import (
    Inspection,
    Parking,
    entry_state,
    now_ms,
    sync_clock,
    wake_passed,
)
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS, TOOLS_QUEUE
from agentbatch.distributed.workers.app import app as celery_app
from agentbatch.distributed.workers.context import LoadedBatch, WorkerContext
from agentbatch.distributed.workers.dispatch import envelopes, followups_for, sent_ms_of
from agentbatch.distributed.workers.envelope import queue_key
from agentbatch.distributed.workers.steps import commit, end_damaged, finish_tools

log = logging.getLogger(__name__)

LISTS = tuple(queue_key(q, p) for q in (INFERENCE_QUEUE, TOOLS_QUEUE) for p in PRIORITY_STEPS)
"""Every task queue list kombu reads (queue and priority step)."""
PARKED_LOOK_GRACES = 10
"""A parked agent's deadline, in queue graces after it was parked: only a backstop (a wake
lost with a sweeper that died mid-pass, a parked zset lost in a failover). Its list moving
past it is what normally brings it back; found due with its list not yet moved past it, it
is parked again, in one script call per batch."""
CLOCK_SLACK_MS = 1000
"""Sent times and park times are read off different processes' copies of Redis's clock
(``now_ms``): a list counts as moved past a time only when its oldest message was sent this
much later."""


HOLD_SHARE = 0.8
"""A periodic pass keeps the lock this share of ``sweep_interval_s`` after it ends: every
worker tries every interval, and with the lock dropped at once a fleet of N workers swept
about N times per interval (6 workers at 0.5 s: ~4 passes a second, each reading every queue
list's head and waking parked agents). Less than 1, so a lone worker's next try finds it
free."""


async def sweep_once(ctx: WorkerContext, *, limit: int = 500, periodic: bool = False) -> int:
    """One pass over the agents due (at most ``limit``, earliest first, whatever batch they
    belong to); returns how many tasks were re-sent. Its cost is O(agents due): the deadlines
    of every batch live in one zset, so 500 idle active batches cost nothing. ``periodic``
    (the workers' timer): the lock is kept for ``HOLD_SHARE`` of an interval after the pass,
    so the fleet sweeps about once per interval whatever its number of workers."""
    token = uuid.uuid4().hex
    lock_ms = int(max(ctx.settings.sweep_interval_s * 3, 5) * 1000)
    if not await ctx.redis.set(SWEEP_LOCK, token, nx=True, px=lock_ms):
        return 0
    try:
        async with _lock_renewal(ctx, token, lock_ms):
            return await _sweep_due(ctx, limit)
    finally:
        hold_ms = int(ctx.settings.sweep_interval_s * HOLD_SHARE * 1000) if periodic else 0
        if hold_ms > 0:
            await ctx.scripts.lock_renew(keys=[SWEEP_LOCK], args=[token, hold_ms])
        else:
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
    """The pass itself, under the lock: wake the parked agents their lists have moved past,
    then decide for the agents due."""
    await sync_clock(ctx.redis)
    async with ctx.redis.pipeline(transaction=False) as p:
        p.zrangebyscore(WATCH, "-inf", now_ms(), start=0, num=limit)
        p.exists(*(parked_key(key) for key in LISTS))
        found, parked = await p.execute()
    if not found and not parked:
        return 0
    heads = await _list_heads(ctx)
    if parked:
        woken = await wake_passed(ctx.redis, ctx.scripts, _passed_bounds(heads),
                                  now_ms() + ctx.settings.queue_grace_ms)
        if woken:
            log.debug("sweep woke %d parked agent(s) their queue lists moved past", woken)
    by_batch: dict[str, list[int]] = {}
    for batch_id, index in map(watch_member, found):
        by_batch.setdefault(batch_id, []).append(index)
    sent = 0
    for batch_id, indices in by_batch.items():
        try:
            sent += await _sweep_batch(ctx, batch_id, indices, heads)
        except Exception:  # one bad batch never stops the recovery of the others
            log.exception("sweeping batch %s failed; the other batches are swept", batch_id)
    return sent


async def _list_heads(ctx: WorkerContext) -> dict[str, int | None]:
    """Per queue list, when its oldest message was sent (0: unknown), None when empty."""
    async with ctx.redis.pipeline(transaction=False) as p:
        for key in LISTS:
            p.lindex(key, -1)  # kombu pushes on the left and pops on the right
        oldest = await p.execute()
    return {key: None if m is None else sent_ms_of(m) for key, m in zip(LISTS, oldest,
                                                                         strict=True)}


def _moved_past(head: int | None) -> float:
    """The time a list has moved past: every message pushed before it has left the list."""
    return float("inf") if head is None else head - CLOCK_SLACK_MS


def _passed_bounds(heads: dict[str, int | None]) -> dict[str, float]:
    """Per parked zset, the time its list has moved past (lists that say nothing left out)."""
    return {parked_key(key): _moved_past(head) for key, head in heads.items()
            if head is None or head > CLOCK_SLACK_MS}


async def _sweep_batch(ctx: WorkerContext, batch_id: str, indices: list[int],
                       heads: dict[str, int | None]) -> int:
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
    now = now_ms()
    park: list[Parking] = []
    look: list[tuple[int, bool]] = []  # (index, lost): the agents to look at one by one
    for index, seen in zip(indices, await loaded.store.glance(indices), strict=True):
        lists = _queued_lists(loaded, *seen[:2])
        if lists is None:  # started, ended, gone or unreadable: look at it on its own
            look.append((index, False))
            continue
        version = int(seen[0].partition(":")[0])  # type: ignore[union-attr]
        since = _parked_since(seen[2], version)
        if any(heads.get(key) is None for key in lists) or (
                since is not None and all(since < _moved_past(heads[key]) for key in lists)):
            look.append((index, True))  # its list is empty, or moved past it: lost
        else:
            park.append(Parking(index, version, parked_key(lists[0]),
                                now if since is None else since))
    if park:
        await loaded.store.park(park, now + PARKED_LOOK_GRACES * ctx.settings.queue_grace_ms)
    sent = 0
    for index, lost in look:
        try:
            sent += await _sweep_agent(ctx, loaded, index, lost)
        except Exception:  # one bad agent never stops the sweep of the others
            log.exception("sweeping agent %s of batch %s failed; looking again later", index,
                          batch_id)
            with contextlib.suppress(Exception):  # a moved deadline: no hot loop on it
                await loaded.store.push_deadline(index, now_ms() + ctx.settings.queue_grace_ms)
    if sent:
        log.warning("sweep re-sent %d task(s) for batch %s", sent, batch_id)
    return sent


def _queued_lists(loaded: LoadedBatch, entry: str | None,
                  started: str | None) -> list[str] | None:
    """The queue lists holding a never-started agent's next task(s), or None for an agent
    the sweep looks at on its own (started, ended, gone, unreadable, or nothing to send)."""
    if entry is None or started == entry.partition(":")[0]:
        return None
    try:
        state = entry_state(entry)
    except Exception:  # damaged: ``_sweep_agent`` ends it
        return None
    if state.status.terminal:
        return None
    followups = followups_for(loaded.plan.batch_id, loaded.policy, state)
    return [queue_key(f.queue, f.priority) for f in followups] or None


def _parked_since(mark: str | None, version: int) -> int | None:
    """When the agent was parked at ``version`` (its park mark, "<version>:<ms>"), if it was."""
    if not mark:
        return None
    at, _, since = mark.partition(":")
    return int(since) if at == str(version) and since.isdigit() else None


async def _sweep_agent(ctx: WorkerContext, loaded: LoadedBatch, index: int,
                       lost: bool) -> int:
    """Decide for one due agent; returns the tasks re-sent. ``lost``: never started, and its
    list empty or moved past it."""
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
    if not seen.started and not lost:  # a new version since the pass looked: next pass
        await store.push_deadline(index, now_ms() + ctx.settings.queue_grace_ms)
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
    # sent time 0: a re-send jumps to the consuming end, where its time would make the
    # list look moved past the agents still waiting in it
    n = await store.resend(state, envelopes(celery_app, followups, sent_ms=0),
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
