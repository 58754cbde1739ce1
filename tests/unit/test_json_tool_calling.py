"""Tool calling through guided JSON: the union schema, the history rendering, reply parsing."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel

from agentbatch.backends.base import BackendCapabilities
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ModelResponse, ToolOutcome
from agentbatch.core.options import BatchOptions
from agentbatch.core.output import OutputContract
from agentbatch.core.render import warmup_request
from agentbatch.turnloop.compile import compile_batch
from agentbatch.turnloop.json_tool_calling import (
    final_parser,
    mode_for_backends,
    parse_reply,
    read_reply,
    render_history,
    resolve_mode,
    union_schema,
)
from tests.support.tools import Answer, lookup, price


class Inner(BaseModel):
    x: int


class Nested(BaseModel):
    inner: Inner
    label: str


TOOLS = [lookup.openai_schema(), price.openai_schema()]


def _valid(schema: dict, value: object) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_union_accepts_calls_to_each_tool_and_a_final_answer() -> None:
    schema = union_schema(TOOLS, Answer.model_json_schema(), max_calls=3)
    assert _valid(schema, {"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}}]})
    assert _valid(schema, {"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}},
                                          {"name": "price", "arguments": {"item": "b"}}]})
    assert _valid(schema, {"final": {"summary": "s", "score": 1}})


@pytest.mark.parametrize("bad", [
    {"tool_calls": []},  # at least one call
    {"tool_calls": [{"name": "nope", "arguments": {"key": "a"}}]},  # unknown tool
    {"tool_calls": [{"name": "price", "arguments": {"key": "a"}}]},  # another tool's args
    {"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}}] * 4},  # past max_calls
    {"final": {"summary": "s"}},  # the output schema applies
    {"final": {"summary": "s", "score": 1}, "extra": 1},
    {"answer": "x"},
])
def test_union_refuses_what_the_loop_could_not_use(bad: dict) -> None:
    assert not _valid(union_schema(TOOLS, Answer.model_json_schema(), max_calls=3), bad)


def test_repair_turns_allow_only_the_final_answer_and_no_schema_means_a_string() -> None:
    final_only = union_schema(TOOLS, None, allow_tools=False)
    assert _valid(final_only, {"final": "the answer"})
    assert not _valid(final_only, {"final": {"a": 1}})
    assert not _valid(final_only, {"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}}]})


def test_defs_of_the_output_schema_are_lifted_to_the_union_root() -> None:
    schema = union_schema(TOOLS, Nested.model_json_schema())
    assert "$defs" in schema and "output_Inner" in schema["$defs"]
    assert _valid(schema, {"final": {"inner": {"x": 1}, "label": "l"}})
    assert not _valid(schema, {"final": {"inner": {"x": "one"}, "label": "l"}})


def test_read_reply_tool_calls_get_deterministic_unique_ids() -> None:
    text = json.dumps({"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}},
                                      {"name": "lookup", "arguments": {"key": "a"}}]})
    reading = read_reply(text, turn=2)
    assert reading.calls is not None
    assert [c.id for c in reading.calls] == ["jc2_0", "jc2_1"]
    assert reading.calls[0].arguments == {"key": "a"}
    assert read_reply(text, turn=2) == reading


def test_read_reply_arguments_that_are_not_an_object_are_answered_with_an_error() -> None:
    reading = read_reply('{"tool_calls": [{"name": "lookup", "arguments": "key=a"}]}')
    assert reading.calls is not None and reading.calls[0].arguments_error


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"answer": 1}',
                                  '{"tool_calls": []}', '{"tool_calls": [{"arguments": {}}]}'])
def test_garbage_is_neither_calls_nor_final(text: str) -> None:
    reading = read_reply(text)
    assert reading.calls is None and not reading.has_final and reading.error


def test_parse_reply_turns_calls_into_tool_calls_and_keeps_the_text() -> None:
    text = '{"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}}]}'
    out = parse_reply(ModelResponse(text=text), allow_tools=True, turn=1)
    assert [c.name for c in out.tool_calls] == ["lookup"]
    assert out.text == text  # kept as the raw reply (result.text)
    # On a repair turn no call runs: the text goes to the output check, which refuses it.
    assert not parse_reply(ModelResponse(text=text), allow_tools=False, turn=1).tool_calls
    assert not final_parser(OutputContract(Answer))(text).ok
    # A final answer stays text.
    final = '{"final": {"summary": "s", "score": 2}}'
    assert not parse_reply(ModelResponse(text=final), allow_tools=True, turn=1).tool_calls


def test_final_parser_unwraps_and_validates() -> None:
    parse = final_parser(OutputContract(Answer))
    ok = parse('{"final": {"summary": "s", "score": 2}}')
    assert ok.ok and ok.value == {"summary": "s", "score": 2}
    bad = parse('{"final": {"summary": "s"}}')
    assert not bad.ok and "score" in (bad.error or "")
    garbage = parse("I think the answer is 2")
    assert not garbage.ok and "tool_calls" in (garbage.error or "")
    text = final_parser(OutputContract(None))
    assert text('{"final": "hello"}').value == "hello"
    assert not text('{"final": {"a": 1}}').ok
    assert not text("hello").ok  # free text outside the format gets a repair turn


def test_history_renders_calls_as_json_and_results_as_one_user_message() -> None:
    reply = parse_reply(ModelResponse(text='{"tool_calls": [{"name": "lookup", "arguments": '
                                           '{"key": "a"}}, {"name": "price", "arguments": '
                                           '{"item": "b"}}]}'), allow_tools=True, turn=1)
    assistant = reply.to_message()
    native = reply.model_copy(update={"text": None}).to_message()  # e.g. a native reply
    for msg in (assistant, native):
        history = [{"role": "user", "content": "task"}, msg,
                   ToolOutcome(call_id="jc1_0", name="lookup", content="A").to_message(),
                   ToolOutcome(call_id="jc1_1", name="price", content="B").to_message()]
        out = render_history(history)
        assert [m["role"] for m in out] == ["user", "assistant", "user"]
        assert all("tool_calls" not in m for m in out)
        calls = json.loads(out[1]["content"])["tool_calls"]
        assert [c["name"] for c in calls] == ["lookup", "price"]
        lines = out[2]["content"].splitlines()[1:-1]
        assert out[2]["content"].endswith('reply with {"final": ...} now.')
        assert [json.loads(line) for line in lines] == [
            {"name": "lookup", "arguments": {"key": "a"}, "result": "A"},
            {"name": "price", "arguments": {"item": "b"}, "result": "B"},
        ]


def _assistant_turn(text: str | None, calls_from: str) -> str:
    reply = parse_reply(ModelResponse(text=calls_from), allow_tools=True, turn=1)
    msg = reply.model_copy(update={"text": text}).to_message()
    return render_history([{"role": "user", "content": "task"}, msg])[1]["content"]


def test_the_assistant_turn_repeats_the_models_reply_token_for_token() -> None:
    """The engine's prefix cache holds the reply as generated: the next turn must send it
    back byte for byte (key order included), not re-rendered with sorted keys."""
    raw = '{"tool_calls":[{"name":"price","arguments":{"item":"kettle","qty":2}}]}'
    assert _assistant_turn(raw, raw) == raw
    pretty = '{"tool_calls": [\n  {"name": "price", "arguments": {"item": "kettle", "qty": 2}}]}'
    assert _assistant_turn(pretty, pretty) == raw  # compacted, the model's order kept
    # a reply that is not plain JSON, or says other calls, is rendered from the calls
    fenced = "```json\n" + raw + "\n```"
    assert _assistant_turn(fenced, fenced) == raw
    assert _assistant_turn(None, raw) == raw
    other = '{"tool_calls":[{"name":"price","arguments":{"item":"toaster","qty":2}}]}'
    assert _assistant_turn(other, raw) == raw


def _caps(**kw: object) -> BackendCapabilities:
    return BackendCapabilities(native_json_schema=True, **kw)  # type: ignore[arg-type]


def test_auto_picks_json_only_where_native_tool_calls_cannot_be_forced() -> None:
    weak = _caps(tool_choice_required=False)
    assert resolve_mode("auto", [weak], has_tools=True, native_json_schema=True) == "json"
    assert resolve_mode("auto", [_caps()], has_tools=True, native_json_schema=True) == "native"
    assert resolve_mode("auto", [weak], has_tools=False, native_json_schema=True) == "native"
    no_guided = BackendCapabilities(tool_choice_required=False)
    assert resolve_mode("auto", [no_guided], has_tools=True,
                        native_json_schema=True) == "native"
    assert mode_for_backends("auto", ["llamacpp://127.0.0.1:1"], has_tools=True,
                             native_json_schema=True) == "json"
    assert mode_for_backends("auto", ["http://127.0.0.1:1"], has_tools=True,
                             native_json_schema=True) == "native"


def _opts(**kw: object) -> BatchOptions:
    base: dict = {"task": "do {x}", "inputs": [{"x": 1}], "backend": "http://127.0.0.1:1",
                  "model": "m", "tools": [lookup], "output_schema": Answer,
                  "tool_calling": "json"}
    return BatchOptions(**{**base, **kw})


@pytest.mark.parametrize(("kw", "words"), [
    ({"tool_calling": "xml"}, "tool_calling must be one of"),
    ({"tool_calling": None}, "tool_calling must be one of"),
    ({"tools": []}, "tool_calling='json' cannot apply to a batch without tools"),
    ({"native_json_schema": False}, "native_json_schema=False"),
])
def test_a_json_mode_that_cannot_apply_is_refused_at_submit(kw: dict, words: str) -> None:
    with pytest.raises(BatchSpecError, match="tool_calling") as info:
        compile_batch(_opts(**kw))
    assert words in str(info.value)


def test_a_backend_without_guided_json_is_refused_by_name() -> None:
    with pytest.raises(BatchSpecError, match="tool_calling='json' cannot apply to backend"):
        resolve_mode("json", [BackendCapabilities()], has_tools=True, native_json_schema=True,
                     backend_names=["nojson://x"])


def test_the_plan_carries_the_mode_and_the_prefix_describes_the_tools() -> None:
    plan = compile_batch(_opts(system_prompt="Be brief.", tools=[lookup, price])).plan
    assert plan.tool_calling == "json"
    assert plan.system_message.startswith("Be brief.")
    assert '"tool_calls"' in plan.system_message and '"final"' in plan.system_message
    assert "- lookup: Look up a key" in plan.system_message
    assert "- price: The price of an item" in plan.system_message
    warm = warmup_request(plan)
    assert warm.tools == [] and warm.tool_choice is None
    native = compile_batch(_opts(tool_calling="native")).plan
    assert native.tool_calling == "native" and '"tool_calls"' not in native.system_message
    assert compile_batch(_opts(tool_calling="auto")).plan.tool_calling == "native"
