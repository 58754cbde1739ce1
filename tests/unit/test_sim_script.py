"""The scripted model: directive parsing, turn planning and scripted/random fault bookkeeping."""

from __future__ import annotations

import json

import pytest

from agentbatch.sim.faults import (
    MALFORMED_TEXT,
    FaultState,
    RandomFaults,
    faulted_reply,
    parse_fault_rates,
)
from agentbatch.sim.model import completion_cost, fenced_schema, plan_chat, plan_completion
from agentbatch.sim.script import (
    agent_key,
    answered_calls,
    content_text,
    parse_script,
    pending_round,
    sha1_hex,
)

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]

TASK = """Summarise the repo.
@sim tool read {"path": "a.txt"}
@sim tools ls {"dir": "/"} ; grep {"pattern": "x;y", "n": 2}
@sim tool read {"path": "b.txt"}
"""


def chat(task: str, *history: dict, **extra) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": task}, *history]}
    body.setdefault("tools", TOOLS)
    body.update(extra)
    return body


def answer_all(message: dict) -> list[dict]:
    """The assistant message plus one tool message per call (what an agent loop appends)."""
    tool_msgs = [
        {"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in message["tool_calls"]
    ]
    return [message, *tool_msgs]


def as_message(plan) -> dict:
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in plan.reply.tool_calls
    ]
    return {"role": "assistant", "content": plan.reply.content, "tool_calls": calls}


def test_parse_directives_in_order():
    script = parse_script([TASK + "@sim tokens 40\n@sim fail http_429 times=2 retry_after=0.05"])
    assert [[c.name for c in r] for r in script.rounds] == [["read"], ["ls", "grep"], ["read"]]
    assert script.rounds[1][1].arguments == {"pattern": "x;y", "n": 2}  # ';' inside JSON is fine
    assert script.tokens == 40
    (fail,) = script.fails
    assert (fail.kind, fail.times, fail.retry_after) == ("http_429", 2, "0.05")
    assert script.answer is None and script.errors == []


def test_bad_directives_are_reported_not_fatal():
    script = parse_script(["@sim tool read [1]\n@sim fail explode\n@sim dance\n@sim tool ok"])
    assert len(script.errors) == 3
    assert script.rounds[0][0].name == "ok" and script.rounds[0][0].arguments == {}


def test_answer_keeps_text_verbatim_with_newline_escapes():
    script = parse_script(['  @sim answer ```json\\n{"a": 1,}\\n```  '])
    assert script.answer == '```json\n{"a": 1,}\n```  '


def test_content_parts_and_agent_key():
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]
    assert content_text(parts) == "hello world"
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": parts},
        {"role": "user", "content": "later"},
    ]
    assert agent_key(messages) == sha1_hex("hello world")


def test_full_conversation_walks_the_rounds():
    history: list[dict] = []
    seen = []
    for _ in range(3):
        plan = plan_chat(chat(TASK, *history))
        assert plan.reply.finish_reason == "tool_calls"
        seen.append([(c.name, json.loads(c.arguments)) for c in plan.reply.tool_calls])
        history += answer_all(as_message(plan))
    assert seen == [
        [("read", {"path": "a.txt"})],
        [("ls", {"dir": "/"}), ("grep", {"n": 2, "pattern": "x;y"})],
        [("read", {"path": "b.txt"})],
    ]
    final = plan_chat(chat(TASK, *history))
    assert final.reply.tool_calls == [] and final.reply.finish_reason == "stop"
    assert final.reply.content == f"sim answer {final.agent_key[:8]}"


def test_unanswered_call_is_emitted_again_with_same_id():
    first = plan_chat(chat(TASK))
    msg = as_message(first)
    again = plan_chat(chat(TASK, msg))  # assistant call without a tool result
    assert again.reply.tool_calls == first.reply.tool_calls


def test_answer_must_match_name_and_canonical_args():
    key_order = plan_chat(chat(TASK))
    call = key_order.reply.tool_calls[0]
    wrong = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "x1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        ],
    }
    answered = answered_calls([wrong, {"role": "tool", "tool_call_id": "x1", "content": "?"}])
    assert pending_round(parse_script([TASK]), answered)[0].name == call.name


def test_parallel_round_partially_answered_emits_the_rest():
    history = answer_all(as_message(plan_chat(chat(TASK))))
    second = as_message(plan_chat(chat(TASK, *history)))
    second["tool_calls"] = second["tool_calls"][:1]  # only "ls" got an answer
    plan = plan_chat(chat(TASK, *history, *answer_all(second)))
    assert [c.name for c in plan.reply.tool_calls] == ["grep"]


def test_repeated_identical_calls_get_distinct_ids():
    task = '@sim tool read {"p": 1}\n@sim tool read {"p": 1}'
    first = plan_chat(chat(task))
    second = plan_chat(chat(task, *answer_all(as_message(first))))
    assert second.reply.tool_calls and second.reply.tool_calls[0].id != first.reply.tool_calls[0].id


@pytest.mark.parametrize("extra", [{"tool_choice": "none"}, {"tools": []}])
def test_no_tool_calls_without_tools(extra):
    plan = plan_chat(chat(TASK, **extra))
    assert plan.reply.tool_calls == [] and plan.reply.content.startswith("sim answer")
    assert plan.pending  # still known, for bad_tool_call faults


def test_answer_priority_answer_then_response_format_then_fenced_schema():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert plan_chat(chat("@sim answer hi", response_format=rf)).reply.content == "hi"
    assert set(json.loads(plan_chat(chat("task", response_format=rf)).reply.content)) == {"n"}
    assert set(
        json.loads(plan_chat(chat("task", guided_json=json.dumps(schema))).reply.content)
    ) == {"n"}
    other = {"type": "object", "properties": {"z": {"type": "string"}}}
    system = f"```json\n{json.dumps(other)}\n```\nthen\n```json\n{json.dumps(schema)}\n```\n"
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "t"}],
    }
    assert set(json.loads(plan_chat(body).reply.content)) == {"n"}
    assert fenced_schema("no fences") is None


def test_completion_plan_and_cost():
    plan = plan_completion("@sim answer 12345678\n@sim tokens 7", {})
    assert plan.text == "12345678" and completion_cost(plan.script, plan.text) == 7
    assert completion_cost(parse_script([""]), "x" * 40) == 11
    assert completion_cost(parse_script([""]), "x" * 400, max_tokens=5) == 5


def test_scripted_faults_count_per_agent_and_in_order():
    fails = parse_script(["@sim fail http_500 times=2\n@sim fail http_429 retry_after=0.5"]).fails
    state = FaultState()
    kinds = [getattr(state.next_fault("a", fails), "kind", None) for _ in range(5)]
    assert kinds == ["http_500", "http_500", "http_429", None, None]
    assert state.next_fault("b", fails).kind == "http_500"  # other agents count separately
    state.clear()
    assert state.next_fault("a", fails).kind == "http_500"


def test_random_faults_are_deterministic_and_roughly_at_rate():
    rates = parse_fault_rates("http_500=0.2, http_429=0.1")
    a, b = RandomFaults(rates, seed=7), RandomFaults(rates, seed=7)
    draws = [getattr(a.decide(n), "kind", None) for n in range(2000)]
    assert draws == [getattr(b.decide(n), "kind", None) for n in range(2000)]
    assert 300 < draws.count("http_500") < 500 and 120 < draws.count("http_429") < 280
    assert RandomFaults({}, 1).decide(5) is None


@pytest.mark.parametrize("spec", ["boom=0.1", "http_500", "http_500=2", "http_500=0.6,timeout=0.6"])
def test_parse_fault_rates_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        parse_fault_rates(spec)


def test_faulted_replies():
    plan = plan_chat(chat(TASK))
    bad = faulted_reply("bad_tool_call", plan.reply, plan.pending, plan.agent_key)
    (call,) = bad.tool_calls
    assert call.name == "read"
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    none = faulted_reply("bad_tool_call", plan.reply, [], plan.agent_key)
    assert none.tool_calls[0].name == "no_such_tool" and none.tool_calls[0].arguments == "{}"
    broken = faulted_reply("malformed_json", plan.reply, plan.pending, plan.agent_key)
    assert broken.content == MALFORMED_TEXT and broken.tool_calls == []


def test_answer_edge_spacing():
    assert parse_script(["@sim answer"]).answer == ""
    assert parse_script(["@sim  answer  two spaces"]).answer == " two spaces"
    assert parse_script(["x\n@sim answer last\r\n"]).answer == "last"
