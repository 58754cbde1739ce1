"""``required_tool_rounds``: the decisions (rounds, not results, are counted) and the
submit-time checks; and the engine benchmark forces its rounds through it, patching nothing."""

from __future__ import annotations

import pytest

from agentbatch import run_batch
from agentbatch.core import turns
from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ModelResponse, ToolCall, ToolOutcome
from agentbatch.core.options import BatchOptions
from agentbatch.core.output import OutputContract
from agentbatch.core.turns import (
    TOOL_REQUIRED_ERROR,
    CallModel,
    ModelReplied,
    ToolsFinished,
    TurnPolicy,
    next_action,
    step,
)
from agentbatch.turnloop.compile import compile_batch
from tests.support.tools import Answer, lookup

SIM = "sim://127.0.0.1:8000"
FINAL = '{"summary": "s", "score": 1}'


def _policy(rounds: int) -> TurnPolicy:
    return TurnPolicy(max_turns=6, max_retries=2, parse_output=OutputContract(Answer).parse,
                      max_tool_calls_per_turn=1, require_tool_call=True,
                      required_tool_rounds=rounds)


def _round(policy: TurnPolicy, state: AgentState, n: int, calls: int = 1) -> AgentState:
    """One tool round of ``calls`` calls (past the cap of one, answered with an error)."""
    made = [ToolCall(id=f"c{n}-{i}", name="lookup", arguments={"key": str(i)})
            for i in range(calls)]
    state = step(policy, state, ModelReplied(ModelResponse(tool_calls=made)))
    outcome = ToolOutcome(call_id=made[0].id, name="lookup", content="v")
    return step(policy, state, ToolsFinished([outcome]))


def test_every_turn_is_a_forced_call_until_the_rounds_are_done() -> None:
    policy = _policy(3)
    state = AgentState(index=0, input={}, messages=[{"role": "user", "content": "go"}])
    for n in range(3):
        action = next_action(policy, state)
        assert isinstance(action, CallModel) and action.require_tools, n
        state = _round(policy, state, n)
    action = next_action(policy, state)
    assert isinstance(action, CallModel) and not action.require_tools
    done = step(policy, state, ModelReplied(ModelResponse(text=FINAL)))
    assert done.status is AgentStatus.DONE


def test_an_answer_before_the_rounds_are_done_gets_a_tool_repair() -> None:
    policy = _policy(2)
    state = _round(policy, AgentState(index=0, input={}, messages=[
        {"role": "user", "content": "go"}]), 0)
    state = step(policy, state, ModelReplied(ModelResponse(text=FINAL)))
    assert state.status is AgentStatus.NEEDS_MODEL and state.repairing
    assert TOOL_REQUIRED_ERROR in state.messages[-1]["content"]
    action = next_action(policy, state)
    assert isinstance(action, CallModel) and action.require_tools and action.allow_tools


def test_a_round_counts_once_however_many_calls_it_made() -> None:
    # three calls in one reply (two past the cap, each answered with an error): one round
    policy = _policy(2)
    state = _round(policy, AgentState(index=0, input={}, messages=[
        {"role": "user", "content": "go"}]), 0, calls=3)
    assert sum(1 for m in state.messages if m.get("role") == "tool") == 3
    action = next_action(policy, state)
    assert isinstance(action, CallModel) and action.require_tools


def _submit(**options: object) -> None:
    run_batch("t {x}", [{"x": 1}], model="m", backend=SIM, tools=[lookup], **options)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", None])
def test_bad_rounds_are_refused_naming_the_option(value: object) -> None:
    with pytest.raises(BatchSpecError, match="required_tool_rounds must be an integer >= 1"):
        _submit(tool_choice="required", required_tool_rounds=value)


def test_rounds_without_required_or_past_max_turns_are_refused() -> None:
    with pytest.raises(BatchSpecError, match=r"required_tool_rounds=3 cannot apply with "
                                             r"tool_choice='auto'"):
        _submit(required_tool_rounds=3)
    with pytest.raises(BatchSpecError, match=r"required_tool_rounds must be < max_turns \(4\)"):
        _submit(tool_choice="required", required_tool_rounds=4, max_turns=4)


def test_the_plan_carries_the_rounds_and_the_workers_policy_reads_them() -> None:
    from agentbatch.turnloop.runtime import BatchRuntime

    compiled = compile_batch(BatchOptions(task="t {x}", inputs=[{"x": 1}], model="m",
                                          backend=SIM, tools=[lookup], tool_choice="required",
                                          required_tool_rounds=3, max_turns=5))
    assert compiled.plan.required_tool_rounds == 3
    rt = BatchRuntime(plan=compiled.plan, contract=compiled.contract, tools=None,  # type: ignore[arg-type]
                      backend=None)  # type: ignore[arg-type]
    assert rt.policy.required_tool_rounds == 3 and rt.policy.require_tool_call


def test_bench_engine_forces_its_rounds_by_option_not_by_patching() -> None:
    before = turns._must_call_tool
    from benchmarks import bench_engine

    assert turns._must_call_tool is before  # importing it (as workers do) patches nothing
    kw = bench_engine._ab_kwargs("longconv", 2, 64, 0)
    assert kw["tool_choice"] == "required"
    assert kw["required_tool_rounds"] == bench_engine.PAGES == 6
    task = kw.pop("task")
    compile_batch(BatchOptions(task=task, backend=[SIM, "sim://127.0.0.1:8001"],
                               pool_routing="least_outstanding", **kw))  # accepted at submit
