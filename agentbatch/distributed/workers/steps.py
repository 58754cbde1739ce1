"""What one turn task and one tool task do. The state machine decides; this moves state.

Each function claims or checks the agent's version, performs the one action the state
machine asked for, and commits the next state with a compare-and-set. It returns the
follow-up tasks to send; the Celery task sends them after the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.budget import plan_refusal, turn_spend
from agentbatch.core.errors import BatchCancelled, ServerBusy
from agentbatch.core.finish import keeps_transcript, result_from_state
from agentbatch.core.model_io import ModelRequest, ModelResponse, ToolOutcome
from agentbatch.core.tool import Tool
from agentbatch.core.turns import (
    Abandoned,
    CallModel,
    Cancelled,
    Event,
    InvalidTransition,
    ModelFailed,
    ModelReplied,
    ToolsFinished,
    next_action,
    step,
)
from agentbatch.distributed.provider_batches import item_error
from agentbatch.distributed.state.redis_store import BatchStore, Claim, now_ms
from agentbatch.distributed.state.transition import Transition
from agentbatch.distributed.tool_coalesce import RedisLease
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PIPELINE_TASK, PRIORITY_STEPS
from agentbatch.distributed.workers.app import app as celery_app
from agentbatch.distributed.workers.context import LoadedBatch, WorkerContext
from agentbatch.distributed.workers.dispatch import (
    Followup,
    envelopes,
    followups_for,
    tool_again,
    turn_again,
)
from agentbatch.metrics import record_agent_end
from agentbatch.turnloop.backpressure import turn_deadline
from agentbatch.turnloop.turn_io import call_model, tool_context

log = logging.getLogger(__name__)


def deadline_for(ctx: WorkerContext) -> int:
    """When the sweep should first check whether this agent's queued task was lost (a
    started turn or tool call moves the deadline to its lease instead)."""
    return now_ms() + ctx.settings.queue_grace_ms


def advance(loaded: LoadedBatch, state: AgentState, event: Event) -> AgentState:
    """``step``, except that a bug under it (an output validator raising ``KeyError``, say)
    ends the agent with kind ``internal``, as in the embedded engine, instead of leaving the
    turn to be re-sent forever."""
    try:
        return step(loaded.policy, state, event)
    except InvalidTransition:
        raise
    except Exception as exc:
        log.exception("agent %s of batch %s failed in the state machine", state.index,
                      loaded.plan.batch_id)
        return step(loaded.policy, state, Abandoned("internal", f"{type(exc).__name__}: {exc}"))


async def commit(ctx: WorkerContext, loaded: LoadedBatch, old: AgentState, new: AgentState,
                 token: str = "", slot_key: str = "", listed: int | None = None,
                 consumed: Sequence[str] = (), logged: bool = False) -> list[Followup]:
    """Compare-and-set ``old`` → ``new``, enqueueing its follow-ups in the same script (and
    releasing the turn's lease and inference slot, won or lost). ``consumed``: keys the
    transition uses up besides the round's fan-in hash (a call's lock), deleted if it wins.
    ``logged``: ``old`` came with the agent's whole tool-call log (a claimed turn); else a
    terminal ``new`` reads it for the result.

    Returns the follow-ups still to send: none, since the commit already pushed them."""
    result_json = ""
    if new.terminal:
        latency = max(time.time() - loaded.plan.created_at, 0.0)
        whole = new if logged else await loaded.store.full_log(new)
        result_json = result_from_state(whole, latency, loaded.plan).model_dump_json()
    followups = followups_for(loaded.plan.batch_id, loaded.policy, new)
    if old.status is AgentStatus.AWAITING_TOOLS and len(old.pending_calls) > 1:
        consumed = [loaded.store.k.tool_results(old.index, old.version), *consumed]
    on_finish = None
    if new.terminal and loaded.plan.pipeline_id:  # the commit finishing the stage sends it
        [on_finish] = envelopes(celery_app, [Followup(
            PIPELINE_TASK, (loaded.plan.pipeline_id, loaded.plan.pipeline_stage),
            INFERENCE_QUEUE, PRIORITY_STEPS[0])])
    won = await loaded.store.commit(Transition(
        old, new, token=token, slot_key=slot_key, result_json=result_json,
        deadline_ms=deadline_for(ctx), audit=ctx.settings.audit,
        enqueue=envelopes(celery_app, followups), retention_s=ctx.settings.retention_s,
        listed=listed, consumed=consumed, on_finish=on_finish,
        keep_transcript=new.terminal and keeps_transcript(loaded.plan, new),
        spend_usd=turn_spend(loaded.plan, old, new)))
    if not won:
        await ctx.note(loaded.plan.batch_id, "dropped_conflict")
    elif new.terminal:
        record_agent_end(new)
    return []


@contextlib.asynccontextmanager
async def lease_renewal(ctx: WorkerContext, store: BatchStore, index: int,
                        token: str) -> AsyncIterator[None]:
    async def renew() -> None:
        while True:
            await asyncio.sleep(ctx.settings.lease_ttl_s / 3)
            with contextlib.suppress(Exception):
                await store.renew(index, token, ctx.settings.lease_ttl_ms)

    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        task.cancel()


@contextlib.asynccontextmanager
async def tool_lease(ctx: WorkerContext, store: BatchStore, index: int, version: int,
                     lease: RedisLease | None, lock_ttl_ms: int) -> AsyncIterator[None]:
    """While a tool call runs, keep its agent's deadline one lease ahead (``start_tool`` set
    the first), and the call's lock with it when it holds one (``lease``): a tool worker that
    dies is then noticed at lease expiry, not after the queue grace, and the deadline never
    passes while the lock still lives (so the call it re-sends finds the lock gone)."""
    ttl_ms = max(ctx.settings.lease_ttl_ms, lock_ttl_ms if lease else 0)
    every_s = min(ctx.settings.lease_ttl_ms, lock_ttl_ms if lease else ttl_ms) / 3000
    lock, token = (lease.lock, lease.token) if lease else ("", "")

    async def renew() -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                held = await store.tool_running(index, version, ttl_ms, lock, token,
                                                lock_ttl_ms)
            except Exception:  # a Redis blip: the next renewal may still be in time
                continue
            if held == -1 and lease is not None and not lease.lost:
                lease.lost = True
                log.warning("tool call %s of agent %s: lock lost while running (fencing token "
                            "%d); another worker may run it too", lock, index,
                            lease.fencing_token)

    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        task.cancel()


async def end_damaged(ctx: WorkerContext, loaded: LoadedBatch, state: AgentState, reason: str,
                      token: str = "", slot_key: str = "", consumed: Sequence[str] = ()) -> None:
    """End an agent whose stored state cannot be read (``state``: its placeholder) with kind
    ``internal``: it would fail the same way on every worker, for ever, and hold its batch
    open. The claim that found it (``token``, ``slot_key``), the tool task that found it
    (``consumed``: the call's lock it took) or the sweep commits the end."""
    log.error("agent %s of batch %s: %s", state.index, loaded.plan.batch_id, reason)
    await ctx.note(loaded.plan.batch_id, "damaged_state")
    if state.terminal:  # it ended already (its result was delivered): only let it go
        if token:
            await loaded.store.release(state.index, token, slot_key or None)
        await loaded.store.unwatch(state.index)
        return
    await commit(ctx, loaded, state, step(loaded.policy, state, Abandoned("internal", reason)),
                 token, slot_key, consumed=consumed, logged=True)


async def run_turn(ctx: WorkerContext, batch_id: str, index: int,
                   version: int) -> list[Followup]:
    """Claim (lease, state, conversation and, when the server admits calls, the inference
    slot: one round trip), call the model, commit (one round trip, which also releases the
    lease and the slot)."""
    loaded = await ctx.batch(batch_id)
    if loaded is None:
        log.warning("turn for unknown batch %s (finished and expired, or lost)", batch_id)
        return []
    store = loaded.store
    token = uuid.uuid4().hex
    rt = loaded.runtime
    sem = ctx.semaphore(loaded.plan, rt.backend) if rt is not None else None
    gate = ctx.gate(loaded.plan, rt.backend) if rt is not None else None
    # may wait on a provider batch: no slot held at the claim (a turn "auto" routes to the
    # sync API takes its slot like any sync turn, in _turn_event)
    by_batch = loaded.plan.pricing != "sync"
    ask = (sem.ask() if sem is not None and not by_batch
           and (gate is None or gate.looks_open()) else None)
    claim = await store.claim_turn(index, version, token, ctx.settings.lease_ttl_ms,
                                   slot=ask)
    if claim.kind == "busy":
        # Another delivery holds this turn. Try again when its lease would run out: if that
        # holder commits, this copy is stale and dropped; if it died, this copy resumes the
        # agent at lease expiry without waiting for the sweep.
        await ctx.note(batch_id, "requeued_busy")
        return [turn_again(batch_id, index, version, claim.busy_ms)]
    if claim.kind not in ("ok", "damaged") or claim.state is None:
        await ctx.note(batch_id, f"dropped_{claim.kind}")
        return []
    if sem is not None and ask is not None:
        sem.claimed(claim.aimd_limit)
    slot_key = sem.key if sem is not None else ""
    state = claim.state
    if claim.kind == "damaged":
        await end_damaged(ctx, loaded, state, claim.damage, token, slot_key)
        return []
    try:
        event = await _turn_event(ctx, loaded, state, token, claim)
        new = advance(loaded, state, event)
    except InvalidTransition:
        await store.release(index, token, slot_key)
        await ctx.note(batch_id, "dropped_invalid")
        return []
    except BaseException:
        await asyncio.shield(store.release(index, token, slot_key))
        raise
    followups = await commit(ctx, loaded, state, new, token, slot_key, claim.listed,
                             logged=True)
    if by_batch:  # committed (or lost to another delivery): the record has served
        await ctx.provider_batches.forget(store, index, version, token)
        if new.status is AgentStatus.DONE:  # the turns-left estimate "auto" routes on
            ctx.provider_batches.agent_finished(batch_id, new.turns)
    if sem is not None and claim.slots_scarce:
        # slots are scarce (claim.lua decides): turns may be queued for the one the commit
        # just freed
        await sem.announce_release()
    return followups


async def _turn_event(ctx: WorkerContext, loaded: LoadedBatch, state: AgentState, token: str,
                      claim: Claim) -> Event:
    if claim.cancelled:
        return Cancelled()
    if loaded.runtime is None:
        return Abandoned(loaded.error_kind, loaded.error or "the batch cannot run here")
    action = next_action(loaded.policy, state)
    if not isinstance(action, CallModel):
        raise InvalidTransition(f"agent {state.index} is not waiting on the model")
    if why := plan_refusal(loaded.plan, state, claim.spent_usd):
        # a cap reached, fleet-wide (the claim read the batch's spend): no new turn starts
        return Abandoned("budget_exceeded", why)
    rt = loaded.runtime
    sem = ctx.semaphore(loaded.plan, rt.backend)
    gate = ctx.gate(loaded.plan, rt.backend)
    routed_sync = False
    if loaded.plan.pricing != "sync":
        where, size = await ctx.provider_batches.route_sized(loaded.plan, loaded.store, state)
        if where == "batch":
            return await _batch_turn_event(ctx, loaded, state, token, action, size)
        routed_sync = True  # "auto": through the sync path, its latency observed
    # Waits for capacity end at the turn's deadline (a retryable ``server_busy``) or when the
    # batch is cancelled, so a server queue that never drains cannot hold a worker forever.
    deadline = turn_deadline(loaded.plan.timeout_per_turn)
    cancelled = loaded.store.cancelled

    async def ready() -> None:
        if gate is not None:
            await gate.wait_ready(deadline=deadline, cancelled=cancelled)

    complete = None
    sent: list[bool] = []
    if routed_sync:
        router = ctx.provider_batches.router(loaded.plan)

        async def complete(request: ModelRequest) -> ModelResponse:
            sent.append(True)
            with router.timed_sync(routed=True):
                return await rt.backend.complete(request)

    try:
        # The slot is the lease token's; the claim may have taken it already, and the commit
        # releases it in its own script.
        async with lease_renewal(ctx, loaded.store, state.index, token), \
                sem.slot(ready=ready, deadline=deadline, cancelled=cancelled, holder=token,
                         held=claim.slot, keep=True, priority=action.turns_left):
            event = await call_model(rt, state, action, complete=complete)
    except ServerBusy as exc:
        return ModelFailed(kind=exc.kind, message=str(exc), retryable=exc.retryable)
    except BatchCancelled:
        return Cancelled()
    finally:
        if routed_sync and not sent:  # never sent: out of the router's sync backlog
            ctx.provider_batches.router(loaded.plan).unroute()
    if isinstance(event, ModelReplied):
        await sem.on_success()  # AIMD: regrow the shared limit after a quiet period
    elif isinstance(event, ModelFailed) and event.kind == "rate_limited":
        await sem.on_throttle()
    return event


async def _batch_turn_event(ctx: WorkerContext, loaded: LoadedBatch, state: AgentState,
                            token: str, action: CallModel, size: int | None = None) -> Event:
    """A turn through a provider batch (``provider_batches.py``), its reply read and
    committed as a sync one, ``batch=True`` (priced at the batch rates) when the provider
    batch answered. The lease is renewed the whole wait (minutes to hours); no inference slot
    is held meanwhile. At the router's hedge time the turn also goes to the sync API, and an
    item that failed or expired goes there while the deadline allows, each inside a fleet
    slot; the first answer is the one committed."""
    rt = loaded.runtime
    assert rt is not None
    sem = ctx.semaphore(loaded.plan, rt.backend)
    store = loaded.store
    provider = ctx.provider_batches
    router = provider.router(loaded.plan)
    turns_left = provider.turns_left(loaded.plan, state)
    served: list[bool] = []
    cancelled: list[bool] = []

    async def sync_api(request: ModelRequest) -> ModelResponse:
        async with sem.slot(deadline=turn_deadline(loaded.plan.timeout_per_turn),
                            cancelled=store.cancelled, holder=token, keep=True,
                            priority=action.turns_left):
            with router.timed_sync():
                return await rt.backend.complete(request)

    async def complete(request: ModelRequest) -> ModelResponse:
        try:
            item, by_batch = await provider.complete(
                loaded.plan, rt.backend, store, state.index, state.version, request,
                turns_left=turns_left, hedge=lambda: sync_api(request), token=token,
                size=size)
        except BatchCancelled:
            served.append(False)
            cancelled.append(True)  # call_model would report it as an internal failure
            raise
        if item.response is not None:
            served.append(by_batch)
            return item.response
        if item.error is None or not item.error.retryable:
            raise item_error(item)
        if not router.allows_sync():
            raise item_error(item, "; the deadline left no time for the sync API")
        log.warning("agent %s of batch %s: its provider batch turn came back %s (%s): sent "
                    "to the sync API", state.index, loaded.plan.batch_id, item.error.kind,
                    item.error.message)
        await ctx.note(loaded.plan.batch_id, "provider_batch_fallback_sync")
        # billed once sent, as a hedge is: a worker killed with it in flight is counted
        await provider.hedge_intent(store, state.index, state.version, token)
        response = await sync_api(request)
        served.append(False)
        return response

    try:
        async with lease_renewal(ctx, store, state.index, token):
            event = await call_model(rt, state, action, complete=complete)
    except ServerBusy as exc:
        return ModelFailed(kind=exc.kind, message=str(exc), retryable=exc.retryable)
    except BatchCancelled:
        return Cancelled()
    if cancelled:
        return Cancelled()
    if isinstance(event, ModelReplied) and served and served[-1]:
        event = dataclasses.replace(event, batch=True)
    return event


def call_lock_ttl_ms(ctx: WorkerContext, tool: Tool | None) -> int:
    """How long an unshared call's lock outlives a worker that stopped renewing it: the tool's
    ``lock_ttl``, else the lease (0: the tool shares calls and coalesces on its own). Not
    the pool's 30 s default: with a 3 s lease that was most of the 31 s before a killed
    tool worker's call ran again; the renewal keeps a live worker's lock whatever its TTL."""
    if tool is None or tool.shares_calls:
        return 0
    if tool.lock_ttl is None:
        return ctx.settings.lease_ttl_ms
    return max(int(tool.lock_ttl * 1000), 1)


async def lock_kept(ctx: WorkerContext, batch_id: str, index: int, lease: RedisLease) -> bool:
    """Whether the call's lock was still ours when the tool returned (asked once, after it:
    the renewer is cancelled on return, before it would notice). A lost lock means another
    worker took the call over and may have run it too: counted (``stat:tool_lock_lost``),
    logged at ERROR, and the caller marks the outcome, so the agent's result shows it."""
    if not lease.lost:
        try:
            await lease.still_held()
        except Exception:  # Redis unreachable: the commit that follows fails too
            log.debug("could not check tool lock %s", lease.lock, exc_info=True)
    if not lease.lost:
        return True
    log.error("tool call %s of agent %s (batch %s): the call's lock was lost while it ran "
              "(fencing token %d); another worker took it over and may have run it too",
              lease.lock, index, batch_id, lease.fencing_token)
    await ctx.note(batch_id, "tool_lock_lost")
    return False


async def run_tool(ctx: WorkerContext, batch_id: str, index: int, version: int,
                   call_id: str, tool_name: str = "", calls: int = 0) -> list[Followup]:
    """Start the call (and take its lock, for an unshared tool: one round trip), run it, then
    commit the round (a round of one call) or record its outcome (the task recording the last
    one commits)."""
    loaded = await ctx.batch(batch_id)
    if loaded is None:
        return []
    store = loaded.store
    rt = loaded.runtime
    lock_ttl_ms = call_lock_ttl_ms(ctx, rt.tools.get(tool_name) if rt is not None else None)
    lock_token = uuid.uuid4().hex if lock_ttl_ms else ""
    start = await store.start_tool(index, version, call_id,
                                   max(ctx.settings.lease_ttl_ms, lock_ttl_ms),
                                   fan_in=calls != 1, lock_token=lock_token,
                                   lock_ttl_ms=lock_ttl_ms)
    state, recorded, cancelled = start.state, start.recorded, start.cancelled
    if start.damage and state is not None:  # as a claim does: end it, never raise
        lock = store.k.call_lock(index, version, call_id) if start.fencing_token else ""
        await end_damaged(ctx, loaded, state, start.damage, consumed=[lock] if lock else [])
        return []
    if state is None or state.status is not AgentStatus.AWAITING_TOOLS:
        await ctx.note(batch_id, "dropped_stale")
        return []
    if start.busy_ms:
        # Another delivery of this very call holds its lock. Try again when the lock would
        # run out: if that holder finishes, this copy finds the outcome (or the agent moved
        # on) and is dropped; if it died, this copy runs the call.
        await ctx.note(batch_id, "requeued_busy")
        return [tool_again(batch_id, index, version, call_id, tool_name, calls,
                           start.busy_ms)]
    if cancelled or loaded.runtime is None:
        event: Event = Cancelled() if cancelled else Abandoned(
            loaded.error_kind, loaded.error or "the batch cannot run here")
        return await commit(ctx, loaded, state, advance(loaded, state, event))
    if recorded:
        await ctx.note(batch_id, "dropped_duplicate")
    else:
        call = next((c for c in state.pending_calls if c.id == call_id), None)
        if call is None:
            await ctx.note(batch_id, "dropped_stale")
            return []
        rt = loaded.runtime
        lock = store.k.call_lock(index, version, call_id) if start.fencing_token else ""
        lease = RedisLease(store.r, lock, lock_token, start.fencing_token) if lock else None
        context = tool_context(rt, state, call_id)
        async with tool_lease(ctx, store, index, version, lease, lock_ttl_ms):
            outcome = await rt.tools.run(call, context.under(lease) if lease else context,
                                         timeout=loaded.plan.timeout_per_tool)
        ctx.stats["tool_calls"] += 1
        if lease is not None and not await lock_kept(ctx, batch_id, index, lease):
            outcome = outcome.model_copy(update={"lock_lost": True})
            lock = ""  # the lock is another worker's now: not ours to drop
        if len(state.pending_calls) == 1:
            # A round of one call needs no fan-in: the commit's compare-and-set alone makes
            # its outcome count once (a duplicate delivery finds the agent moved on).
            return await finish_tools(ctx, loaded, state, {call_id: outcome},
                                      consumed=[lock] if lock else [])
        recorded_now = await store.record_tool(index, version, outcome,
                                               expected=len(state.pending_calls), lock=lock)
        if recorded_now == -1:
            await ctx.note(batch_id, "dropped_stale")
            return []
        if isinstance(recorded_now, int):
            return []  # the round is incomplete; the task that completes it moves on
        return await finish_tools(ctx, loaded, state, recorded_now)
    return await finish_tools(ctx, loaded, state)


async def finish_tools(ctx: WorkerContext, loaded: LoadedBatch, state: AgentState,
                       outcomes: dict[str, ToolOutcome] | None = None,
                       consumed: Sequence[str] = ()) -> list[Followup]:
    """If every call of this tool round has an outcome, move the agent on (once: CAS)."""
    if outcomes is None:
        outcomes = await loaded.store.tool_outcomes(state.index, state.version)
    if any(c.id not in outcomes for c in state.pending_calls):
        return []
    if not state.messages and len(state.pending_calls) >= loaded.policy.max_tool_calls_per_turn:
        # Calls past the cap are answered from the reply itself (the last message), which a
        # tool task does not load: only a round at the cap can have such calls.
        state = state.model_copy(update={"messages": await loaded.store.last_message(state.index)})
    new = advance(loaded, state, ToolsFinished(list(outcomes.values())))
    return await commit(ctx, loaded, state, new, consumed=consumed)
