"""Turn an agent's state into the model request for its next turn.

The system message and tool schemas come from the plan unchanged, so every agent's request
starts with the same bytes and the server's prefix cache serves them.
"""

from __future__ import annotations

from agentbatch.core.agent_state import AgentState
from agentbatch.core.model_io import ModelRequest, agent_key
from agentbatch.core.plan import BatchPlan
from agentbatch.core.turns import CallModel


def prefix_messages(plan: BatchPlan) -> list[dict[str, object]]:
    return [{"role": "system", "content": plan.system_message}]


def build_request(plan: BatchPlan, state: AgentState, action: CallModel) -> ModelRequest:
    # Guided JSON would stop a model from emitting tool calls, so the schema is enforced
    # natively only on turns where no tool call can follow: tool-free batches and repairs.
    structured = plan.output_json_schema is not None and plan.native_json_schema and (
        not plan.has_tools or not action.allow_tools
    )
    tool_choice = None
    if plan.has_tools:
        tool_choice = ("required" if action.require_tools
                       else "auto" if action.allow_tools else "none")
    return ModelRequest(
        model=plan.model,
        messages=[*prefix_messages(plan), *state.messages],
        tools=plan.tool_schemas,
        json_schema=(
            {"name": plan.output_schema_name or "output", "schema": plan.output_json_schema}
            if structured else None
        ),
        tool_choice=tool_choice,
        max_tokens=plan.max_tokens,
        temperature=plan.temperature,
        request_id=f"{plan.batch_id}-{state.index}-v{state.version}",
        agent_key=agent_key(plan.batch_id, state.index),
        cached_on=state.endpoint,
        turns_left=action.turns_left,
        timeout_s=plan.timeout_per_turn,
    )


def warmup_request(plan: BatchPlan) -> ModelRequest:
    """A one-token request carrying only the shared prefix, to fill the prefix cache."""
    return ModelRequest(
        model=plan.model,
        messages=[*prefix_messages(plan), {"role": "user", "content": "ok"}],
        # json tool calling sends no native tools: the warm prefix must match its turns.
        tools=plan.tool_schemas if plan.tool_calling != "json" else [],
        tool_choice="none" if plan.has_tools and plan.tool_calling != "json" else None,
        max_tokens=1,
        request_id=f"{plan.batch_id}-warmup",
        agent_key=f"{plan.batch_id}:warmup",
        timeout_s=plan.timeout_per_turn,
    )
