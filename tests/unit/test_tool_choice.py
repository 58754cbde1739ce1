"""``tool_choice="required"``: the decisions, the json-mode schema and the submit-time checks."""

from __future__ import annotations

import jsonschema
import pytest

from agentbatch.backends.anthropic_convert import build_body
from agentbatch.backends.bedrock_convert import converse_params
from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ModelRequest, ModelResponse, ToolCall, ToolOutcome, Usage
from agentbatch.core.options import BatchOptions
from agentbatch.core.output import OutputContract
from agentbatch.core.render import build_request
from agentbatch.core.turns import (
    LOOP_REPLY_ERROR,
    REPAIR_TOOL_PROMPT,
    TOOL_REQUIRED_ERROR,
    CallModel,
    ModelReplied,
    ToolsFinished,
    TurnPolicy,
    next_action,
    step,
)
from agentbatch.sim.model import plan_chat
from agentbatch.turnloop.compile import compile_batch
from agentbatch.turnloop.json_tool_calling import adapt_request, union_schema
from tests.support.tools import Answer, lookup

CALL = ToolCall(id="c1", name="lookup", arguments={"key": "a"})


def _policy(required: bool = True, max_retries: int = 2) -> TurnPolicy:
    return TurnPolicy(max_turns=4, max_retries=max_retries,
                      parse_output=OutputContract(Answer).parse, require_tool_call=required)


def _fresh() -> AgentState:
    return AgentState(index=0, input={}, messages=[{"role": "user", "content": "go"}])


def _reply(text: str | None = None, calls: tuple[ToolCall, ...] = (),
           finish: str | None = None) -> ModelReplied:
    return ModelReplied(ModelResponse(text=text, tool_calls=list(calls), finish_reason=finish,
                                      usage=Usage(prompt_tokens=5, completion_tokens=2)))


FINAL = '{"summary": "s", "score": 1}'


def test_required_holds_until_the_first_tool_results_then_the_model_decides() -> None:
    policy = _policy()
    state = _fresh()
    assert next_action(policy, state) == CallModel(turns_left=4, allow_tools=True,
                                                   require_tools=True)
    state = step(policy, state, _reply(calls=(CALL,)))
    outcome = ToolOutcome(call_id="c1", name="lookup", content="v")
    state = step(policy, state, ToolsFinished([outcome]))
    assert next_action(policy, state) == CallModel(turns_left=3, allow_tools=True,
                                                   require_tools=False)
    assert step(policy, state, _reply(FINAL)).status is AgentStatus.DONE


def test_a_final_answer_before_any_tool_call_gets_a_repair_that_still_requires_a_call() -> None:
    policy = _policy()
    state = step(policy, _fresh(), _reply(FINAL))  # valid, but no tool was called
    assert state.status is AgentStatus.NEEDS_MODEL and state.repairing
    assert state.messages[-1]["content"] == REPAIR_TOOL_PROMPT.format(error=TOOL_REQUIRED_ERROR)
    action = next_action(policy, state)
    assert action == CallModel(turns_left=3, allow_tools=True, require_tools=True)
    assert step(policy, state, _reply(calls=(CALL,))).status is AgentStatus.AWAITING_TOOLS


def test_a_looping_required_call_is_answered_like_a_cut_off_reply() -> None:
    state = step(_policy(), _fresh(), _reply('{"tool_calls":[{"name":"lookup","arg',
                                             finish="loop"))
    assert state.messages[-1]["content"] == REPAIR_TOOL_PROMPT.format(error=LOOP_REPLY_ERROR)


def test_no_tool_call_within_the_retry_budget_ends_invalid_output_naming_the_option() -> None:
    state = step(_policy(max_retries=0), _fresh(), _reply(FINAL))
    assert state.status is AgentStatus.FAILED and state.error is not None
    assert state.error.kind == "invalid_output"
    assert "tool_choice='required'" in state.error.message


def test_auto_is_unchanged() -> None:
    policy = _policy(required=False)
    assert next_action(policy, _fresh()) == CallModel(turns_left=4, allow_tools=True)
    assert step(policy, _fresh(), _reply(FINAL)).status is AgentStatus.DONE


def _opts(**kw: object) -> BatchOptions:
    base: dict = {"task": "do {x}", "inputs": [{"x": 1}], "backend": "http://127.0.0.1:1",
                  "model": "m", "tools": [lookup], "output_schema": Answer,
                  "tool_choice": "required"}
    return BatchOptions(**{**base, **kw})


def test_native_requests_say_required_and_json_turns_allow_only_calls() -> None:
    plan = compile_batch(_opts(tool_calling="native")).plan
    state = _fresh()
    first = build_request(plan, state, CallModel(4, True, require_tools=True))
    assert first.tool_choice == "required"
    assert build_request(plan, state, CallModel(3, True)).tool_choice == "auto"
    jplan = compile_batch(_opts(tool_calling="json")).plan
    req = adapt_request(jplan, build_request(jplan, state, CallModel(4, True, True)),
                        allow_tools=True, require_tools=True)
    schema = req.json_schema["schema"]
    ok = {"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}}]}
    assert jsonschema.Draft202012Validator(schema).is_valid(ok)
    assert not jsonschema.Draft202012Validator(schema).is_valid({"final": {"summary": "s",
                                                                           "score": 1}})
    assert schema == union_schema(jplan.tool_schemas, jplan.output_json_schema,
                                  allow_final=False, max_calls=jplan.max_tool_calls_per_turn)


@pytest.mark.parametrize(("kw", "words"), [
    ({"tool_choice": "any"}, "tool_choice must be 'auto' or 'required'"),
    ({"tool_choice": None}, "tool_choice must be 'auto' or 'required'"),
    ({"tools": [], "tool_calling": "native"},
     "tool_choice='required' cannot apply to a batch without tools"),
    ({"backend": "llamacpp://127.0.0.1:1", "tool_calling": "native"},
     "tool_choice='required' cannot apply to backend llamacpp://127.0.0.1:1 with "
     "tool_calling='native'"),
])
def test_a_tool_choice_that_cannot_apply_is_refused_at_submit(kw: dict, words: str) -> None:
    with pytest.raises(BatchSpecError) as info:
        compile_batch(_opts(**kw))
    assert words in str(info.value)


def test_on_llamacpp_auto_and_json_modes_accept_required() -> None:
    for mode in ("auto", "json"):
        plan = compile_batch(_opts(backend="llamacpp://127.0.0.1:1", tool_calling=mode)).plan
        assert plan.tool_calling == "json" and plan.tool_choice == "required"


def _request(choice: str) -> ModelRequest:
    return ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                        tools=[lookup.openai_schema()], tool_choice=choice)


def test_hosted_apis_get_their_own_spelling_of_required() -> None:
    assert build_body(_request("required"), model="claude")["tool_choice"] == {"type": "any"}
    params = converse_params(_request("required"), model_id="anthropic.claude")
    assert params["toolConfig"]["toolChoice"] == {"any": {}}


def test_the_simulator_forces_a_call_like_vllm_when_required() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [lookup.openai_schema()], "tool_choice": "required"}
    plan = plan_chat(body)
    assert [c.name for c in plan.reply.tool_calls] == ["lookup"]
    assert plan_chat({**body, "tool_choice": "auto"}).reply.tool_calls == []
