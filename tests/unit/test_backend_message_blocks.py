"""Canonical messages -> neutral blocks: the rules both Anthropic and Bedrock depend on."""

from __future__ import annotations

from agentbatch.backends.anthropic_convert import build_body
from agentbatch.backends.bedrock_convert import converse_params
from agentbatch.backends.message_blocks import (
    FIRST_TURN_PLACEHOLDER,
    Image,
    Text,
    ToolResult,
    ToolUse,
    function_specs,
    safe_id,
    split_messages,
    stop_reason,
)
from agentbatch.core.model_io import ModelRequest

PNG = "iVBORw0KGgo="  # base64 of the PNG magic bytes


def test_leading_system_apart_late_system_becomes_user_text() -> None:
    system, turns = split_messages(
        [
            {"role": "system", "content": "A"},
            {"role": "system", "content": [{"type": "text", "text": "B"}]},
            {"role": "user", "content": "q"},
            {"role": "system", "content": "reminder"},
        ]
    )
    assert system == ["A", "B"]
    assert [(t.role, t.blocks) for t in turns] == [("user", [Text("q"), Text("reminder")])]


def test_tool_results_come_first_in_a_merged_user_turn() -> None:
    _, turns = split_messages(
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c:1", "function": {"name": "f", "arguments": "not json"}}],
            },
            {"role": "user", "content": "extra"},
            {"role": "tool", "tool_call_id": "c:1", "content": "r"},
        ]
    )
    assert turns[1].blocks == [ToolUse("c_1", "f", {})]  # ids sanitised, bad args -> {}
    assert turns[2].blocks == [ToolResult("c_1", "r"), Text("extra")]


def test_conversation_never_starts_with_the_assistant() -> None:
    _, turns = split_messages(
        [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    )
    assert turns[0].role == "user" and turns[0].blocks == [Text(FIRST_TURN_PLACEHOLDER)]
    assert [t.role for t in turns] == ["user", "assistant", "user"]


def test_images_and_unknown_parts() -> None:
    _, turns = split_messages(
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                    {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
                    {"type": "input_audio", "input_audio": {}},
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ]
    )
    assert turns[0].blocks == [
        Image("image/png", PNG),
        Image(url="https://x/y.jpg"),
        Text("what is this?"),
    ]
    req = ModelRequest(
        model="m",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                    {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}},
                ],
            }
        ],
    )
    anthropic = build_body(req, model="m")["messages"][0]["content"]
    assert anthropic[0]["source"] == {"type": "base64", "media_type": "image/png", "data": PNG}
    assert anthropic[1]["source"] == {"type": "url", "url": "https://x/y.jpg"}
    bedrock = converse_params(req, model_id="amazon.nova-pro-v1:0")["messages"][0]["content"]
    assert bedrock[0] == {"image": {"format": "png", "source": {"bytes": b"\x89PNG\r\n\x1a\n"}}}
    assert "omitted" in bedrock[1]["text"]


def test_function_specs_stop_reasons_and_ids() -> None:
    specs = function_specs(
        [
            {"type": "function", "function": {"name": "a", "description": "d"}},
            {"name": "b", "parameters": {"type": "object", "properties": {"x": {}}}},
            {"type": "function", "function": {"description": "nameless"}},
        ]
    )
    assert [(s.name, s.description) for s in specs] == [("a", "d"), ("b", "")]
    assert specs[0].parameters == {"type": "object", "properties": {}}
    assert stop_reason("max_tokens") == "length" and stop_reason("tool_use") == "tool_calls"
    assert stop_reason("something_new") == "something_new" and stop_reason(None) is None
    assert safe_id("toolu_01-ab") == "toolu_01-ab" and safe_id(None) == "tool_call"
