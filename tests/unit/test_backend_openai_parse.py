"""Lenient parsing of chat-completion bodies (edge cases beyond the HTTP integration test)."""

from __future__ import annotations

import pytest

from agentbatch.backends.openai_compat import OpenAICompatBackend, response_format
from agentbatch.backends.openai_parse import (
    content_text,
    parse_arguments,
    parse_chat_completion,
    parse_tool_calls,
)
from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ModelRequest


def test_content_variants() -> None:
    assert content_text(None) is None
    assert content_text("x") == "x"
    assert content_text([{"type": "text", "text": "a"}, "b", {"type": "image_url"}]) == "ab"
    assert content_text([{"type": "image_url"}]) is None


@pytest.mark.parametrize(
    ("raw", "args", "error_part"),
    [
        ('{"a": 1}', {"a": 1}, None),
        ({"a": 1}, {"a": 1}, None),
        (None, {}, None),
        ("", {}, None),
        ('"{\\"a\\": 1}"', {"a": 1}, None),  # double-encoded
        ("{oops", {}, "not valid JSON"),
        ("[1, 2]", {}, "got list"),
        ("42", {}, "got int"),
        (["x"], {}, "got list"),
    ],
)
def test_parse_arguments(raw: object, args: dict, error_part: str | None) -> None:
    got_args, error = parse_arguments(raw)
    assert got_args == args
    if error_part is None:
        assert error is None
    else:
        assert error is not None and error_part in error


def test_bad_arguments_error_is_truncated() -> None:
    _, error = parse_arguments("{" + "x" * 5000)
    assert error is not None and len(error) < 600 and "more chars" in error


def test_tool_call_without_name_or_id() -> None:
    [call] = parse_tool_calls([{"function": {"arguments": "{}"}}], "req-1")
    assert call.name == "" and call.arguments_error == "tool call has no function name"
    assert call.id.startswith("call_")
    [again] = parse_tool_calls([{"function": {"arguments": "{}"}}], "req-1")
    [other] = parse_tool_calls([{"function": {"arguments": "{}"}}], "req-2")
    assert again.id == call.id != other.id


def test_malformed_tool_call_entries_are_skipped() -> None:
    assert parse_tool_calls("nope", "r") == []
    calls = parse_tool_calls([None, 3, {"id": "c", "function": {"name": "f"}}], "r")
    assert [(c.id, c.name, c.arguments) for c in calls] == [("c", "f", {})]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([], "not a JSON object"),
        ({}, "no choices"),
        ({"choices": []}, "no choices"),
        ({"error": {"message": "overloaded"}}, "overloaded"),
    ],
)
def test_malformed_bodies_are_server_errors(body: object, match: str) -> None:
    with pytest.raises(ServerError, match=match):
        parse_chat_completion(body, who="b")


def test_usage_is_lenient() -> None:
    resp = parse_chat_completion(
        {
            "choices": [{"message": {"content": "x"}, "finish_reason": None}],
            "usage": {"prompt_tokens": "12", "completion_tokens": None},
            "meta_info": {"cached_tokens": 8},
        }
    )
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (12, 0)
    assert resp.usage.cached_tokens == 8
    assert resp.finish_reason is None
    assert parse_chat_completion({"choices": [{}]}).usage.prompt_tokens == 0


def test_response_format_shapes() -> None:
    assert response_format({"name": "My Answer!", "schema": {"type": "object"}, "strict": 1}) == {
        "type": "json_schema",
        "json_schema": {"name": "My_Answer_", "schema": {"type": "object"}, "strict": True},
    }
    bare = response_format({"type": "object"})
    assert bare["json_schema"] == {"name": "output", "schema": {"type": "object"}}


def test_openai_api_uses_max_completion_tokens() -> None:
    request = ModelRequest(model="gpt", messages=[], max_tokens=5)
    hosted = OpenAICompatBackend("openai://", api_key="sk-x").build_body(request)
    assert hosted["max_completion_tokens"] == 5 and "max_tokens" not in hosted
    local = OpenAICompatBackend("openai://localhost:1").build_body(request)
    assert local["max_tokens"] == 5


def test_json_schema_skipped_without_native_support() -> None:
    from agentbatch.backends.base import BackendCapabilities

    b = OpenAICompatBackend("http://h:1", capabilities=BackendCapabilities())
    body = b.build_body(ModelRequest(model="m", messages=[], json_schema={"name": "a"}))
    assert "response_format" not in body


def test_target_model_fills_an_empty_request_model() -> None:
    b = OpenAICompatBackend("vllm://h:1?model=qwen")
    assert b.build_body(ModelRequest(model="", messages=[]))["model"] == "qwen"
