"""The agent turn state machine: pure decisions, no IO.

``step(policy, state, event)`` returns the next state; ``next_action(policy, state)`` says what
the engine must do next. Both engines (embedded asyncio and distributed Celery) only execute
these actions and feed back events, so the agent loop exists exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.model_io import (
    FINISH_LOOP,
    Message,
    ModelResponse,
    ToolCall,
    ToolOutcome,
    Usage,
    replaced,
)
from agentbatch.core.options import DEFAULT_MAX_TOOL_CALLS_PER_TURN
from agentbatch.core.output import ParsedOutput
from agentbatch.core.results import AgentError, ErrorKind, ToolCallRecord

REPAIR_PROMPT = (
    "Your previous reply could not be used: {error}\n"
    "Reply again with only the corrected final answer."
)
# tool_choice="required": until the agent has called a tool, a reply must be a tool call.
REPAIR_TOOL_PROMPT = (
    "Your previous reply could not be used: {error}\n"
    "Reply again with only the tool call."
)
TOOL_REQUIRED_ERROR = "a tool call is required before the final answer"
# A reply cut off at the token limit that does not validate goes back to the model as its
# first CUT_REPLY_KEEP characters, not whole: re-reading a runaway (a string repeated until
# max_tokens) costs the engine every one of its tokens again as prompt, and tells the model
# nothing the first words do not. Measured on llama-server with SmolLM2-135M (issue 9): a
# repair turn after a 96-token runaway computed 186 prompt tokens, 96 of them that reply.
CUT_REPLY_KEEP = 60
CUT_REPLY_ERROR = "it was cut off at the token limit before it ended; give a shorter answer"
# A streamed reply stopped because it repeated itself (FINISH_LOOP) is answered the same way.
LOOP_REPLY_ERROR = "it kept repeating the same text and was stopped; give a short answer"
CUT_REPLY_ERRORS = {"length": CUT_REPLY_ERROR, FINISH_LOOP: LOOP_REPLY_ERROR}
TOO_MANY_CALLS = (
    "too many tool calls in one reply; at most {cap} run per turn. This call was not run; "
    "make it again in a later turn if you still need it."
)
# A failed call's error text kept on its ToolCallRecord: enough to say why, and bounded
# (it is stored per record in Redis on the distributed engine).
TOOL_ERROR_CHARS = 500


class InvalidTransition(Exception):
    """The event does not apply to the state (a stale or duplicate delivery)."""


@dataclass(frozen=True)
class TurnPolicy:
    """The per-batch limits and output check that drive decisions."""

    max_turns: int
    max_retries: int
    parse_output: Callable[[str | None], ParsedOutput]
    # Calls past this many in one reply are not run; each gets an error reply instead.
    max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN
    # tool_choice="required": every turn until the first tool results must call a tool.
    require_tool_call: bool = False
    # with it, the tool rounds an agent must take before it may answer (required_tool_rounds)
    required_tool_rounds: int = 1


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelReplied:
    response: ModelResponse
    attempts: int = 1  # HTTP attempts behind this reply; retries count against max_retries
    batch: bool = False  # served by a provider's batch API (its usage priced at batch_ rates)


@dataclass(frozen=True)
class ModelFailed:
    kind: ErrorKind
    message: str
    retryable: bool
    attempts: int = 1  # HTTP attempts this call made (transport retries included)


@dataclass(frozen=True)
class ToolsFinished:
    outcomes: list[ToolOutcome]


@dataclass(frozen=True)
class Cancelled:
    reason: str = "the batch was cancelled"


@dataclass(frozen=True)
class Abandoned:
    """The engine gave up on the agent for a reason outside the loop (e.g. a tool import)."""

    kind: ErrorKind
    message: str


Event = ModelReplied | ModelFailed | ToolsFinished | Cancelled | Abandoned

# --- actions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallModel:
    turns_left: int  # priority: fewer turns left goes first
    allow_tools: bool  # False on repair turns (tool_choice "none", tools still sent)
    require_tools: bool = False  # the reply must be a tool call (tool_choice="required")


@dataclass(frozen=True)
class RunTools:
    calls: list[ToolCall]


Action = CallModel | RunTools


def next_action(policy: TurnPolicy, state: AgentState) -> Action | None:
    """What to do for ``state``; ``None`` when the agent has ended."""
    if state.status is AgentStatus.NEEDS_MODEL:
        require = _must_call_tool(policy, state)
        return CallModel(
            turns_left=max(policy.max_turns - state.steps, 1),
            allow_tools=require or not state.repairing,
            require_tools=require,
        )
    if state.status is AgentStatus.AWAITING_TOOLS:
        return RunTools(list(state.pending_calls))
    return None


def _must_call_tool(policy: TurnPolicy, state: AgentState) -> bool:
    """``tool_choice="required"`` and fewer than ``required_tool_rounds`` tool rounds in the
    conversation yet (replies whose calls ran: each has its results when a turn is due)."""
    if not policy.require_tool_call:
        return False
    rounds = sum(1 for m in state.messages if m.get("role") == "assistant" and m.get("tool_calls"))
    return rounds < policy.required_tool_rounds


def step(policy: TurnPolicy, state: AgentState, event: Event) -> AgentState:
    """Apply ``event`` to ``state``. Raises ``InvalidTransition`` for events that do not fit."""
    if isinstance(event, Cancelled | Abandoned):
        if state.terminal:
            raise InvalidTransition(f"agent {state.index} already ended ({state.status.value})")
        if isinstance(event, Cancelled):
            return _end(state, AgentStatus.CANCELLED, AgentError(kind="cancelled",
                                                                 message=event.reason))
        return _end(state, AgentStatus.FAILED, AgentError(kind=event.kind, message=event.message))
    if isinstance(event, ModelReplied | ModelFailed):
        if state.status is not AgentStatus.NEEDS_MODEL:
            raise InvalidTransition(f"agent {state.index} is not waiting on the model")
        if isinstance(event, ModelFailed):
            return _model_failed(policy, state, event)
        if event.attempts > 1:  # transport retries spent part of the agent's budget
            state = state.model_copy(update={"retries": state.retries + event.attempts - 1})
        if event.batch:
            state = state.model_copy(update={
                "batch_usage": state.batch_usage + event.response.usage,
                "batch_turns": state.batch_turns + 1})
        if event.response.hedge_usage is not None:  # a hedge's loser: paid, not replied
            state = state.model_copy(update={
                "hedge_usage": (state.hedge_usage or Usage()) + event.response.hedge_usage})
        if event.response.endpoint is not None and event.response.endpoint != state.endpoint:
            state = state.model_copy(update={"endpoint": event.response.endpoint})
        return _model_replied(policy, state, event.response)
    if state.status is not AgentStatus.AWAITING_TOOLS:
        raise InvalidTransition(f"agent {state.index} is not waiting on tools")
    return _tools_finished(policy, state, event)


def _bump(state: AgentState, **changes: object) -> AgentState:
    return replaced(state, {"version": state.version + 1, **changes})


def _end(state: AgentState, status: AgentStatus, error: AgentError | None,
         **changes: object) -> AgentState:
    return _bump(state, status=status, error=error, pending_calls=[], repairing=False, **changes)


def _model_failed(policy: TurnPolicy, state: AgentState, event: ModelFailed) -> AgentState:
    # Transport retries inside this call spent the same budget as a new turn would.
    retries = state.retries + event.attempts - 1
    if event.retryable and retries < policy.max_retries:
        return _bump(state, retries=retries + 1)
    attempts = retries + 1 if event.retryable else event.attempts
    message = f"{event.message} (after {attempts} attempt{'s' if attempts != 1 else ''})"
    return _end(state, AgentStatus.FAILED, AgentError(kind=event.kind, message=message),
                retries=retries)


def _model_replied(policy: TurnPolicy, state: AgentState, resp: ModelResponse) -> AgentState:
    counted = not state.repairing
    steps = state.steps + (1 if counted else 0)
    common: dict[str, Any] = {
        "turns": state.turns + 1,
        "steps": steps,
        "usage": state.usage + resp.usage,
        "messages": [*state.messages, resp.to_message()],
        "ttft_s": resp.ttft_s if state.ttft_s is None else state.ttft_s,
    }
    if resp.tool_calls:
        if steps >= policy.max_turns:
            error = AgentError(
                kind="max_turns",
                message=f"the model still called tools after max_turns={policy.max_turns} turns",
            )
            return _end(state, AgentStatus.FAILED, error, text=resp.text, **common)
        # Only the first calls run; the rest are answered in ``_tools_finished``.
        run = resp.tool_calls[: policy.max_tool_calls_per_turn]
        return _bump(state, status=AgentStatus.AWAITING_TOOLS, pending_calls=run,
                     repairing=False, **common)
    if _must_call_tool(policy, state):
        parsed = ParsedOutput(False, error=TOOL_REQUIRED_ERROR)
        prompt = REPAIR_TOOL_PROMPT
    else:
        parsed = policy.parse_output(resp.text)
        prompt = REPAIR_PROMPT
    if parsed.ok:
        return _end(state, AgentStatus.DONE, None, text=resp.text, output=parsed.value, **common)
    if state.retries < policy.max_retries:
        reason = parsed.error
        if resp.finish_reason in CUT_REPLY_ERRORS:
            reason = CUT_REPLY_ERRORS[resp.finish_reason]
            common["messages"] = [*state.messages, _cut_reply(resp.text or "")]
        repair = {"role": "user", "content": prompt.format(error=reason)}
        common["messages"] = [*common["messages"], repair]
        return _bump(state, retries=state.retries + 1, repairing=True, text=resp.text, **common)
    what = ("the reply was not a tool call (tool_choice='required')"
            if prompt is REPAIR_TOOL_PROMPT else "the final reply did not validate")
    error = AgentError(kind="invalid_output", message=f"{what}: {parsed.error}")
    return _end(state, AgentStatus.FAILED, error, text=resp.text, **common)


def _cut_reply(text: str) -> Message:
    """The assistant message kept for a reply cut off at the token limit (see above)."""
    kept = text if len(text) <= CUT_REPLY_KEEP else text[:CUT_REPLY_KEEP] + " [...]"
    return {"role": "assistant", "content": kept}


def _refused_calls(policy: TurnPolicy, state: AgentState) -> list[tuple[ToolCall, ToolOutcome]]:
    """The calls of the last reply past the cap (in the reply, not pending), each answered.

    They are derived from the assistant message itself, so the state needs no extra field,
    and answered after the calls that ran: every call of the reply gets its reply, in order
    (chat templates that drop tool-call ids pair results by position).
    """
    last = state.messages[-1] if state.messages else {}
    pending = {c.id for c in state.pending_calls}
    content = TOO_MANY_CALLS.format(cap=policy.max_tool_calls_per_turn)
    refused = []
    for part in last.get("tool_calls") or []:
        if part["id"] in pending:
            continue
        fn = part["function"]
        call = ToolCall(id=part["id"], name=fn["name"], arguments=json.loads(fn["arguments"]))
        refused.append((call, ToolOutcome(call_id=call.id, name=call.name, content=content,
                                          ok=False)))
    return refused


def _tools_finished(policy: TurnPolicy, state: AgentState, event: ToolsFinished) -> AgentState:
    by_id = {o.call_id: o for o in event.outcomes}
    missing = [c.id for c in state.pending_calls if c.id not in by_id]
    if missing:
        raise InvalidTransition(f"agent {state.index}: no outcome for tool calls {missing}")
    answered = [(c, by_id[c.id]) for c in state.pending_calls]
    answered += _refused_calls(policy, state)
    outcomes = [o for _, o in answered]
    records = [
        ToolCallRecord(turn=state.steps, name=c.name, arguments=c.arguments, ok=o.ok,
                       cached=o.cached, coalesced=o.coalesced, lock_lost=o.lock_lost,
                       error=None if o.ok else o.content[:TOOL_ERROR_CHARS])
        for c, o in answered
    ]
    return _bump(
        state,
        status=AgentStatus.NEEDS_MODEL,
        pending_calls=[],
        messages=[*state.messages, *(o.to_message() for o in outcomes)],
        tool_log=[*state.tool_log, *records],
    )
