"""Execute the state machine's actions: the only place a turn touches the network.

Both engines call these two functions; neither decides anything about the agent loop.
"""

from __future__ import annotations

import logging

from ..errors import BackendError
from ..toolpool import ToolContext
from .agent_state import AgentState
from .render import build_request
from .runtime import BatchRuntime
from .turns import CallModel, Event, ModelFailed, ModelReplied, RunTools, ToolsFinished

log = logging.getLogger(__name__)


async def call_model(rt: BatchRuntime, state: AgentState, action: CallModel) -> Event:
    request = build_request(rt.plan, state, action)
    try:
        response = await rt.backend.complete(request)
    except BackendError as exc:
        return ModelFailed(kind=exc.kind, message=str(exc), retryable=exc.retryable)
    except Exception as exc:  # a bug in a backend must end one agent, not the batch
        log.exception("backend raised unexpectedly for agent %s", state.index)
        return ModelFailed(kind="internal", message=f"{type(exc).__name__}: {exc}",
                           retryable=False)
    return ModelReplied(response)


def tool_context(rt: BatchRuntime, state: AgentState, call_id: str) -> ToolContext:
    key = f"{rt.plan.batch_id}:{state.index}:{state.steps}:{call_id}"
    return ToolContext(idempotency_key=key, batch_id=rt.plan.batch_id, agent_index=state.index,
                       turn=state.steps, call_id=call_id)


async def run_tools(rt: BatchRuntime, state: AgentState, action: RunTools) -> Event:
    outcomes = await rt.tools.run_many(
        action.calls,
        lambda call: tool_context(rt, state, call.id),
        timeout=rt.plan.timeout_per_tool,
    )
    return ToolsFinished(outcomes)
