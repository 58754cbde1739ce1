"""AnthropicBackend against a local aiohttp server replaying recorded Messages API bodies.

The scenario is the request's ``model``; every request body and header set is recorded so the
tests can assert exactly what went over the wire.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from agentbatch.backends.anthropic import AnthropicBackend
from agentbatch.backends.registry import backend_from_url
from agentbatch.core.errors import BadRequest, ConfigError, RateLimited, ServerError
from agentbatch.core.model_io import ModelRequest, ModelResponse, ToolCall, ToolOutcome

API_KEY = "sk-ant-api03-SECRET-0123456789abcdef"

# Recorded shapes of real Messages API replies (ids and numbers from a live session).
TOOL_USE_REPLY = {
    "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-20250514",
    "content": [
        {"type": "text", "text": "I'll check the weather in both cities."},
        {
            "type": "tool_use",
            "id": "toolu_01A09q90qw90lq917835lq9",
            "name": "weather",
            "input": {"city": "Oslo"},
        },
        {
            "type": "tool_use",
            "id": "toolu_01B8mx2h9aP3kQ7fW1cZ3rT",
            "name": "weather",
            "input": {"city": "Rome", "units": "C"},
        },
    ],
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 42,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 1830,
        "output_tokens": 96,
        "service_tier": "standard",
    },
}
FINAL_REPLY = {
    "id": "msg_01Aq9w938a90dw8q",
    "type": "message",
    "role": "assistant",
    "model": "claude-sonnet-4-20250514",
    "content": [
        {"type": "text", "text": "Oslo: rain, 7°C. "},
        {"type": "text", "text": "Rome: sun, 24°C."},
    ],
    "stop_reason": "end_turn",
    "stop_sequence": None,
    "usage": {
        "input_tokens": 310,
        "cache_creation_input_tokens": 1830,
        "cache_read_input_tokens": 0,
        "output_tokens": 21,
    },
}
INVALID_REQUEST = {
    "type": "error",
    "error": {
        "type": "invalid_request_error",
        "message": "messages.1.content.0: text content blocks must contain non-whitespace text",
    },
}
OVERLOADED = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
RATE_LIMITED = {
    "type": "error",
    "error": {
        "type": "rate_limit_error",
        "message": "Number of request tokens has exceeded your per-minute rate limit",
    },
}
AUTH = {
    "type": "error",
    "error": {"type": "authentication_error", "message": f"invalid x-api-key {API_KEY}"},
}

CANNED: dict[str, tuple[int, dict[str, str], dict[str, Any]]] = {
    "tool-use": (200, {}, TOOL_USE_REPLY),
    "final": (200, {}, FINAL_REPLY),
    "invalid": (400, {}, INVALID_REQUEST),
    "overloaded": (529, {"retry-after": "3"}, OVERLOADED),
    "rate-limited": (429, {"retry-after": "7"}, RATE_LIMITED),
    "auth": (401, {}, AUTH),
    "broken": (
        500,
        {},
        {"type": "error", "error": {"type": "api_error", "message": "Internal server error"}},
    ),
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}
SYSTEM = "You are a forecaster. Answer in one line per city."


class Recorder:
    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def messages(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((body, {k.lower(): v for k, v in request.headers.items()}))
        status, headers, payload = CANNED[body["model"]]
        return web.json_response(payload, status=status, headers=headers)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/messages", self.messages)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    @property
    def body(self) -> dict[str, Any]:
        return self.requests[-1][0]

    @property
    def headers(self) -> dict[str, str]:
        return self.requests[-1][1]


@pytest.fixture
async def server() -> AsyncIterator[Recorder]:
    rec = Recorder()
    await rec.start()
    yield rec
    assert rec.runner is not None
    await rec.runner.cleanup()


@pytest.fixture
async def backend(
    server: Recorder, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AnthropicBackend]:
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    # Not the official host: the key goes here only because it is named for this host.
    monkeypatch.setenv("AGENTBATCH_API_KEYS", f'{{"127.0.0.1:{server.port}": "ANTHROPIC_API_KEY"}}')
    b = backend_from_url(f"anthropic://127.0.0.1:{server.port}", timeout=30)
    assert isinstance(b, AnthropicBackend)
    yield b
    await b.aclose()


def first_turn(model: str, **kw: Any) -> ModelRequest:
    return ModelRequest(
        model=model,
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Weather in Oslo and Rome?"},
        ],
        tools=[WEATHER, CLOCK],
        **kw,
    )


async def test_tool_use_round_trip(server: Recorder, backend: AnthropicBackend) -> None:
    # Turn 1: the model asks for two tool calls.
    req1 = first_turn("tool-use", tool_choice="auto", temperature=0.2)
    resp = await backend.complete(req1)
    assert resp.text == "I'll check the weather in both cities."
    assert [(c.id, c.name, c.arguments) for c in resp.tool_calls] == [
        ("toolu_01A09q90qw90lq917835lq9", "weather", {"city": "Oslo"}),
        ("toolu_01B8mx2h9aP3kQ7fW1cZ3rT", "weather", {"city": "Rome", "units": "C"}),
    ]
    assert resp.finish_reason == "tool_calls"
    assert resp.usage.model_dump(exclude={"prompt_count"}) == {
        "prompt_tokens": 1872,
        "cached_tokens": 1830,
        "completion_tokens": 96,
    }
    body, headers = server.body, server.headers
    assert headers["x-api-key"] == API_KEY
    assert headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in headers
    assert body == {
        "model": "tool-use",
        "max_tokens": 4096,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Rome?"}]}
        ],
        "tools": [
            {
                "name": "weather",
                "description": "Weather for a city.",
                "input_schema": WEATHER["function"]["parameters"],
            },
            {
                "name": "clock",
                "input_schema": {"type": "object"},
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tool_choice": {"type": "auto"},
        "temperature": 0.2,
    }

    # Turn 2: the canonical history (as the agent core builds it) goes back to Anthropic.
    outcomes = [
        ToolOutcome(call_id=c.id, name=c.name, content=f"rain #{i}")
        for i, c in enumerate(resp.tool_calls)
    ]
    history = [
        *req1.messages,
        resp.to_message(),
        *(o.to_message() for o in outcomes),
        {"role": "user", "content": "Reply briefly."},
    ]
    final = await backend.complete(
        first_turn("final").model_copy(
            update={"messages": history, "tool_choice": "none", "max_tokens": 300}
        )
    )
    assert final.text == "Oslo: rain, 7°C. Rome: sun, 24°C."
    assert final.tool_calls == [] and final.finish_reason == "stop"
    assert final.usage.model_dump(exclude={"prompt_count"}) == {
        "prompt_tokens": 2140,
        "cached_tokens": 0,
        "completion_tokens": 21,
    }
    body = server.body
    assert body["max_tokens"] == 300
    assert body["tool_choice"] == {"type": "none"}
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Rome?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "I'll check the weather in both cities."},
                {
                    "type": "tool_use",
                    "id": "toolu_01A09q90qw90lq917835lq9",
                    "name": "weather",
                    "input": {"city": "Oslo"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_01B8mx2h9aP3kQ7fW1cZ3rT",
                    "name": "weather",
                    "input": {"city": "Rome", "units": "C"},
                },
            ],
        },
        {
            "role": "user",
            "content": [  # adjacent tool results (+ the nudge) merged into ONE
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
                    "content": "rain #0",
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_01B8mx2h9aP3kQ7fW1cZ3rT",
                    "content": "rain #1",
                },
                {"type": "text", "text": "Reply briefly."},
            ],
        },
    ]
    # The cached prefix is byte-identical between turns.
    assert body["system"] == server.requests[0][0]["system"]
    assert body["tools"] == server.requests[0][0]["tools"]


async def test_no_blank_text_blocks(server: Recorder, backend: AnthropicBackend) -> None:
    call = ToolCall(id="toolu_1", name="weather", arguments={"city": "Oslo"})
    assistant = ModelResponse(text="  \n", tool_calls=[call]).to_message()
    assistant["content"] = "  \n"  # what a model that emits whitespace before a call leaves
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "system", "content": "   "},
        {"role": "user", "content": "Go"},
        assistant,
        {"role": "tool", "tool_call_id": "toolu_1", "content": ""},
        {"role": "assistant", "content": "   "},  # whitespace-only turn: dropped entirely
        {
            "role": "user",
            "content": [{"type": "text", "text": ""}, {"type": "text", "text": "next"}],
        },
    ]
    await backend.complete(ModelRequest(model="final", messages=messages))
    body = server.body
    assert body["system"] == [
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}
    ]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Go"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1"},
                {"type": "text", "text": "next"},
            ],
        },
    ]
    for msg in body["messages"]:
        for block in msg["content"]:
            if block["type"] == "text":
                assert block["text"].strip()
    assert "tools" not in body and "tool_choice" not in body


async def test_json_schema_is_not_sent(server: Recorder, backend: AnthropicBackend) -> None:
    await backend.complete(first_turn("final", json_schema={"name": "A", "schema": {}}))
    assert "response_format" not in server.body
    assert not backend.capabilities.native_json_schema


async def test_error_mapping_and_key_redaction(backend: AnthropicBackend) -> None:
    with pytest.raises(BadRequest, match="non-whitespace text") as bad:
        await backend.complete(first_turn("invalid"))
    assert bad.value.status == 400 and not bad.value.retryable
    with pytest.raises(ServerError) as overloaded:
        await backend.complete(first_turn("overloaded"))
    assert overloaded.value.status == 529 and overloaded.value.retry_after == 3
    assert overloaded.value.retryable and "Overloaded" in str(overloaded.value)
    with pytest.raises(RateLimited) as limited:
        await backend.complete(first_turn("rate-limited"))
    assert limited.value.retry_after == 7 and "per-minute rate limit" in str(limited.value)
    with pytest.raises(ServerError) as broken:
        await backend.complete(first_turn("broken"))
    assert broken.value.status == 500
    with pytest.raises(BadRequest) as auth:
        await backend.complete(first_turn("auth"))
    assert API_KEY not in str(auth.value) and API_KEY[:12] not in str(auth.value)
    assert API_KEY not in repr(backend)


def test_missing_key_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY"):
        backend_from_url("anthropic://")
    with pytest.raises(ConfigError, match="ANTHROPIC_API_KEY"):
        AnthropicBackend("anthropic://127.0.0.1:9")


def test_urls_and_capabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    hosted = backend_from_url("anthropic://")
    assert hosted.target.base_url == "https://api.anthropic.com"  # type: ignore[attr-defined]
    local = AnthropicBackend("anthropic://localhost:8080", api_key="other")
    assert local.target.base_url == "http://localhost:8080"
    caps = hosted.capabilities
    assert (caps.prefix_warming, caps.batch_prompting, caps.native_json_schema) == (
        False,
        False,
        False,
    )
    assert caps.max_safe_concurrency == 16
