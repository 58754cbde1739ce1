"""Build the user-facing result of an ended agent (shared by both engines)."""

from __future__ import annotations

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.model_io import replaced
from agentbatch.core.output import OutputContract
from agentbatch.core.plan import BatchPlan
from agentbatch.core.pricing import agent_cost
from agentbatch.core.results import AgentError, AgentResult


def keeps_transcript(plan: BatchPlan | None, state: AgentState) -> bool:
    """Whether an ended agent's conversation is kept: the batch asked for it, or the agent
    failed (its conversation is what explains the failure)."""
    return state.status is AgentStatus.FAILED or bool(plan is not None and plan.keep_transcript)


def result_from_state(state: AgentState, latency_s: float | None = None,
                      plan: BatchPlan | None = None, *,
                      transcript: bool = False) -> AgentResult:
    """The JSON-ready result; ``output`` is still the plain validated JSON value;
    ``cost_usd`` what the agent paid at ``plan.prices`` (``agent_cost``; None without);
    ``messages`` only with ``transcript`` (the distributed engine keeps them in Redis, not
    the result)."""
    ok = state.status is AgentStatus.DONE
    error = state.error
    if not ok and error is None:
        error = AgentError(kind="internal", message=f"agent ended as {state.status.value}")
    return AgentResult(
        index=state.index,
        input=state.input,
        ok=ok,
        output=state.output if ok else None,
        text=state.text,
        error=None if ok else error,
        turns=state.turns,
        usage=state.usage,
        cost_usd=None if plan is None else agent_cost(state, plan.prices, plan.model),
        tool_calls=state.tool_log,
        latency_s=latency_s,
        ttft_s=state.ttft_s,
        messages=list(state.messages) if transcript else None,
    )


def materialize(result: AgentResult, contract: OutputContract) -> AgentResult:
    """Turn the stored JSON output into an instance of the batch's output schema."""
    if result.ok and contract.schema is not None and isinstance(result.output, dict):
        return replaced(result, {"output": contract.instance(result.output)})
    return result
