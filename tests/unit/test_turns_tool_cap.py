"""max_tool_calls_per_turn in the pure state machine: calls past the cap are answered, not run."""

import pytest

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.model_io import ModelResponse, ToolCall, ToolOutcome
from agentbatch.core.output import OutputContract
from agentbatch.core.turns import (
    CallModel,
    ModelReplied,
    RunTools,
    ToolsFinished,
    TurnPolicy,
    next_action,
    step,
)


def policy(cap: int) -> TurnPolicy:
    return TurnPolicy(max_turns=5, max_retries=1, parse_output=OutputContract(None).parse,
                      max_tool_calls_per_turn=cap)


def calls(n: int) -> list[ToolCall]:
    return [ToolCall(id=f"c{i}", name=f"t{i % 2}", arguments={"n": i}) for i in range(n)]


def fresh() -> AgentState:
    return AgentState(index=0, input={}, messages=[{"role": "user", "content": "go"}])


@pytest.mark.parametrize(
    ("n_calls", "cap", "ran"),
    [
        (3, 32, 3),  # under the cap: every call runs
        (3, 3, 3),  # exactly at the cap
        (5, 2, 2),  # over: the first two run
        (2, 1, 1),  # cap of one
        (40, 32, 32),  # the default cap
    ],
)
def test_calls_past_the_cap_are_answered_with_an_error_in_call_order(n_calls, cap, ran):
    p = policy(cap)
    reply = calls(n_calls)
    s = step(p, fresh(), ModelReplied(ModelResponse(tool_calls=reply)))
    assert s.status is AgentStatus.AWAITING_TOOLS
    assert next_action(p, s) == RunTools(reply[:ran])  # only these are executed

    outcomes = [ToolOutcome(call_id=c.id, name=c.name, content=f"r{c.id}") for c in reply[:ran]]
    s = step(p, s, ToolsFinished(outcomes))
    assert s.status is AgentStatus.NEEDS_MODEL
    assert next_action(p, s) == CallModel(turns_left=4, allow_tools=True)

    # every call of the reply has exactly one tool message, in the reply's order
    tool_msgs = [m for m in s.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [c.id for c in reply]
    for m in tool_msgs[:ran]:
        assert m["content"] == f"r{m['tool_call_id']}"
    for m in tool_msgs[ran:]:
        assert m["content"].startswith("too many tool calls in one reply")
        assert f"at most {cap} run per turn" in m["content"]
    assert [(r.name, r.arguments, r.ok) for r in s.tool_log] == [
        (c.name, c.arguments, i < ran) for i, c in enumerate(reply)
    ]


def test_the_cap_applies_to_each_reply_separately():
    p = policy(2)
    s = step(p, fresh(), ModelReplied(ModelResponse(tool_calls=calls(3))))
    s = step(p, s, ToolsFinished([ToolOutcome(call_id=c.id, name=c.name, content="ok")
                                  for c in calls(2)]))
    second = [ToolCall(id="d0", name="t0"), ToolCall(id="d1", name="t1")]
    s = step(p, s, ModelReplied(ModelResponse(tool_calls=second)))
    assert next_action(p, s) == RunTools(second)
    s = step(p, s, ToolsFinished([ToolOutcome(call_id=c.id, name=c.name, content="ok")
                                  for c in second]))
    assert [m["content"] for m in s.messages if m["role"] == "tool"][-2:] == ["ok", "ok"]
    assert [r.ok for r in s.tool_log] == [True, True, False, True, True]
