"""The embedded engine: every agent of a batch as a coroutine on one asyncio loop.

It executes the state machine's actions and nothing else. Inference slots are held only for
the model call itself, so agents waiting on tools never hold backend capacity.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.budget import Budget
from agentbatch.core.errors import ServerBusy
from agentbatch.core.finish import keeps_transcript, materialize, result_from_state
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.core.results import AgentResult
from agentbatch.core.turns import (
    Abandoned,
    CallModel,
    Cancelled,
    Event,
    ModelFailed,
    ModelReplied,
    next_action,
    step,
)
from agentbatch.embedded.priority_slots import PrioritySlots
from agentbatch.metrics import record_agent_end
from agentbatch.turnloop.backpressure import BackpressureGate, turn_deadline
from agentbatch.turnloop.runtime import BatchRuntime
from agentbatch.turnloop.turn_io import EarlyTools, call_model, run_tools

if TYPE_CHECKING:
    from agentbatch.embedded.checkpoint import CheckpointStore
    from agentbatch.turnloop.batch_turns import ProviderBatchTurns

log = logging.getLogger(__name__)


class EmbeddedEngine:
    def __init__(self, rt: BatchRuntime, states: list[AgentState],
                 sink: Callable[[AgentResult], None], *, max_inflight: int,
                 gate: BackpressureGate | None = None, checkpoint: CheckpointStore | None = None,
                 ended: dict[int, float | None] | None = None, budget: Budget | None = None,
                 provider: ProviderBatchTurns | None = None) -> None:
        self.rt = rt
        self.budget = budget  # spend, caps and the projection (every commit is recorded)
        self.provider = provider  # pricing="batch"|"auto": turns through a provider batch
        if provider is not None:  # what its batches bill for turns a sync hedge won
            provider.budget = budget
        self.checkpoint = checkpoint  # saves each committed state before the next action
        self.ended = ended or {}  # agents that ended in an earlier run: index -> latency
        self.states = {s.index: s for s in states}
        self.sink = sink
        self.slots = PrioritySlots(max_inflight)
        self.gate = gate
        self.early_started = 0  # tool calls started while their turn was still streaming
        self._tasks: list[asyncio.Task[None]] = []
        self._cancel_reason: str | None = None
        self._started = time.monotonic()
        # index -> when its current model call (slot held) or tool round started: progress()
        self.in_model: dict[int, float] = {}
        self.in_tools: dict[int, float] = {}

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` when the batch started running."""
        return self._started

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for s in self.states.values():
            counts[s.status.value] = counts.get(s.status.value, 0) + 1
        return counts

    async def run(self) -> None:
        self._started = time.monotonic()
        self._tasks = [asyncio.create_task(self._drive(s)) for s in self.states.values()]
        if self._cancel_reason is not None:
            self.cancel(self._cancel_reason)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cancel(self, reason: str = "the batch was cancelled") -> None:
        """Stop remaining turns; unfinished agents end with error kind ``cancelled``."""
        self._cancel_reason = reason
        for task in self._tasks:
            task.cancel()

    async def _perform(self, state: AgentState, action: object, early: EarlyTools) -> Event:
        if isinstance(action, CallModel):
            if self.gate is not None:  # bounded by the turn's deadline; cancel() cancels it
                deadline = turn_deadline(self.rt.plan.timeout_per_turn)
                try:
                    await self.gate.wait_ready(deadline=deadline)
                except ServerBusy as exc:
                    return ModelFailed(kind=exc.kind, message=str(exc), retryable=exc.retryable)
            if self.provider is not None and self.budget is not None:
                left = self.budget.work.turns_left(state)
                where, size = self.provider.route_sized(left, self.budget.work.live)
                if where == "batch":
                    return await self._batch_turn(state, action, left, size)
            async with self.slots.slot(action.turns_left):
                if self.budget is not None and (why := self.budget.refusal(state)):
                    return Abandoned("budget_exceeded", why)  # checked as the turn starts
                # busy in a model call (what progress() reports), as ``_busy`` does, unrolled:
                # a generator context manager on every turn cost more (issue 26 item 5)
                self.in_model[state.index] = time.monotonic()
                try:
                    if self.provider is not None:  # its latency feeds the routing
                        return await call_model(self.rt, state, action, early,
                                                complete=self.provider.sync)
                    return await call_model(self.rt, state, action, early)
                finally:
                    self.in_model.pop(state.index, None)
        self.in_tools[state.index] = time.monotonic()  # busy in a tool round, likewise
        try:
            return await run_tools(self.rt, state, action, early)  # type: ignore[arg-type]
        finally:
            self.in_tools.pop(state.index, None)

    async def _batch_turn(self, state: AgentState, action: CallModel, left: float,
                          size: int) -> Event:
        """One turn through the provider batch API (no inference slot held while it waits),
        in a provider batch of at most ``size`` turns, committed as a sync one;
        ``batch=True`` when the batch's answer won."""
        assert self.provider is not None and self.budget is not None
        if why := self.budget.refusal(state):
            return Abandoned("budget_exceeded", why)
        served: list[bool] = []
        provider = self.provider

        async def complete(request: ModelRequest) -> ModelResponse:
            response, by_batch = await provider.complete(request, left, size)
            served.append(by_batch)
            return response

        with _busy(self.in_model, state.index):
            event = await call_model(self.rt, state, action, None, complete=complete)
        if isinstance(event, ModelReplied) and served and served[-1]:
            event = dataclasses.replace(event, batch=True)
        return event

    def _commit(self, state: AgentState) -> None:
        """The engine's copy of the agent becomes ``state``; the budget sees the change."""
        if self.budget is not None:
            self.budget.record(self.states[state.index], state)
        self.states[state.index] = state

    async def _drive(self, state: AgentState) -> None:
        policy = self.rt.policy
        try:
            early = EarlyTools(self.rt, state)
            while (action := next_action(policy, state)) is not None:
                if isinstance(action, CallModel):  # streamed tool calls start at once
                    early = EarlyTools(self.rt, state)
                state = step(policy, state, await self._perform(state, action, early))
                self._commit(state)
                if self.checkpoint is not None and not state.terminal:  # the one commit
                    await self.checkpoint.save(state)  # point; the end is saved below
                if isinstance(action, CallModel):
                    self.early_started += len(early.tasks)
        except asyncio.CancelledError:
            if not state.terminal:
                state = step(policy, state, Cancelled(self._cancel_reason or "cancelled"))
        except Exception as exc:  # never let one agent take the batch down
            log.exception("agent %s failed inside the engine", state.index)
            if not state.terminal:
                state = step(policy, state, Abandoned("internal", f"{type(exc).__name__}: {exc}"))
        self._commit(state)
        if state.index in self.ended:  # its result comes from the checkpoint, as it was
            latency = self.ended[state.index]
        else:
            latency = time.monotonic() - self._started
            record_agent_end(state)
            await self._save_end(state, latency)
        result = result_from_state(state, latency, self.rt.plan,
                                   transcript=keeps_transcript(self.rt.plan, state))
        self.sink(materialize(result, self.rt.contract))

    async def _save_end(self, state: AgentState, latency: float) -> None:
        """Checkpoint an ended agent. A cancelled one is not saved: a re-run continues it
        from its last committed state. A failed write only costs a repeat on a re-run."""
        if self.checkpoint is None or state.status is AgentStatus.CANCELLED:
            return
        try:
            await self.checkpoint.save(state, latency)
        except asyncio.CancelledError:  # the writer still writes it; deliver the result
            pass
        except Exception:
            log.exception("agent %s: its end could not be checkpointed", state.index)


@contextlib.contextmanager
def _busy(since: dict[int, float], index: int) -> Iterator[None]:
    """Mark ``index`` busy in ``since`` for the block (what progress() reports as running)."""
    since[index] = time.monotonic()
    try:
        yield
    finally:
        since.pop(index, None)
