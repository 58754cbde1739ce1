"""The agent state entry kept in Redis: lossless, and without what it need not carry."""

from __future__ import annotations

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.model_io import Usage
from agentbatch.core.results import AgentError
from agentbatch.distributed.state.redis_store import entry_state, state_entry, stored_state


def _round_trip(state: AgentState) -> AgentState:
    return entry_state(state_entry(state.version, stored_state(state)))


def test_unset_optional_fields_are_left_out_and_read_back_as_none() -> None:
    state = AgentState(index=3, input={"a": None, "b": 1}, version=2,
                       messages=[{"role": "user", "content": "hi"}])
    text = stored_state(state)
    for field in ("text", "ttft_s", "output", "error", "hedge_usage", "messages", "tool_log"):
        assert f'"{field}"' not in text
    back = _round_trip(state)
    assert back == state.model_copy(update={"messages": []})
    assert back.input == {"a": None, "b": 1}  # None inside values is kept


def test_set_fields_survive_including_nulls_inside_the_output() -> None:
    state = AgentState(index=0, input={}, status=AgentStatus.DONE, text='{"x":null}',
                       ttft_s=0.25, output={"x": None},
                       error=None)
    assert _round_trip(state) == state
    failed = AgentState(index=1, input={}, status=AgentStatus.FAILED,
                        error=AgentError(kind="timeout", message="slow"))
    assert _round_trip(failed) == failed
    hedged = AgentState(index=2, input={}, hedge_usage=Usage(prompt_tokens=7))
    assert _round_trip(hedged) == hedged
