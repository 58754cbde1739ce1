"""The agent turn state machine, as tables of (state, event) -> (state, action)."""

import pytest
from pydantic import BaseModel

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.model_io import FINISH_LOOP, ModelResponse, ToolCall, ToolOutcome, Usage
from agentbatch.core.output import OutputContract
from agentbatch.core.turns import (
    CUT_REPLY_ERROR,
    CUT_REPLY_KEEP,
    LOOP_REPLY_ERROR,
    Abandoned,
    CallModel,
    Cancelled,
    InvalidTransition,
    ModelFailed,
    ModelReplied,
    RunTools,
    ToolsFinished,
    TurnPolicy,
    next_action,
    step,
)


class Out(BaseModel):
    answer: int


def policy(max_turns=3, max_retries=1, schema=Out):
    return TurnPolicy(max_turns=max_turns, max_retries=max_retries,
                      parse_output=OutputContract(schema).parse)


def fresh(**kw):
    return AgentState(index=0, input={"x": 1}, messages=[{"role": "user", "content": "go"}], **kw)


CALL = ToolCall(id="c1", name="lookup", arguments={"q": "a"})


def reply(text=None, calls=(), prompt=10):
    return ModelReplied(ModelResponse(text=text, tool_calls=list(calls),
                                      usage=Usage(prompt_tokens=prompt, completion_tokens=2)))


@pytest.mark.parametrize(
    ("state", "event", "status", "action", "error_kind"),
    [
        # a final valid answer ends the agent
        (fresh(), reply('{"answer": 4}'), AgentStatus.DONE, None, None),
        # tool calls wait on tools; the next action runs them
        (fresh(), reply(calls=[CALL]), AgentStatus.AWAITING_TOOLS, RunTools([CALL]), None),
        # invalid output → a repair turn with tools disabled
        (fresh(), reply("not json"), AgentStatus.NEEDS_MODEL,
         CallModel(turns_left=2, allow_tools=False), None),
        # invalid output with no retries left → invalid_output
        (fresh(retries=1), reply("not json"), AgentStatus.FAILED, None, "invalid_output"),
        # a retryable failure with budget → same turn again
        (fresh(), ModelFailed("server_error", "500", True), AgentStatus.NEEDS_MODEL,
         CallModel(turns_left=3, allow_tools=True), None),
        # a retryable failure without budget → failed with that kind
        (fresh(retries=1), ModelFailed("rate_limited", "429", True), AgentStatus.FAILED, None,
         "rate_limited"),
        # a non-retryable failure fails at once, budget or not
        (fresh(), ModelFailed("bad_request", "context too long", False), AgentStatus.FAILED,
         None, "bad_request"),
        # tool calls on the last allowed turn → max_turns
        (fresh(steps=2), reply(calls=[CALL]), AgentStatus.FAILED, None, "max_turns"),
        # cancel and abandon end any running agent
        (fresh(), Cancelled(), AgentStatus.CANCELLED, None, "cancelled"),
        (fresh(status=AgentStatus.AWAITING_TOOLS, pending_calls=[CALL]),
         Abandoned("tool_import", "tool 'x' could not be imported"), AgentStatus.FAILED, None,
         "tool_import"),
    ],
)
def test_transitions(state, event, status, action, error_kind):
    new = step(policy(), state, event)
    assert new.status is status
    assert new.version == state.version + 1
    assert next_action(policy(), new) == action
    assert (new.error.kind if new.error else None) == error_kind


def test_tool_results_feed_the_next_turn_in_call_order():
    calls = [ToolCall(id="a", name="t", arguments={"n": 1}),
             ToolCall(id="b", name="t", arguments={"n": 2})]
    s = step(policy(), fresh(), reply(calls=calls))
    outcomes = [ToolOutcome(call_id="b", name="t", content="two", ok=True, cached=True),
                ToolOutcome(call_id="a", name="t", content="one", ok=False)]
    s = step(policy(), s, ToolsFinished(outcomes))
    assert s.status is AgentStatus.NEEDS_MODEL
    assert [m["tool_call_id"] for m in s.messages[-2:]] == ["a", "b"]
    assert [(r.ok, r.cached) for r in s.tool_log] == [(False, False), (True, True)]
    assert next_action(policy(), s) == CallModel(turns_left=2, allow_tools=True)


def test_full_loop_counts_turns_and_usage():
    p = policy()
    s = step(p, fresh(), reply(calls=[CALL], prompt=100))
    s = step(p, s, ToolsFinished([ToolOutcome(call_id="c1", name="lookup", content="r")]))
    s = step(p, s, reply("oops", prompt=120))  # repair
    s = step(p, s, reply('{"answer": 1}', prompt=130))
    assert s.status is AgentStatus.DONE and s.output == {"answer": 1}
    assert (s.turns, s.steps, s.retries) == (3, 2, 1)
    assert s.usage.prompt_tokens == 350 and s.version == 4
    roles = [m["role"] for m in s.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]


def test_repair_turn_does_not_use_a_step():
    s = step(policy(max_turns=1), fresh(), reply("bad"))
    assert s.repairing and s.steps == 1
    s2 = step(policy(max_turns=1), s, reply('{"answer": 2}'))
    assert s2.status is AgentStatus.DONE and s2.steps == 1


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (fresh(), ToolsFinished([])),  # not waiting on tools
        (fresh(status=AgentStatus.AWAITING_TOOLS, pending_calls=[CALL]), reply("x")),
        (fresh(status=AgentStatus.DONE), Cancelled()),  # already ended
        (fresh(status=AgentStatus.AWAITING_TOOLS, pending_calls=[CALL]),
         ToolsFinished([ToolOutcome(call_id="other", name="t", content="")])),
    ],
)
def test_stale_or_duplicate_events_are_refused(state, event):
    with pytest.raises(InvalidTransition):
        step(policy(), state, event)


def test_free_text_batches_accept_any_non_empty_reply():
    s = step(policy(schema=None), fresh(), reply("plain answer"))
    assert s.status is AgentStatus.DONE and s.output == "plain answer"


def test_step_is_pure():
    s = fresh()
    before = s.model_dump()
    step(policy(), s, reply(calls=[CALL]))
    assert s.model_dump() == before


def test_a_reply_cut_off_at_the_token_limit_goes_back_shortened():
    """A runaway reply is not fed back whole: its first words and why it failed suffice."""
    runaway = '{"answer": "' + "description." * 40
    cut = ModelReplied(ModelResponse(text=runaway, finish_reason="length",
                                     usage=Usage(prompt_tokens=10, completion_tokens=96)))
    s = step(policy(), fresh(), cut)
    assert s.repairing and s.text == runaway  # the whole reply stays the agent's text
    kept, repair = s.messages[-2:]
    assert kept == {"role": "assistant", "content": runaway[:CUT_REPLY_KEEP] + " [...]"}
    assert repair["role"] == "user" and CUT_REPLY_ERROR in repair["content"]
    # a reply that ended on its own but did not validate is still fed back whole
    s2 = step(policy(), fresh(), reply('{"answer": "x"}'))
    assert s2.messages[-2] == {"role": "assistant", "content": '{"answer": "x"}'}
    assert CUT_REPLY_ERROR not in s2.messages[-1]["content"]


def test_a_reply_stopped_because_it_looped_is_answered_like_a_cut_off_one():
    looped = '{"answer": "' + "ticket_1009_" * 5
    s = step(policy(), fresh(), ModelReplied(ModelResponse(text=looped,
                                                           finish_reason=FINISH_LOOP)))
    assert s.repairing and s.retries == 1
    kept, repair = s.messages[-2:]
    assert kept == {"role": "assistant", "content": looped[:CUT_REPLY_KEEP] + " [...]"}
    assert LOOP_REPLY_ERROR in repair["content"]
