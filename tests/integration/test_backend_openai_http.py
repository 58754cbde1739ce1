"""OpenAICompatBackend against a real (tiny, canned) aiohttp server on 127.0.0.1.

The scenario is chosen by the request's ``model`` field, so one server serves every test.
No assertion depends on wall-clock timing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Any

import pytest
from aiohttp import web

from agentbatch.backends.openai_compat import DynamoBackend, OpenAICompatBackend
from agentbatch.backends.retry import RetryingBackend, RetryPolicy
from agentbatch.core.errors import (
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    RateLimited,
    ServerError,
)
from agentbatch.core.model_io import ModelRequest

API_KEY = "sk-test-SECRET-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "hello"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat(message: dict[str, Any], usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": usage or {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }


def tool_call(arguments: Any, call_id: str | None = "call_abc", name: str = "weather") -> dict:
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call["id"] = call_id
    return call


CANNED: dict[str, tuple[int, dict[str, str], Any]] = {
    "text": (200, {}, chat({"role": "assistant", "content": "Hi there"})),
    "args-string": (
        200,
        {},
        chat({"role": "assistant", "content": None, "tool_calls": [tool_call('{"city": "Oslo"}')]}),
    ),
    "args-object": (
        200,
        {},
        chat({"role": "assistant", "content": "", "tool_calls": [tool_call({"city": "Rome"})]}),
    ),
    "args-bad": (
        200,
        {},
        chat(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    tool_call('{"city": "Oslo"', call_id=None),
                    tool_call('["not", "an", "object"]', call_id="call_2"),
                    tool_call("", call_id="call_3"),
                ],
            }
        ),
    ),
    "parts": (
        200,
        {},
        chat(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Hello, "},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "world"},
                ],
            }
        ),
    ),
    "cached": (
        200,
        {},
        chat(
            {"role": "assistant", "content": "ok"},
            {
                "prompt_tokens": 100,
                "completion_tokens": 5,
                "prompt_tokens_details": {"cached_tokens": 64},
            },
        ),
    ),
    "cached-null": (
        200,
        {},
        chat(
            {"role": "assistant", "content": "ok"},
            {"prompt_tokens": 100, "completion_tokens": 5, "prompt_tokens_details": None},
        ),
    ),
    "cached-sglang": (
        200,
        {},
        chat(
            {"role": "assistant", "content": "ok"},
            {"prompt_tokens": 100, "completion_tokens": 5, "cached_tokens": 32},
        ),
    ),
    "rate-limited": (
        429,
        {"Retry-After": "1.5"},
        {"error": {"message": "Too many requests", "type": "rate_limit"}},
    ),
    "rate-limited-date": (
        429,
        {"Retry-After": formatdate(time.time() + 120, usegmt=True)},
        {"error": {"message": "Too many requests"}},
    ),
    "server-error": (500, {}, {"error": {"message": "engine crashed"}}),
    "bad-request": (
        400,
        {},
        {
            "object": "error",
            "message": "This model's maximum context length is 4096 tokens. " + "x" * 2000,
            "code": 400,
        },
    ),
    "echo-key": (401, {}, {"error": {"message": f"Incorrect API key provided: {API_KEY}"}}),
    "not-json": (200, {"Content-Type": "text/html"}, "<html>proxy error</html>"),
}


class CannedServer:
    """A real HTTP server answering canned OpenAI-shaped bodies and recording requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, Any], dict[str, str]]] = []
        self.peers: set[Any] = set()
        self.metrics_text: str | None = None
        self.models_ok = True
        self.flaky_failures = 0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((body, dict(request.headers)))
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        model = body.get("model")
        if model == "slow":
            await asyncio.wait_for(self.release.wait(), 60)
            return web.json_response(CANNED["text"][2])
        if model == "flaky":
            if self.flaky_failures > 0:
                self.flaky_failures -= 1
                return web.json_response({"error": "warming up"}, status=503)
            return web.json_response(CANNED["text"][2])
        status, headers, payload = CANNED.get(model, CANNED["text"])
        if model == "rate-limited-date":  # an HTTP date must be in the future when served
            headers = {"Retry-After": formatdate(time.time() + 120, usegmt=True)}
        if isinstance(payload, str):
            return web.Response(text=payload, status=status, headers=headers)
        return web.json_response(payload, status=status, headers=headers)

    async def models(self, request: web.Request) -> web.Response:
        if not self.models_ok:
            raise web.HTTPServiceUnavailable()
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is None:
            raise web.HTTPNotFound()
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    @property
    def last_body(self) -> dict[str, Any]:
        return self.requests[-1][0]

    @property
    def last_headers(self) -> dict[str, str]:
        return {k.lower(): v for k, v in self.requests[-1][1].items()}


@pytest.fixture
async def server() -> AsyncIterator[CannedServer]:
    srv = CannedServer()
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def backend(server: CannedServer) -> AsyncIterator[OpenAICompatBackend]:
    b = OpenAICompatBackend(f"vllm://127.0.0.1:{server.port}/v1", api_key=API_KEY, timeout=30)
    yield b
    await b.aclose()


def req(model: str, **kw: Any) -> ModelRequest:
    return ModelRequest(model=model, messages=MESSAGES, **kw)


def free_closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- parsing ----------------------------------------------------------------------------------


async def test_plain_text(backend: OpenAICompatBackend) -> None:
    resp = await backend.complete(req("text"))
    assert resp.text == "Hi there"
    assert resp.tool_calls == []
    assert resp.finish_reason == "stop"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (10, 2)


async def test_tool_call_arguments_as_json_string(backend: OpenAICompatBackend) -> None:
    resp = await backend.complete(req("args-string"))
    assert resp.text is None
    [call] = resp.tool_calls
    assert (call.id, call.name, call.arguments, call.arguments_error) == (
        "call_abc",
        "weather",
        {"city": "Oslo"},
        None,
    )


async def test_tool_call_arguments_as_object(backend: OpenAICompatBackend) -> None:
    resp = await backend.complete(req("args-object"))
    [call] = resp.tool_calls
    assert call.arguments == {"city": "Rome"} and call.arguments_error is None


async def test_bad_arguments_become_arguments_error(backend: OpenAICompatBackend) -> None:
    resp = await backend.complete(req("args-bad", request_id="b1:a7:t3"))
    truncated, not_object, empty = resp.tool_calls
    assert truncated.arguments == {}
    assert "not valid JSON" in truncated.arguments_error
    assert '{"city": "Oslo"' in truncated.arguments_error  # the raw text, for the model to see
    assert truncated.id.startswith("call_")
    assert not_object.arguments == {} and "JSON object" in not_object.arguments_error
    assert empty.arguments == {} and empty.arguments_error is None
    again = await backend.complete(req("args-bad", request_id="b1:a7:t3"))
    assert again.tool_calls[0].id == truncated.id  # deterministic when the server omits it


async def test_content_as_list_of_parts(backend: OpenAICompatBackend) -> None:
    resp = await backend.complete(req("parts"))
    assert resp.text == "Hello, world"


@pytest.mark.parametrize(
    ("model", "cached"), [("cached", 64), ("cached-null", 0), ("cached-sglang", 32)]
)
async def test_cached_tokens(backend: OpenAICompatBackend, model: str, cached: int) -> None:
    resp = await backend.complete(req(model))
    assert resp.usage.prompt_tokens == 100
    assert resp.usage.completion_tokens == 5
    assert resp.usage.cached_tokens == cached


async def test_non_json_success_body_is_a_server_error(backend: OpenAICompatBackend) -> None:
    with pytest.raises(ServerError, match="not JSON"):
        await backend.complete(req("not-json"))


# -- error mapping ----------------------------------------------------------------------------


async def test_429_with_fractional_retry_after(backend: OpenAICompatBackend) -> None:
    with pytest.raises(RateLimited) as info:
        await backend.complete(req("rate-limited"))
    assert info.value.retry_after == pytest.approx(1.5)
    assert info.value.status == 429
    assert "Too many requests" in str(info.value)


async def test_429_with_http_date_retry_after(backend: OpenAICompatBackend) -> None:
    with pytest.raises(RateLimited) as info:
        await backend.complete(req("rate-limited-date"))
    assert info.value.retry_after is not None
    assert 0 < info.value.retry_after <= 121


async def test_500_is_server_error(backend: OpenAICompatBackend) -> None:
    with pytest.raises(ServerError) as info:
        await backend.complete(req("server-error"))
    assert info.value.status == 500 and info.value.retryable
    assert "engine crashed" in str(info.value)


async def test_400_is_bad_request_with_truncated_message(backend: OpenAICompatBackend) -> None:
    with pytest.raises(BadRequest) as info:
        await backend.complete(req("bad-request"))
    msg = str(info.value)
    assert "maximum context length is 4096 tokens" in msg
    assert len(msg) < 800
    assert info.value.status == 400 and not info.value.retryable


async def test_connection_refused_is_unavailable() -> None:
    b = OpenAICompatBackend(f"vllm://127.0.0.1:{free_closed_port()}", api_key=API_KEY)
    try:
        with pytest.raises(BackendUnavailable) as info:
            await b.complete(req("text"))
        assert API_KEY not in str(info.value)
        assert await b.fetch_load() is None
    finally:
        await b.aclose()


async def test_slow_server_times_out(server: CannedServer, backend: OpenAICompatBackend) -> None:
    with pytest.raises(BackendTimeout):
        await backend.complete(req("slow", timeout_s=0.2))


async def test_backend_default_timeout_applies(server: CannedServer) -> None:
    b = OpenAICompatBackend(f"sglang://127.0.0.1:{server.port}", timeout=0.2)
    try:
        with pytest.raises(BackendTimeout):
            await b.complete(req("slow"))
    finally:
        await b.aclose()


async def test_api_key_is_sent_but_never_in_error_text(
    server: CannedServer, backend: OpenAICompatBackend
) -> None:
    await backend.complete(req("text"))
    assert server.last_headers["authorization"] == f"Bearer {API_KEY}"
    with pytest.raises(BadRequest) as info:
        await backend.complete(req("echo-key"))
    assert API_KEY not in str(info.value)
    assert API_KEY[:12] not in str(info.value)
    assert "Incorrect API key" in str(info.value)
    assert API_KEY not in repr(backend)


# -- request shape ----------------------------------------------------------------------------


async def test_request_body_and_headers(server: CannedServer, backend: OpenAICompatBackend) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    await backend.complete(
        req(
            "text",
            tools=[WEATHER_TOOL],
            tool_choice="auto",
            json_schema={"name": "Answer", "schema": schema},
            max_tokens=64,
            temperature=0.0,
            request_id="batch1:agent2:turn3",
        )
    )
    body, headers = server.last_body, server.last_headers
    assert body["model"] == "text"
    assert body["messages"] == MESSAGES
    assert body["tools"] == [WEATHER_TOOL]
    assert body["tool_choice"] == "auto"
    assert body["max_tokens"] == 64
    assert body["temperature"] == 0.0
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "Answer", "schema": schema},
    }
    assert "nvext" not in body
    assert headers["x-request-id"] == "batch1:agent2:turn3"


async def test_optional_fields_are_omitted(server: CannedServer) -> None:
    b = OpenAICompatBackend(f"http://127.0.0.1:{server.port}")
    try:
        await b.complete(req("text", tool_choice="auto"))
    finally:
        await b.aclose()
    body, headers = server.last_body, server.last_headers
    assert set(body) == {"model", "messages"}  # no tools -> no tool_choice either
    assert "authorization" not in headers
    assert "x-request-id" not in headers


async def test_dynamo_sends_agent_hints(server: CannedServer) -> None:
    b = DynamoBackend(f"dynamo://127.0.0.1:{server.port}")
    try:
        await b.complete(req("text", turns_left=3, max_tokens=256, agent_key="agent-7"))
        assert server.last_body["nvext"] == {
            "agent_hints": {"turns_left": 3, "speculative_prefill": True, "osl": 256}
        }
        assert server.last_headers["x-dynamo-session-id"] == "agent-7"
        await b.complete(req("text", turns_left=1))
        assert server.last_body["nvext"] == {
            "agent_hints": {"turns_left": 1, "speculative_prefill": False}
        }
    finally:
        await b.aclose()


@pytest.fixture
async def sglang(server: CannedServer) -> AsyncIterator[OpenAICompatBackend]:
    """SGLang takes a prefix into its cache once computed: its warm-up sends the prefix."""
    b = OpenAICompatBackend(f"sglang://127.0.0.1:{server.port}/v1", api_key=API_KEY, timeout=30)
    yield b
    await b.aclose()


async def test_warm_sends_one_token_request(
    server: CannedServer, sglang: OpenAICompatBackend
) -> None:
    await sglang.warm(
        req("text", max_tokens=500, json_schema={"name": "A", "schema": {}}, request_id="r1")
    )
    assert len(server.requests) == 1
    assert server.last_body["max_tokens"] == 1
    assert "response_format" not in server.last_body
    assert server.last_headers["x-request-id"] == "r1:warm"


async def test_warm_raises_mapped_error(sglang: OpenAICompatBackend) -> None:
    with pytest.raises(ServerError):
        await sglang.warm(req("server-error"))


async def test_warm_on_vllm_sends_no_model_request_only_checks_the_server_answers(
    server: CannedServer, backend: OpenAICompatBackend
) -> None:
    """vLLM caches a prefix block as it schedules it, so a burst shares one computation and
    a warm-up would only delay the fan-out by a forward pass."""
    assert backend.capabilities.prefix_shared_in_flight
    await backend.warm(req("text", request_id="r1"))
    assert server.requests == []
    server.models_ok = False  # /health is not served here, and now /v1/models fails too
    with pytest.raises(BackendUnavailable, match="no answer"):
        await backend.warm(req("text", request_id="r1"))
    assert server.requests == []


async def test_warm_on_an_unreachable_vllm_is_unavailable() -> None:
    b = OpenAICompatBackend(f"vllm://127.0.0.1:{free_closed_port()}", api_key=API_KEY)
    try:
        with pytest.raises(BackendUnavailable):
            await b.warm(req("text"))
    finally:
        await b.aclose()


async def test_connections_are_reused(server: CannedServer, backend: OpenAICompatBackend) -> None:
    for _ in range(5):
        await backend.complete(req("text"))
    assert len(server.requests) == 5
    assert len(server.peers) == 1  # one keep-alive connection served all five


async def test_retrying_backend_over_http(server: CannedServer) -> None:
    server.flaky_failures = 2
    waits: list[float] = []

    async def record(seconds: float) -> None:
        waits.append(seconds)

    inner = OpenAICompatBackend(f"vllm://127.0.0.1:{server.port}")
    backend = RetryingBackend(inner, RetryPolicy(attempts=4), sleep=record)
    try:
        resp = await backend.complete(req("flaky"))
    finally:
        await backend.aclose()
    assert resp.text == "Hi there"
    assert backend.retries == 2 and len(waits) == 2
    assert len(server.requests) == 3


# -- /metrics ---------------------------------------------------------------------------------


async def test_fetch_load_from_metrics(server: CannedServer, backend: OpenAICompatBackend) -> None:
    server.metrics_text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 4.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 5.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0\n'
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 150.0\n'
    )
    load = await backend.fetch_load()
    assert load is not None
    assert (load.running, load.waiting) == (9.0, 1.0)
    assert load.prefix_cache_hit_rate == pytest.approx(0.75)
    # The next scrape reports the hit rate over the interval since this one.
    server.metrics_text = server.metrics_text.replace("200.0", "300.0").replace("150.0", "160.0")
    load = await backend.fetch_load()
    assert load is not None and load.prefix_cache_hit_rate == pytest.approx(0.1)


async def test_fetch_load_without_metrics_route(
    server: CannedServer, backend: OpenAICompatBackend
) -> None:
    server.metrics_text = None
    assert await backend.fetch_load() is None


async def test_aclose_twice_and_reuse(server: CannedServer) -> None:
    b = OpenAICompatBackend(f"sim://127.0.0.1:{server.port}")
    await b.aclose()  # before first use
    await b.complete(req("text"))
    await b.aclose()
    await b.aclose()
    resp = await b.complete(req("text"))  # a fresh client after close
    assert resp.text == "Hi there"
    await b.aclose()


def test_request_body_is_json_serializable_check() -> None:
    b = OpenAICompatBackend("vllm://127.0.0.1:1")
    body = b.build_body(req("m", json_schema={"type": "object"}))
    assert body["response_format"]["json_schema"] == {
        "name": "output",
        "schema": {"type": "object"},
    }
    json.dumps(body)


async def test_health_falls_back_to_models_route(server: CannedServer) -> None:
    b = OpenAICompatBackend(f"vllm://127.0.0.1:{server.port}")
    try:
        assert await b.health()  # no /health route (404): /v1/models answers 200
        server.models_ok = False
        assert not await b.health()
    finally:
        await b.aclose()
    down = OpenAICompatBackend(f"vllm://127.0.0.1:{free_closed_port()}")
    try:
        assert not await down.health()
    finally:
        await down.aclose()
