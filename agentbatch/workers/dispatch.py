"""Turn and tool task messages: what to send next for an agent, and sending it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from celery import Celery

from ..orchestrator.agent_state import AgentState
from ..orchestrator.turns import CallModel, RunTools, TurnPolicy, next_action
from .app import INFERENCE_QUEUE, TOOL_TASK, TOOLS_QUEUE, TURN_TASK, priority_for


@dataclass(frozen=True)
class Followup:
    """One task to enqueue. Its args are readable in Flower: batch, agent, version, turn."""

    task: str
    args: tuple[object, ...]
    queue: str
    priority: int


def turn_message(batch_id: str, state: AgentState, turns_left: int) -> Followup:
    return Followup(TURN_TASK, (batch_id, state.index, state.version, state.steps + 1),
                    INFERENCE_QUEUE, priority_for(turns_left))


def followups_for(batch_id: str, policy: TurnPolicy, state: AgentState,
                  skip_calls: Iterable[str] = ()) -> list[Followup]:
    """The tasks that move ``state`` forward (none when it has ended)."""
    action = next_action(policy, state)
    if isinstance(action, CallModel):
        return [turn_message(batch_id, state, action.turns_left)]
    if isinstance(action, RunTools):
        skip = set(skip_calls)
        priority = priority_for(policy.max_turns - state.steps)
        return [
            Followup(TOOL_TASK, (batch_id, state.index, state.version, call.id, call.name),
                     TOOLS_QUEUE, priority)
            for call in action.calls if call.id not in skip
        ]
    return []


def publish(app: Celery, followups: list[Followup]) -> None:
    """Send with one pooled producer (one connection for the whole list)."""
    if not followups:
        return
    with app.producer_or_acquire() as producer:
        for f in followups:
            app.send_task(f.task, args=list(f.args), queue=f.queue, priority=f.priority,
                          producer=producer)
