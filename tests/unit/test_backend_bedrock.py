"""BedrockBackend against a real botocore client with ``Stubber``: exact ``converse`` params
and error mapping. No network: the stubber answers before anything is sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError
from botocore.stub import Stubber

from agentbatch.backends.bedrock import BedrockBackend, map_boto_error
from agentbatch.backends.bedrock_convert import supports_prompt_caching
from agentbatch.backends.registry import backend_from_url
from agentbatch.core.errors import (
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    BatchSpecError,
    RateLimited,
    ServerError,
)
from agentbatch.core.model_io import ModelRequest

CLAUDE = "us.anthropic.claude-3-7-sonnet-20250219-v1:0"
OLD_CLAUDE = "anthropic.claude-3-haiku-20240307-v1:0"
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "system", "content": "You are a forecaster."},
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {
        "role": "assistant",
        "content": "  \n",  # blank text next to tool calls: must not become a text block
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city":"Oslo"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city":"Rome"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    {"role": "tool", "tool_call_id": "call_2", "content": ""},
    {"role": "user", "content": "Be brief."},
]


@pytest.fixture(autouse=True)
def fake_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")


@pytest.fixture
def backend() -> Iterator[BedrockBackend]:
    b = BedrockBackend("bedrock://us-east-1", timeout=30)
    yield b


def reply(
    content: list[dict[str, Any]], stop: str = "end_turn", usage: dict[str, int] | None = None
) -> dict[str, Any]:
    return {
        "output": {"message": {"role": "assistant", "content": content}},
        "stopReason": stop,
        "usage": usage or {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15},
        "metrics": {"latencyMs": 12},
    }


def expected_messages() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": [{"text": "Weather in Oslo and Rome?"}]},
        {
            "role": "assistant",
            "content": [
                {"toolUse": {"toolUseId": "call_1", "name": "weather", "input": {"city": "Oslo"}}},
                {"toolUse": {"toolUseId": "call_2", "name": "weather", "input": {"city": "Rome"}}},
            ],
        },
        {
            "role": "user",
            "content": [  # both results and the follow-up in ONE user turn
                {"toolResult": {"toolUseId": "call_1", "content": [{"text": "rain"}]}},
                {"toolResult": {"toolUseId": "call_2", "content": [{"text": "(empty)"}]}},
                {"text": "Be brief."},
            ],
        },
    ]


def tool_config(choice: bool = True) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tools": [
            {
                "toolSpec": {
                    "name": "weather",
                    "description": "Weather for a city.",
                    "inputSchema": {"json": WEATHER["function"]["parameters"]},
                }
            }
        ]
    }
    if choice:
        config["toolChoice"] = {"auto": {}}
    return config


async def test_converse_params_for_a_caching_model(backend: BedrockBackend) -> None:
    usage = {
        "inputTokens": 20,
        "outputTokens": 7,
        "totalTokens": 1227,
        "cacheReadInputTokens": 1000,
        "cacheWriteInputTokens": 200,
    }
    with Stubber(backend.client) as stub:
        stub.add_response(
            "converse",
            reply(
                [
                    {"text": "Oslo: rain."},
                    {
                        "toolUse": {
                            "toolUseId": "tu_9",
                            "name": "weather",
                            "input": {"city": "Rome"},
                        }
                    },
                ],
                "tool_use",
                usage,
            ),
            {
                "modelId": CLAUDE,
                "messages": expected_messages(),
                "system": [{"text": "You are a forecaster."}, {"cachePoint": {"type": "default"}}],
                "inferenceConfig": {"maxTokens": 256, "temperature": 0.0},
                "toolConfig": tool_config(),
            },
        )
        resp = await backend.complete(
            ModelRequest(
                model=CLAUDE,
                messages=HISTORY,
                tools=[WEATHER],
                tool_choice="auto",
                max_tokens=256,
                temperature=0.0,
            )
        )
        stub.assert_no_pending_responses()
    assert resp.text == "Oslo: rain."
    [call] = resp.tool_calls
    assert (call.id, call.name, call.arguments) == ("tu_9", "weather", {"city": "Rome"})
    assert resp.finish_reason == "tool_calls"
    assert resp.usage.model_dump(exclude={"prompt_count"}) == {
        "prompt_tokens": 1220,
        "cached_tokens": 1000,
        "completion_tokens": 7,
    }
    assert backend.requests_sent == 1
    await backend.aclose()


async def test_no_cache_point_for_a_model_without_caching() -> None:
    backend = BedrockBackend(f"bedrock://us-east-1/{OLD_CLAUDE}")  # the URL's model wins
    with Stubber(backend.client) as stub:
        stub.add_response(
            "converse",
            reply([{"text": "ok"}]),
            {
                "modelId": OLD_CLAUDE,
                "messages": [{"role": "user", "content": [{"text": "hi"}]}],
                "system": [{"text": "Be nice."}],
                "inferenceConfig": {"maxTokens": 4096},
            },
        )
        resp = await backend.complete(
            ModelRequest(
                model="ignored",
                messages=[
                    {"role": "system", "content": "Be nice."},
                    {"role": "user", "content": "hi"},
                ],
            )
        )
    assert resp.text == "ok" and resp.finish_reason == "stop"
    await backend.aclose()


async def test_tool_choice_none_keeps_tools_only_when_history_has_tool_blocks(
    backend: BedrockBackend,
) -> None:
    fresh = [{"role": "user", "content": "hi"}]
    with Stubber(backend.client) as stub:
        stub.add_response(
            "converse",
            reply([{"text": "a"}]),
            {
                "modelId": CLAUDE,
                "messages": [{"role": "user", "content": [{"text": "hi"}]}],
                "inferenceConfig": {"maxTokens": 4096},
            },
        )
        stub.add_response(
            "converse",
            reply([{"text": "b"}]),
            {
                "modelId": CLAUDE,
                "messages": expected_messages(),
                "system": [{"text": "You are a forecaster."}, {"cachePoint": {"type": "default"}}],
                "inferenceConfig": {"maxTokens": 4096},
                "toolConfig": tool_config(choice=False),
            },
        )
        await backend.complete(
            ModelRequest(model=CLAUDE, messages=fresh, tools=[WEATHER], tool_choice="none")
        )
        await backend.complete(
            ModelRequest(model=CLAUDE, messages=HISTORY, tools=[WEATHER], tool_choice="none")
        )
        stub.assert_no_pending_responses()


def test_history_with_tools_but_no_tool_specs_gets_minimal_specs(
    backend: BedrockBackend,
) -> None:
    params = backend.build_params(ModelRequest(model=CLAUDE, messages=HISTORY))
    assert params["toolConfig"] == {
        "tools": [
            {
                "toolSpec": {
                    "name": "weather",
                    "description": "weather",
                    "inputSchema": {"json": {"type": "object"}},
                }
            }
        ]
    }


def test_no_blank_text_blocks_anywhere(backend: BedrockBackend) -> None:
    messages = [
        {"role": "system", "content": "   "},
        {
            "role": "user",
            "content": [{"type": "text", "text": " "}, {"type": "text", "text": "real"}],
        },
        {"role": "assistant", "content": "\n"},  # a blank turn: dropped, users merge
        {"role": "user", "content": "again"},
    ]
    params = backend.build_params(ModelRequest(model=CLAUDE, messages=messages))
    assert "system" not in params
    assert params["messages"] == [
        {"role": "user", "content": [{"text": "real"}, {"text": "again"}]}
    ]
    texts = [b["text"] for m in params["messages"] for b in m["content"] if "text" in b]
    assert all(t.strip() for t in texts)
    json.dumps(params)


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [
        ("ThrottlingException", 429, RateLimited),
        ("TooManyRequestsException", 429, RateLimited),
        ("ServiceUnavailableException", 503, RateLimited),
        ("ModelTimeoutException", 408, BackendTimeout),
        ("InternalServerException", 500, ServerError),
        ("ValidationException", 400, BadRequest),
        ("AccessDeniedException", 403, BadRequest),
    ],
)
async def test_client_error_mapping(
    backend: BedrockBackend, code: str, status: int, error: type
) -> None:
    with Stubber(backend.client) as stub:
        stub.add_client_error(
            "converse",
            service_error_code=code,
            service_message=f"{code} happened",
            http_status_code=status,
        )
        with pytest.raises(error) as info:
            await backend.complete(
                ModelRequest(model=CLAUDE, messages=[{"role": "user", "content": "hi"}])
            )
    assert code in str(info.value) and info.value.status == status
    assert info.value.retryable == (error is not BadRequest)


def test_transport_error_mapping() -> None:
    conn = map_boto_error(EndpointConnectionError(endpoint_url="https://x"), "bedrock://r")
    assert isinstance(conn, BackendUnavailable)
    read = map_boto_error(ReadTimeoutError(endpoint_url="https://x"), "bedrock://r")
    assert isinstance(read, BackendTimeout)


def test_client_is_created_once_with_our_config(backend: BedrockBackend) -> None:
    client = backend.client
    assert backend.client is client
    config = client.meta.config
    assert config.retries == {"mode": "standard", "total_max_attempts": 1}  # no botocore retry
    assert config.read_timeout == 30 and config.connect_timeout == 10
    assert config.max_pool_connections == backend.pool_size
    assert client.meta.region_name == "us-east-1"


@pytest.mark.parametrize(
    ("model", "caches"),
    [
        ("anthropic.claude-3-7-sonnet-20250219-v1:0", True),
        ("us.anthropic.claude-sonnet-4-20250514-v1:0", True),
        ("global.anthropic.claude-sonnet-4-5-20250929-v1:0", True),
        ("eu.anthropic.claude-opus-4-1-20250805-v1:0", True),
        ("anthropic.claude-3-5-haiku-20241022-v1:0", True),
        ("anthropic.claude-3-5-sonnet-20241022-v2:0", True),
        ("anthropic.claude-3-5-sonnet-20240620-v1:0", False),
        ("anthropic.claude-3-haiku-20240307-v1:0", False),
        ("amazon.nova-pro-v1:0", True),
        ("apac.amazon.nova-lite-v1:0", True),
        ("meta.llama3-1-70b-instruct-v1:0", False),
        ("arn:aws:bedrock:us-east-1:123:inference-profile/us.amazon.nova-micro-v1:0", True),
    ],
)
def test_prompt_caching_allowlist(model: str, caches: bool) -> None:
    assert supports_prompt_caching(model) is caches


def test_urls_and_registry() -> None:
    with pytest.raises(BatchSpecError, match="region"):
        backend_from_url("bedrock://")
    b = backend_from_url("bedrock://eu-west-1/amazon.nova-pro-v1:0", timeout=12)
    assert isinstance(b, BedrockBackend)
    assert (b.region, b.target.model, b.timeout) == ("eu-west-1", "amazon.nova-pro-v1:0", 12)
    assert b.capabilities.max_safe_concurrency == 16 and not b.capabilities.native_json_schema


async def test_missing_model_is_a_bad_request(backend: BedrockBackend) -> None:
    with pytest.raises(BadRequest, match="no model"):
        await backend.complete(ModelRequest(model="", messages=[{"role": "user", "content": "x"}]))


def test_missing_aws_credentials_fail_before_any_agent_is_dispatched(monkeypatch):
    from agentbatch import run_batch
    from agentbatch.core.errors import ConfigError

    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ConfigError, match="no AWS credentials found"):
        run_batch("x {i}", [{"i": 1}, {"i": 2}], model="m",
                  backend="bedrock://us-east-1/anthropic.claude-3-5-sonnet-20241022-v2:0")
