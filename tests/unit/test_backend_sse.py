"""SSE framing and streamed chat-completion assembly, replayed from recorded chunk sequences."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agentbatch.backends.sse import SSEDecoder, StreamAssembler
from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ToolCall


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
    choices: bool = True,
) -> str:
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
    }
    if choices:
        body["choices"] = [
            {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
        ]
    body["usage"] = usage
    return "data: " + json.dumps(body)


# A vLLM-style stream: role first, text, two tool calls split over pieces, usage, [DONE].
VLLM_TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    "",
    chunk({"content": "Let me "}),
    "",
    chunk({"content": "check."}),
    "",
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "chatcmpl-tool-a",
                    "type": "function",
                    "function": {"name": "weather", "arguments": ""},
                }
            ]
        }
    ),
    "",
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    "",
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
    "",
    chunk(
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "chatcmpl-tool-b",
                    "type": "function",
                    "function": {"name": "time", "arguments": '{"tz"'},
                }
            ]
        }
    ),
    "",
    chunk({"tool_calls": [{"index": 1, "function": {"arguments": ': "CET"}'}}]}),
    "",
    chunk({}, finish="tool_calls"),
    "",
    chunk(
        usage={
            "prompt_tokens": 50,
            "completion_tokens": 20,
            "total_tokens": 70,
            "prompt_tokens_details": {"cached_tokens": 32},
        },
        choices=False,
    ),
    "",
    "data: [DONE]",
    "",
]


def replay(lines: list[str], **kw: Any) -> tuple[StreamAssembler, list[int]]:
    """Feed lines; returns the assembler and the line numbers where the first delta arrived."""
    decoder, asm, firsts = SSEDecoder(), StreamAssembler(**kw), []
    for n, line in enumerate(lines):
        for data in decoder.feed(line):
            if asm.feed_data(data):
                firsts.append(n)
    for data in decoder.flush():
        asm.feed_data(data)
    return asm, firsts


def test_tool_calls_assembled_by_index() -> None:
    asm, firsts = replay(VLLM_TOOL_STREAM)
    assert asm.done
    resp = asm.finish()
    assert resp.text == "Let me check."
    assert [(c.id, c.name, c.arguments) for c in resp.tool_calls] == [
        ("chatcmpl-tool-a", "weather", {"city": "Oslo"}),
        ("chatcmpl-tool-b", "time", {"tz": "CET"}),
    ]
    assert resp.finish_reason == "tool_calls"
    assert resp.usage.model_dump(exclude={"prompt_count"}) == {
        "prompt_tokens": 50,
        "cached_tokens": 32,
        "completion_tokens": 20,
    }
    # The role-only delta with empty content is not the first token; "Let me " is (its event
    # is dispatched by the blank line after it).
    assert len(firsts) == 1 and "Let me" in VLLM_TOOL_STREAM[firsts[0] - 1]


def test_tool_call_reported_when_next_index_starts() -> None:
    heard: list[tuple[str, int]] = []
    decoder = SSEDecoder()
    asm = StreamAssembler(on_tool_call=lambda c: heard.append((c.name, len(fed))))
    fed: list[str] = []
    for line in VLLM_TOOL_STREAM:
        fed.append(line)
        for data in decoder.feed(line):
            asm.feed_data(data)
    # "weather" completes when index 1 starts (before its arguments end); "time" at finish().
    assert [name for name, _ in heard] == ["weather"]
    weather_heard_at = heard[0][1]
    assert '"index": 1' in fed[weather_heard_at - 2]  # the event ends at the blank line
    asm.finish()
    assert [name for name, _ in heard] == ["weather", "time"]
    asm.finish()  # idempotent: each call is reported once
    assert len(heard) == 2


def test_reported_call_equals_final_call() -> None:
    heard: list[ToolCall] = []
    asm, _ = replay(VLLM_TOOL_STREAM, request_id="r1", on_tool_call=heard.append)
    assert heard == asm.finish().tool_calls


def test_listener_errors_do_not_fail_the_turn() -> None:
    def boom(call: ToolCall) -> None:
        raise RuntimeError("listener bug")

    asm, _ = replay(VLLM_TOOL_STREAM, on_tool_call=boom)
    assert len(asm.finish().tool_calls) == 2


def test_missing_ids_get_stable_ids_and_bad_arguments_are_kept() -> None:
    lines = [
        chunk({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": '{"a": 1'}}]}),
        "",
        chunk({}, finish="tool_calls"),
        "",
        "data: [DONE]",
        "",
    ]
    a = replay(lines, request_id="b:1:2")[0].finish()
    b = replay(lines, request_id="b:1:2")[0].finish()
    [call] = a.tool_calls
    assert call.id.startswith("call_") and call.id == b.tool_calls[0].id
    assert call.arguments == {} and "not valid JSON" in (call.arguments_error or "")


def test_pieces_without_index_use_ids() -> None:
    lines = [
        chunk({"tool_calls": [{"id": "c1", "function": {"name": "a", "arguments": "{}"}}]}),
        chunk({"tool_calls": [{"id": "c2", "function": {"name": "b", "arguments": '{"x"'}}]}),
        chunk({"tool_calls": [{"function": {"arguments": ": 2}"}}]}),
        chunk({}, finish="tool_calls"),
        "data: [DONE]",
    ]  # no blank lines between events: the decoder still splits them
    resp = replay(lines)[0].finish()
    assert [(c.id, c.name, c.arguments) for c in resp.tool_calls] == [
        ("c1", "a", {}),
        ("c2", "b", {"x": 2}),
    ]


def test_whole_tool_call_in_one_piece_with_object_arguments() -> None:
    lines = [
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "x",
                        "type": "function",
                        "function": {"name": "f", "arguments": {"k": "v"}},
                    }
                ]
            }
        ),
        "",
        chunk({}, finish="tool_calls"),
        "",
        "data: [DONE]",
        "",
    ]
    [call] = replay(lines)[0].finish().tool_calls
    assert call.arguments == {"k": "v"}


def test_decoder_framing() -> None:
    d = SSEDecoder()
    assert d.feed(": keep-alive") == []
    assert d.feed("event: message") == []
    assert d.feed('data: {"a":') == []
    assert d.feed("data: 1}") == []
    assert d.feed("") == ['{"a":\n1}']
    assert d.feed("data:[DONE]\r") == []
    assert d.flush() == ["[DONE]"]
    assert d.flush() == []


def test_error_chunk_raises_server_error() -> None:
    asm = StreamAssembler(who="vllm://x")
    with pytest.raises(ServerError, match="error in stream: boom"):
        asm.feed_data(json.dumps({"error": {"message": "boom"}}))
    with pytest.raises(ServerError, match="not JSON"):
        asm.feed_data("{truncated")


def test_text_only_stream_without_usage() -> None:
    lines = [
        chunk({"role": "assistant"}),
        "",
        chunk({"content": "Hi"}),
        "",
        chunk({"content": " there"}, finish="stop"),
        "",
        "data: [DONE]",
        "",
    ]
    resp = replay(lines)[0].finish()
    assert (resp.text, resp.tool_calls, resp.finish_reason) == ("Hi there", [], "stop")
    assert resp.usage.prompt_tokens == 0
