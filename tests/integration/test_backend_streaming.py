"""Streaming chat completions: against the simulator, and against a local SSE server whose
chunk timing the test controls (to prove a tool call is dispatched before the stream ends)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.sse import tool_call_listener
from agentbatch.core.errors import BackendTimeout, RateLimited, ServerError
from agentbatch.core.model_io import ModelRequest, ToolCall

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("read_file", "search")
]


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]


# -- against the simulator -----------------------------------------------------------------


@pytest.fixture(scope="module")
def sim_url() -> Any:
    sim_server = pytest.importorskip("agentbatch.sim.server")
    sim_config = pytest.importorskip("agentbatch.sim.config")
    with sim_server.SimServer(sim_config.SimConfig(fixed_ms=1)) as sim:
        yield sim.url


async def test_sim_streamed_tool_calls_match_non_streamed(sim_url: str) -> None:
    script = '@sim tools read_file {"path": "a/very/long/path/main.py"}; search {"query": "TODO"}'
    request = ModelRequest(model="sim", messages=user(script), tools=TOOLS, request_id="r1")
    heard: list[ToolCall] = []
    streaming = OpenAICompatBackend(
        f"sim://{sim_url.split('://')[1]}", stream=True, on_tool_call=heard.append
    )
    plain = OpenAICompatBackend(f"sim://{sim_url.split('://')[1]}")
    try:
        streamed = await streaming.complete(request)
        reference = await plain.complete(request)
    finally:
        await streaming.aclose()
        await plain.aclose()
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
        ("read_file", {"path": "a/very/long/path/main.py"}),
        ("search", {"query": "TODO"}),
    ]
    assert streamed.tool_calls == reference.tool_calls  # same ids, names and arguments
    assert heard == streamed.tool_calls
    assert streamed.finish_reason == "tool_calls"
    assert streamed.ttft_s is not None and streamed.ttft_s >= 0
    assert reference.ttft_s is None
    assert streamed.usage.completion_tokens > 0
    assert streamed.usage.prompt_tokens == reference.usage.prompt_tokens
    assert streaming.requests_sent == 1


async def test_sim_streamed_text(sim_url: str) -> None:
    b = OpenAICompatBackend(f"sim://{sim_url.split('://')[1]}", stream=True)
    try:
        resp = await b.complete(
            ModelRequest(model="sim", messages=user("@sim answer hello streaming world"))
        )
    finally:
        await b.aclose()
    assert resp.text == "hello streaming world" and resp.tool_calls == []
    assert resp.finish_reason == "stop"


# -- against a scripted SSE server ---------------------------------------------------------


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {data}\n\n".encode()


def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
    }


class SSEServer:
    def __init__(self) -> None:
        self.go_on = asyncio.Event()  # the test lets the stream continue
        self.bodies: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        scenario = body["model"]
        if scenario == "throttled":
            return web.json_response(
                {"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "2"}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if scenario == "two-calls":
            await resp.write(sse(delta({"role": "assistant", "content": ""})))
            await resp.write(
                sse(
                    delta(
                        {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "c0",
                                    "type": "function",
                                    "function": {"name": "read_file", "arguments": '{"path":'},
                                }
                            ]
                        }
                    )
                )
            )
            await resp.write(
                sse(delta({"tool_calls": [{"index": 0, "function": {"arguments": ' "x.py"}'}}]}))
            )
            await resp.write(
                sse(
                    delta(
                        {
                            "tool_calls": [
                                {
                                    "index": 1,
                                    "id": "c1",
                                    "type": "function",
                                    "function": {"name": "search", "arguments": ""},
                                }
                            ]
                        }
                    )
                )
            )
            # Hold the rest of the reply until the client has dispatched call 0.
            await asyncio.wait_for(self.go_on.wait(), 30)
            await resp.write(
                sse(
                    delta(
                        {
                            "tool_calls": [
                                {"index": 1, "function": {"arguments": '{"query": "TODO"}'}}
                            ]
                        }
                    )
                )
            )
            await resp.write(sse(delta({}, "tool_calls")))
            await resp.write(
                sse(
                    {
                        "object": "chat.completion.chunk",
                        "choices": [],
                        "usage": {"prompt_tokens": 9, "completion_tokens": 4},
                    }
                )
            )
            await resp.write(sse("[DONE]"))
        elif scenario == "error-mid-stream":
            await resp.write(sse(delta({"content": "partial"})))
            await resp.write(sse({"error": {"message": "engine died", "code": 500}}))
        elif scenario == "truncated":
            await resp.write(sse(delta({"content": "partial"})))
        elif scenario == "stall":
            await resp.write(sse(delta({"content": "first"})))
            await asyncio.wait_for(self.go_on.wait(), 30)
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]


@pytest.fixture
async def server() -> AsyncIterator[SSEServer]:
    srv = SSEServer()
    await srv.start()
    yield srv
    srv.go_on.set()
    assert srv.runner is not None
    await srv.runner.cleanup()


def make(server: SSEServer, **kw: Any) -> OpenAICompatBackend:
    return OpenAICompatBackend(f"vllm://127.0.0.1:{server.port}", stream=True, **kw)


async def test_tool_call_dispatched_before_stream_ends(server: SSEServer) -> None:
    heard: list[ToolCall] = []

    def listener(call: ToolCall) -> None:
        heard.append(call)
        server.go_on.set()  # the stream can only finish once call 0 was heard

    ticks = itertools.count(100.0, 0.25)  # injected clock: start at 100, first delta at 100.25
    b = make(server, clock=lambda: next(ticks), on_tool_call=listener)
    try:
        resp = await b.complete(
            ModelRequest(model="two-calls", messages=user("go"), tools=TOOLS, max_tokens=50)
        )
    finally:
        await b.aclose()
    assert [c.name for c in heard] == ["read_file", "search"]
    assert heard[0] == ToolCall(id="c0", name="read_file", arguments={"path": "x.py"})
    assert resp.tool_calls == heard
    assert resp.text is None and resp.finish_reason == "tool_calls"
    assert resp.usage.prompt_tokens == 9 and resp.usage.completion_tokens == 4
    assert resp.ttft_s == pytest.approx(0.25)
    body = server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 50


async def test_context_var_listener_wins(server: SSEServer) -> None:
    from_ctor: list[ToolCall] = []
    from_ctx: list[ToolCall] = []

    def ctx_listener(call: ToolCall) -> None:
        from_ctx.append(call)
        server.go_on.set()

    b = make(server, on_tool_call=from_ctor.append)
    try:
        with tool_call_listener(ctx_listener):
            await b.complete(ModelRequest(model="two-calls", messages=user("go"), tools=TOOLS))
    finally:
        await b.aclose()
    assert [c.id for c in from_ctx] == ["c0", "c1"] and from_ctor == []


async def test_stream_failures_are_mapped(server: SSEServer) -> None:
    b = make(server, timeout=30)
    try:
        with pytest.raises(ServerError, match="engine died"):
            await b.complete(ModelRequest(model="error-mid-stream", messages=user("x")))
        with pytest.raises(ServerError, match="before \\[DONE\\]"):
            await b.complete(ModelRequest(model="truncated", messages=user("x")))
        with pytest.raises(RateLimited) as info:
            await b.complete(ModelRequest(model="throttled", messages=user("x")))
        assert info.value.retry_after == 2 and "slow down" in str(info.value)
        with pytest.raises(BackendTimeout):
            await b.complete(ModelRequest(model="stall", messages=user("x"), timeout_s=0.3))
    finally:
        await b.aclose()
