"""Execute the state machine's actions: the only place a turn touches the network.

Both engines call these two functions; neither decides anything about the agent loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from agentbatch.backends.sse import ON_TOOL_CALL
from agentbatch.core.agent_state import AgentState
from agentbatch.core.errors import BackendError
from agentbatch.core.model_io import (
    ModelRequest,
    ModelResponse,
    ToolCall,
    ToolOutcome,
    Usage,
    replaced,
)
from agentbatch.core.render import build_request
from agentbatch.core.turns import (
    Abandoned,
    CallModel,
    Event,
    ModelFailed,
    ModelReplied,
    RunTools,
    ToolsFinished,
)
from agentbatch.metrics import model_call, record_reply
from agentbatch.toolpool import ToolContext
from agentbatch.turnloop.context_fit import fit_request
from agentbatch.turnloop.json_tool_calling import adapt_request, parse_reply
from agentbatch.turnloop.runtime import BatchRuntime

log = logging.getLogger(__name__)

_NOTHING = Usage()  # added to, never changed: ``Usage.__add__`` makes a new one


async def call_model(rt: BatchRuntime, state: AgentState, action: CallModel,
                     early: EarlyTools | None = None,
                     complete: Callable[[ModelRequest], Awaitable[ModelResponse]] | None = None,
                     ) -> Event:
    """One model turn; ``complete`` sends the request in place of the backend's own (the
    provider batch path), the request built and the reply read the same way."""
    fitted = await fit_request(rt, state, build_request(rt.plan, state, action))
    if isinstance(fitted, Abandoned):  # the prompt cannot fit the context: never sent
        return fitted
    request = fitted.request
    json_tools = rt.plan.tool_calling == "json"
    if json_tools:  # tools as one guided-JSON union, at this edge: the loop stays the same
        request = adapt_request(rt.plan, request, allow_tools=action.allow_tools,
                                require_tools=action.require_tools)
    # One budget for the agent: HTTP retries inside this call count against max_retries, so
    # max_retries=0 means one attempt, and timeout_per_turn bounds all of this call's attempts.
    request.max_attempts = max(rt.policy.max_retries - state.retries, 0) + 1
    # ``sse.tool_call_listener(early)``, unrolled: early tool calls of a streaming backend
    # in this task go to ``early`` (a context manager's generator, on every turn, cost more).
    listening = ON_TOOL_CALL.set(early)
    try:
        with model_call(rt.backend.name):
            response = await (complete or rt.backend.complete)(request)
    except BackendError as exc:
        return ModelFailed(kind=exc.kind, message=str(exc), retryable=exc.retryable,
                           attempts=exc.attempts)
    except Exception as exc:  # a bug in a backend must end one agent, not the batch
        log.exception("backend raised unexpectedly for agent %s", state.index)
        return ModelFailed(kind="internal", message=f"{type(exc).__name__}: {exc}",
                           retryable=False)
    finally:
        ON_TOOL_CALL.reset(listening)
    if json_tools:
        response = parse_reply(response, allow_tools=action.allow_tools, turn=state.steps + 1)
    if fitted.count is not None or fitted.usage is not None:
        # One new Usage, made once (no attribute set after): what compaction spent, if
        # anything, plus the reply's, and how the prompt was sized. This runs on every turn.
        got, spent = response.usage, (_NOTHING if fitted.usage is None else fitted.usage)
        usage = Usage(prompt_tokens=spent.prompt_tokens + got.prompt_tokens,
                      cached_tokens=spent.cached_tokens + got.cached_tokens,
                      completion_tokens=spent.completion_tokens + got.completion_tokens,
                      prompt_count=fitted.count or got.prompt_count)
        response = replaced(response, {"usage": usage})
    record_reply(rt.backend.name, response)
    return ModelReplied(response, attempts=response.attempts)


def tool_context(rt: BatchRuntime, state: AgentState, call_id: str,
                 turn: int | None = None) -> ToolContext:
    turn = state.steps if turn is None else turn
    key = f"{rt.plan.batch_id}:{state.index}:{turn}:{call_id}"
    return ToolContext(idempotency_key=key, batch_id=rt.plan.batch_id, agent_index=state.index,
                       turn=turn, call_id=call_id)


class EarlyTools:
    """Tool calls a streaming backend announced before its turn ended, already running.

    Only tools declared safe to share (``cacheable`` or ``coalesce``: read-only) start early:
    they may run more than once, so a turn that fails after announcing a call leaves no side
    effect behind. Every other tool waits for the state machine's ``RunTools`` as usual.
    """

    def __init__(self, rt: BatchRuntime, state: AgentState) -> None:
        self.rt = rt
        self.state = state
        self.tasks: dict[str, asyncio.Task[ToolOutcome]] = {}

    def __call__(self, call: ToolCall) -> None:
        tool = self.rt.tools.get(call.name)
        if tool is None or not tool.shares_calls or call.arguments_error \
                or call.id in self.tasks:
            return
        # The tool context is the one RunTools would give: the turn this reply completes.
        ctx = tool_context(self.rt, self.state, call.id, turn=self.state.steps + 1)
        self.tasks[call.id] = asyncio.ensure_future(
            self.rt.tools.run(call, ctx, timeout=self.rt.plan.timeout_per_tool))


async def run_tools(rt: BatchRuntime, state: AgentState, action: RunTools,
                    early: EarlyTools | None = None) -> Event:
    started = early.tasks if early is not None else {}

    async def one(call: ToolCall) -> ToolOutcome:
        task = started.pop(call.id, None)
        if task is not None:
            return await task
        return await rt.tools.run(call, tool_context(rt, state, call.id),
                                  timeout=rt.plan.timeout_per_tool)

    if len(action.calls) == 1:  # the usual round: no gather, so no extra task per round
        return ToolsFinished([await one(action.calls[0])])
    return ToolsFinished(list(await asyncio.gather(*(one(c) for c in action.calls))))
