"""Versioned agent state in Redis: every transition is one compare-and-set script call.

The version is the fencing token. A stale or duplicate task, or a worker whose lease lapsed,
fails the compare-and-set and its work is dropped, so a turn is never applied twice.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.model_io import ToolOutcome
from agentbatch.core.plan import BatchPlan
from agentbatch.core.results import ToolCallRecord
from agentbatch.distributed.state.damaged import damage_reason, placeholder_state
from agentbatch.distributed.state.keys import (
    ACTIVE_BATCHES,
    TOMBSTONE_S,
    WATCH,
    BatchKeys,
    watch_member,
)
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.transition import DEFAULT_RETENTION_S, Transition

log = logging.getLogger(__name__)

TOOL_RESULTS_TTL_S = 7 * 24 * 3600  # a backstop: the commit that consumes a round deletes it


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

    kind: str  # ok | stale | busy | gone | damaged (state: a placeholder to end it from)
    state: AgentState | None = None
    cancelled: bool = False
    busy_ms: int = 0  # busy: how long the other holder's lease still lives
    slot: bool = False  # ok: the inference slot was taken too (holder: the lease token)
    listed: int = 0  # ok: how many of state.messages are in the agent's msgs list
    aimd_limit: int = -1  # the fleet's shared AIMD limit as the claim saw it (-1: none)
    # ok: no slot was taken, or the one taken fills half the limit (claim.lua decides): the
    # commit that frees it announces it to turns that may be queued for one
    slots_scarce: bool = True
    damage: str = ""  # damaged: why the stored state cannot be read
    spent_usd: float = 0.0  # ok: the batch's spend so far (meta's ``spend``, fleet-wide)


@dataclass(frozen=True)
class Inspection:
    """What the recovery sweep reads of one agent, in one round trip."""

    state: AgentState | None  # None: gone, or ``damage`` says why it cannot be read
    leased: bool
    started: bool  # the current version was started (the ``started`` hash names it)
    score: int | None  # the deadline as read: a re-send is fenced on it (``resend``)
    damage: str = ""  # the stored entry does not parse: why
    entry: str = ""  # the raw entry, when damaged


@dataclass(frozen=True)
class ToolStart:
    """The answer to "may I run this call of the agent's tool round at this version?"."""

    state: AgentState | None  # None: the agent moved on
    recorded: bool = False  # the call's outcome is already in the round's fan-in hash
    cancelled: bool = False
    fencing_token: int = 0  # > 0: we took the call's lock (an unshared tool) with this token
    busy_ms: int = 0  # > 0: another delivery holds the call's lock for this much longer
    damage: str = ""  # the stored entry does not parse: why (state: a placeholder to end it)


@dataclass(frozen=True)
class SlotAsk:
    """Take a fleet inference slot in the claim: the semaphore's zset, AIMD hash and limit."""

    key: str
    aimd_key: str
    limit: int
    ttl_ms: int
    wait_key: str  # requests queued for a slot, which a claim does not overtake


# Top-level fields whose default is None: left out while None, and read back as None.
_NONE_BY_DEFAULT = ("text", "ttft_s", "output", "error", "hedge_usage", "endpoint")


def unset_fields(state: AgentState) -> set[str]:
    """The optional fields ``state`` leaves unset, which its stored JSON leaves out: an entry
    of ~500 bytes sits in jemalloc's 512-byte class, and 14 more bytes (``"ttft_s":null``)
    moved it to the 640-byte one (1,884 vs 1,758 Redis bytes per agent at 20,000 agents)."""
    return {f for f in _NONE_BY_DEFAULT if getattr(state, f) is None}


def stored_state(state: AgentState) -> str:
    """The state JSON kept in Redis: every set field but the conversation and the tool-call
    log, which live in their lists (so its size does not grow with the turns)."""
    return state.model_dump_json(exclude={"messages", "tool_log", *unset_fields(state)})


def state_entry(version: int, state_json: str) -> str:
    """The state hash's entry: "<version>:<state JSON>" (``lua/_prelude.lua`` reads it)."""
    return f"{version}:{state_json}"


def entry_state(entry: str) -> AgentState:
    """The ``AgentState`` in a state hash entry."""
    return AgentState.model_validate_json(entry.partition(":")[2])


def park_field(index: int) -> str:
    """The ``resends`` hash field holding "<version>:<ms>": the version the sweep found
    waiting in its queue list, and when (beside the "<index>" re-send counts, so it expires
    and is deleted with them)."""
    return f"q:{index}"


@dataclass(frozen=True)
class Parking:
    """One never-started agent the sweep lets wait in its queue list (``BatchStore.park``)."""

    index: int
    version: int
    parked_key: str  # the list's ``PARKED`` zset (``keys.parked_key``)
    since_ms: int  # when it was first found waiting there, at this version


def entry_version(entry: str) -> int:
    return int(entry.partition(":")[0])


def json_array(items: Iterable[str]) -> str:
    """A script's variable-length argument: one JSON array of strings (``json_list`` in
    ``lua/_prelude.lua``). Non-ASCII stays UTF-8, as the strings themselves are."""
    return json.dumps(list(items), ensure_ascii=False, separators=(",", ":"))


def message_entries(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The msgs list's entries for ``messages`` (compact JSON, one per message)."""
    return [json.dumps(m, separators=(",", ":")) for m in messages]


def with_messages(entry: str, listed: Sequence[str], logged: Sequence[str] = ()) -> AgentState:
    """The agent's state: its entry's fields, its conversation, which is the entry's own
    ``messages`` (only a state as submitted has any: the submit writes no lists) followed by
    the ``listed`` entries of its msgs list, and its tool-call log (``logged``)."""
    state = entry_state(entry)
    if listed:
        state.messages = [*state.messages, *(json.loads(m) for m in listed)]
    if logged:
        state.tool_log = [ToolCallRecord.model_validate_json(r) for r in logged]
    return state


def new_records(old: AgentState, new: AgentState) -> list[str]:
    """The calls list's entries ``old`` → ``new`` adds: the log only grows, and ``old`` holds
    either all of it (a claimed turn) or none (a tool task, which loads no log). ``lock_lost``
    and ``error`` are written only when set: every record of every agent pays for a field
    that is not."""
    return [r.model_dump_json(exclude={f for f in ("lock_lost", "error") if not getattr(r, f)})
            for r in new.tool_log[len(old.tool_log):]]


def new_messages(old: AgentState, new: AgentState,
                 listed: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(mode, messages) to store for ``old`` → ``new``: what is not in the list yet ('a': the
    first ``listed`` of ``old.messages`` are, default all), or, should a transition ever
    rewrite history, all of it ('r')."""
    n = len(old.messages)
    if new.messages[:n] == old.messages:
        tail = new.messages[n if listed is None else listed:]
        return ("a" if tail else ""), tail
    return "r", list(new.messages)


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

    async def claim_turn(self, index: int, version: int, token: str, ttl_ms: int,
                         slot: SlotAsk | None = None) -> Claim:
        """Claim the turn: lease, deadline, state and conversation, and the inference slot
        too when ``slot`` is given (one round trip for all; the commit releases the slot)."""
        k = self.k
        await sync_clock(self.r)
        reply = await self.s.claim(
            keys=[k.state, k.lease(index), k.watch, k.meta, k.messages(index), k.calls(index),
                  k.started, *((slot.key, slot.aimd_key, slot.wait_key) if slot else ())],
            args=[index, version, token, ttl_ms, now_ms(), slot.limit if slot else "",
                  slot.ttl_ms if slot else 0, k.member(index)])
        if reply[0] == "busy":
            return Claim(kind="busy", busy_ms=max(int(reply[1]), 0))
        if reply[0] != "ok":
            return Claim(kind=reply[0])
        kind, damage = "ok", ""
        try:
            state = with_messages(reply[1], reply[3], reply[6])
        except Exception as exc:  # any parse failure: the agent cannot run
            kind, damage, state = "damaged", damage_reason(exc), placeholder_state(index,
                                                                                   reply[1])
        return Claim(kind=kind, state=state, damage=damage,
                     cancelled=reply[2] == "1", slot=int(reply[4]) == 1,
                     aimd_limit=int(reply[5]), listed=len(reply[3]),
                     slots_scarce=int(reply[7]) == 1, spent_usd=float(reply[8]))

    async def renew(self, index: int, token: str, ttl_ms: int) -> bool:
        return bool(await self.s.renew(keys=[self.k.lease(index), self.k.watch],
                                       args=[token, ttl_ms, now_ms(), self.k.member(index)]))

    async def release(self, index: int, token: str, slot_key: str | None = None) -> None:
        """Drop our lease, and our inference slot in ``slot_key`` if given."""
        keys = [self.k.lease(index)] + ([slot_key] if slot_key else [])
        await self.s.release(keys=keys, args=[token])

    async def commit(self, t: Transition) -> bool:
        """Write ``t.new`` only if the stored version is still ``t.old.version``; on success
        push the ``t.enqueue`` task messages (list key, payload) in the same atomic step.

        Only the messages not in the agent's list yet are written: ``t.old.messages`` is what
        this worker loaded (all of them for a turn, none or the last for a tool round), of
        which the first ``t.listed`` (default: all) are in the list; the rest came with the
        submitted state and are listed by this first commit. A terminal agent is stored
        without its conversation (its result, written in the same step, is what readers
        get), and its msgs list is deleted unless ``t.keep_transcript`` (then it keeps the
        retention TTL; ``distributed/state/transcripts.py`` reads it); the commit that finishes the
        batch sets its retention TTL (``t.retention_s`` only for a batch submitted without
        one). With a ``t.token``, the lease and the
        inference slot it holds in ``t.slot_key`` are released, won or lost. The terminal
        commit that delivers the last of the batch's ``total`` (read from its meta in the
        script) finishes the batch; ``t.consumed`` are keys the transition uses up (the
        round's fan-in hash, its calls' locks), deleted when it wins. ``t.spend_usd`` is
        added to the batch's ``spend`` (and the replies ``new`` adds to its ``replies``) in
        the same step, only if it wins: no extra round trip, never counted twice."""
        k, old, new = self.k, t.old, t.new
        terminal = new.status.terminal
        keep = terminal and t.keep_transcript  # its msgs list stays: append what is new
        stored = terminal_state(new) if terminal else new
        mode, tail = ("", []) if terminal and not keep else new_messages(old, new, t.listed)
        records = [] if terminal else new_records(old, new)
        replies = max(new.turns - old.turns, 0)
        spend = "" if t.spend_usd is None or (t.spend_usd <= 0 and not replies) else \
            repr(max(t.spend_usd, 0.0))
        ok = await self.s.commit(
            keys=[k.state, k.lease(old.index), k.watch, k.meta, k.results, ACTIVE_BATCHES,
                  k.audit, k.resends, k.plan, k.gone, k.messages(old.index), k.fence,
                  k.calls(old.index), k.started, *([t.slot_key] if t.slot_key else []),
                  *t.consumed, *(key for key, _ in t.enqueue),
                  *([t.on_finish[0]] if t.on_finish else [])],
            args=[old.index, old.version, new.version, stored_state(stored), t.token,
                  old.status.value, new.status.value, "1" if terminal else "0", t.result_json,
                  t.deadline_ms, self.batch_id, "1" if t.audit else "0",
                  retention_ms(t.retention_s), TOMBSTONE_S * 1000, mode,
                  "1" if t.slot_key else "0", len(t.consumed),
                  json_array(message_entries(tail)), json_array(records),
                  json_array(payload for _, payload in t.enqueue),
                  t.on_finish[1] if t.on_finish else "", "1" if keep else "0", spend,
                  replies],
        )
        return bool(ok)

    async def full_log(self, state: AgentState) -> AgentState:
        """``state`` with its whole tool-call log: a tool task or the sweep loads none, and a
        result made from their commit needs it (one read, only for the agent's last
        commit; a commit to the same version in between fails this one's compare-and-set)."""
        raw = await self.r.lrange(self.k.calls(state.index), 0, -1)
        logged = [ToolCallRecord.model_validate_json(r) for r in raw]
        return state.model_copy(update={"tool_log": [*logged, *state.tool_log]})

    async def last_message(self, index: int) -> list[dict[str, Any]]:
        """The agent's last message (as a one-item list), for a tool round that needs it."""
        raw = await self.r.lindex(self.k.messages(index), -1)
        return [json.loads(raw)] if raw else []

    async def cancelled(self) -> bool:
        """Whether the batch was cancelled (asked by turns waiting for capacity)."""
        return await self.r.hget(self.k.meta, "cancelled") == "1"

    async def start_tool(self, index: int, version: int, call_id: str, ttl_ms: int, *,
                         fan_in: bool = True, lock_token: str = "",
                         lock_ttl_ms: int = 0) -> ToolStart:
        """Check and start one call of a tool round (``tool_start``: one round trip). A call
        that is to run is marked started with its deadline ``ttl_ms`` ahead; with a
        ``lock_token`` (an unshared tool) it also takes the call's lock for ``lock_ttl_ms``
        and a fencing token. ``fan_in=False`` (a round of one call) skips looking for a
        recorded outcome: such a round records none. An entry that does not parse is
        reported (``damage``, with a placeholder state to end the agent from), not raised."""
        k = self.k
        await sync_clock(self.r)
        entry, have, cancelled, fence, busy = await self.s.tool_start(
            keys=[k.state, k.tool_results(index, version), k.meta, k.watch,
                  k.call_lock(index, version, call_id), k.fence, k.started],
            args=[index, version, call_id, now_ms() + ttl_ms, k.member(index),
                  "1" if fan_in else "0", lock_token, lock_ttl_ms])
        state, damage = None, ""
        if entry:
            try:
                state = entry_state(entry)
            except Exception as exc:  # any parse failure: the agent cannot run (damaged.py)
                state, damage = placeholder_state(index, entry), damage_reason(exc)
        return ToolStart(state=state, recorded=bool(int(have)), cancelled=cancelled == "1",
                         fencing_token=int(fence), busy_ms=int(busy), damage=damage)

    async def record_tool(self, index: int, version: int, outcome: ToolOutcome,
                          expected: int, lock: str = "") -> dict[str, ToolOutcome] | int:
        """Every outcome of the round once all ``expected`` are recorded; else how many are
        (-1 if the agent moved on). ``lock``: the call's lock, dropped with the record."""
        k = self.k
        reply = await self.s.record_tool(
            keys=[k.state, k.tool_results(index, version), *([lock] if lock else [])],
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

    async def inspect(self, index: int) -> Inspection:
        """What the recovery sweep needs of one agent. An entry that does not parse is
        reported (``damage``), not raised: it must not stop the sweep of the others."""
        k = self.k
        async with self.r.pipeline(transaction=False) as p:
            p.hget(k.state, index)
            p.exists(k.lease(index))
            p.zscore(k.watch, k.member(index))
            p.hget(k.started, index)
            entry, leased, score, started_at = await p.execute()
        seen = None if score is None else int(score)
        if not entry:
            return Inspection(None, bool(leased), False, seen)
        started = started_at is not None and started_at == entry.partition(":")[0]
        try:
            state = entry_state(entry)
        except Exception as exc:  # any parse failure: the agent cannot run
            return Inspection(None, bool(leased), started, seen,
                              damage=damage_reason(exc), entry=entry)
        return Inspection(state, bool(leased), started, seen)

    async def glance(self, indices: Sequence[int]) -> list[tuple[str | None, str | None,
                                                                 str | None]]:
        """(state entry, started version, park mark) of each agent: what the sweep needs to
        tell an agent only queued from one to look at, three commands for any number."""
        k, fields = self.k, [str(i) for i in indices]
        async with self.r.pipeline(transaction=False) as p:
            p.hmget(k.state, fields)
            p.hmget(k.started, fields)
            p.hmget(k.resends, [park_field(i) for i in indices])
            entries, started, marks = await p.execute()
        return list(zip(entries, started, marks, strict=True))

    async def park(self, rows: Sequence[Parking], look_at_ms: int) -> list[int]:
        """Let never-started agents wait in their queue lists: each still at its version and
        not started gets its park mark, its member in its list's ``PARKED`` zset (scored
        ``since_ms``) and its deadline moved to ``look_at_ms``, all in one script
        (``park.lua``) whose commands do not grow with the agents. Returns the indices
        parked (the others moved on meanwhile)."""
        k = self.k
        zsets = sorted({r.parked_key for r in rows})
        slot = {key: n for n, key in enumerate(zsets, start=1)}
        return [int(i) for i in await self.s.park(
            keys=[k.state, k.started, k.resends, k.watch, *zsets],
            args=[look_at_ms, self.batch_id,
                  json_array(f"{r.index}:{r.version}:{slot[r.parked_key]}:{r.since_ms}"
                             for r in rows)])]

    async def resend(self, state: AgentState, enqueue: Sequence[tuple[str, str]], *,
                     recheck_ms: int, max_resends: int, audit: bool = False,
                     seen_score: int | None = None) -> int:
        """Push a lost agent's task messages, count the re-send and move its deadline, in one
        script. ``seen_score``: the deadline the sweep read; a sweep whose pass overlapped
        another's (its lock lapsed) finds it moved and sends nothing. Returns -1 (moved on,
        leased, or its deadline moved: nothing sent), -2 (``max_resends`` reached: nothing
        sent) or the number of re-sends at this version.

        A provider-batch turn's sync hedge request the version's last holder had in flight
        (its intent in ``pbatch``, ``provider_batches.hedge_intent``) was paid and is in no
        commit: the same script counts it (``stat:hedge_sync_paid_unknown``), and it is
        logged here, naming the batch and the agent. So is a started model turn's plain
        sync request (``stat:sync_turn_maybe_paid``: its worker may have sent it; none of
        its tokens are known), unless the turn is in a provider batch the re-sent turn
        adopts."""
        k = self.k
        n, paid = await self.s.resend(
            keys=[k.state, k.lease(state.index), k.watch, k.resends, k.meta, k.audit,
                  k.started, k.provider_batches, *(key for key, _ in enqueue)],
            args=[state.index, state.version, now_ms(), recheck_ms, max_resends,
                  "1" if audit else "0", k.member(state.index),
                  "" if seen_score is None else seen_score,
                  json_array(payload for _, payload in enqueue),
                  "1" if state.status is AgentStatus.NEEDS_MODEL else "0"],
        )
        if int(paid) == 1:
            log.warning("batch %s: agent %s v%s was taken over while its worker's sync hedge "
                        "request was in flight; the provider bills it, its tokens are not "
                        "known (stat:hedge_sync_paid_unknown)", self.batch_id, state.index,
                        state.version)
        elif int(paid) == 2:
            log.warning("batch %s: agent %s v%s was taken over after its worker started the "
                        "model turn; its request may have been sent and billed, its tokens "
                        "are not known (stat:sync_turn_maybe_paid)", self.batch_id,
                        state.index, state.version)
        return int(n)

    async def tool_running(self, index: int, version: int, ttl_ms: int, lock: str = "",
                           lock_token: str = "", lock_ttl_ms: int = 0) -> int:
        """A tool call of this round runs: keep the version started, deadline now + ttl, and
        the call's ``lock`` (if it holds one) for ``lock_ttl_ms`` more. Returns 0 when the
        agent moved on, -1 when the lock was lost, else 1."""
        await sync_clock(self.r)
        return int(await self.s.tool_touch(
            keys=[self.k.state, self.k.watch, self.k.started, *([lock] if lock else [])],
            args=[index, version, now_ms() + ttl_ms, self.k.member(index),
                  *([lock_token, lock_ttl_ms] if lock else [])]))

    async def push_deadline(self, index: int, deadline_ms: int) -> None:
        """Move the agent's progress deadline (its started mark is left as it is)."""
        await self.r.zadd(self.k.watch, {self.k.member(index): deadline_ms}, xx=True)

    async def unwatch(self, index: int) -> None:
        await self.r.zrem(self.k.watch, self.k.member(index))



CANCEL_GONE, CANCEL_MARKED, CANCEL_FINISHED = 0, 1, 2  # cancel.lua's answers


def cancel_batch(client: Any, batch_id: str) -> int:
    """Mark the batch cancelled in one script that writes only where its meta exists (a
    plain HSET after expiry made a meta with no TTL, listed as "cancelling" for ever).
    Returns ``CANCEL_MARKED``, ``CANCEL_FINISHED`` (nothing to stop) or ``CANCEL_GONE``.
    Sync client: the submitting process cancels."""
    return int(Scripts(client).cancel(keys=[BatchKeys(batch_id).meta]))


async def due_agents(client: Any, limit: int = 500) -> list[tuple[str, int]]:
    """(batch id, index) of agents whose progress deadline has passed (by Redis's clock),
    across the fleet, earliest first: one ZRANGEBYSCORE, however many batches are active."""
    await sync_clock(client)
    found = await client.zrangebyscore(WATCH, "-inf", now_ms(), start=0, num=limit)
    return [watch_member(m) for m in found]


async def wake_passed(client: Any, scripts: Scripts, passed: dict[str, float],
                      wake_at_ms: int, limit: int = 1000) -> int:
    """Wake the parked agents each list has moved past: ``passed`` maps a ``PARKED`` zset
    to the park time its list has moved past (``inf``: the list is empty). Their deadlines
    come down to ``wake_at_ms`` unless already sooner (a claim set them); one script call
    (``wake.lua``), at most ``limit`` agents per zset. Returns how many were woken."""
    if not passed:
        return 0
    keys = sorted(passed)
    return int(await scripts.wake(
        keys=[WATCH, *keys],
        args=[wake_at_ms, limit,
              *("+inf" if math.isinf(passed[key]) else f"({int(passed[key])}" for key in keys)]))


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
        "created_at": plan.created_at,
        "retention_ms": retention_ms(retention_s),
    }
