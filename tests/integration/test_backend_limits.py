"""Runaway replies from a model server (issue 11, item 9), over real HTTP on both transports.

A local aiohttp server serves oversized bodies, deep-nested JSON and over-long SSE lines; the
OpenAI-compatible backend must end the turn with a non-retryable ``server_error`` (never
``internal``) and stop reading instead of buffering the whole reply.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from agentbatch import run_batch
from agentbatch.backends.limits import DEFAULT_MAX_RESPONSE_BYTES, MAX_RESPONSE_BYTES_ENV
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.core.errors import ConfigError, ServerError
from agentbatch.core.model_io import ModelRequest

MB = 1024 * 1024
DEEP = 100_000


class RunawayServer:
    """Routes that misbehave; ``sent``/``disconnected`` record what each streaming route did."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.disconnected: dict[str, bool] = {}
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _stream(self, request: web.Request, name: str, total: int | None,
                      chunk: bytes, headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers=headers)
        if total is not None:
            resp.content_length = total
        await resp.prepare(request)
        self.sent[name], self.disconnected[name] = 0, False
        try:
            while total is None or self.sent[name] < total:
                await resp.write(chunk)
                self.sent[name] += len(chunk)
        except (ConnectionError, RuntimeError):  # the client hung up mid-body
            self.disconnected[name] = True
            return resp
        await resp.write_eof()
        return resp

    async def big(self, request: web.Request) -> web.StreamResponse:
        """40 MB of JSON-ish bytes with a declared Content-Length."""
        return await self._stream(request, "big", 40 * MB, b" " * MB, {})

    async def endless(self, request: web.Request) -> web.StreamResponse:
        """A chunked body that never ends (no length to check up front)."""
        return await self._stream(request, "endless", None, b" " * MB, {})

    async def deep(self, request: web.Request) -> web.Response:
        return web.Response(body=b"[" * DEEP + b"]" * DEEP, content_type="application/json")

    async def long_line(self, request: web.Request) -> web.StreamResponse:
        """An SSE stream whose first line never ends (1 MB, then the connection waits)."""
        headers = {"Content-Type": "text/event-stream"}
        return await self._stream(request, "long_line", 1 * MB, b"data: " + b"x" * (MB - 6),
                                  headers)

    async def endless_sse(self, request: web.Request) -> web.StreamResponse:
        """Well-formed SSE keep-alive comments, forever."""
        headers = {"Content-Type": "text/event-stream"}
        ping = b": " + b"p" * 4094 + b"\n"
        return await self._stream(request, "endless_sse", None, ping * 256, headers)

    async def deep_sse(self, request: web.Request) -> web.Response:
        line = b"data: " + b"[" * DEEP + b"]" * DEEP + b"\n\n"
        return web.Response(body=line, content_type="text/event-stream")

    async def error_big(self, request: web.Request) -> web.StreamResponse:
        """A 503 whose error body is endless: the error must come back, not the body."""
        resp = web.StreamResponse(status=503)
        await resp.prepare(request)
        self.sent["error_big"] = 0
        try:
            while True:
                await resp.write(b"e" * MB)
                self.sent["error_big"] += MB
        except (ConnectionError, RuntimeError):
            self.disconnected["error_big"] = True
        return resp

    async def start(self) -> None:
        app = web.Application()
        for name in ("big", "endless", "deep", "long_line", "endless_sse", "deep_sse",
                     "error_big"):
            app.router.add_post(f"/{name}/v1/chat/completions", getattr(self, name))
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def server() -> AsyncIterator[RunawayServer]:
    srv = RunawayServer()
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


TRANSPORTS = ["aiohttp", "httpx"]


async def _complete(server: RunawayServer, route: str, transport: str,
                    stream: bool = False) -> ServerError:
    """The error one turn against ``route`` ends with."""
    kw: dict[str, Any] = {"transport": httpx.AsyncHTTPTransport()} if transport == "httpx" else {}
    backend = OpenAICompatBackend(f"http://{server.url.split('://')[1]}/{route}", stream=stream,
                                  timeout=60, **kw)
    request = ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    try:
        with pytest.raises(ServerError) as info:
            await backend.complete(request)
    finally:
        await backend.aclose()
    assert info.value.kind == "server_error"
    return info.value


async def _wait_for(predicate: Any) -> None:
    """The server notices a hang-up asynchronously; a generous deadline, no timing assert."""
    for _ in range(600):
        if predicate():
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_declared_oversize_body_is_refused_unread(server: RunawayServer,
                                                        transport: str) -> None:
    error = await _complete(server, "big", transport)
    assert not error.retryable and str(DEFAULT_MAX_RESPONSE_BYTES) in str(error)
    await _wait_for(lambda: server.disconnected.get("big"))
    assert server.disconnected["big"] and server.sent["big"] < 40 * MB


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endless_body_stops_at_the_cap(server: RunawayServer, transport: str) -> None:
    error = await _complete(server, "endless", transport)
    assert not error.retryable and "exceeds" in str(error)
    await _wait_for(lambda: server.disconnected.get("endless"))
    # the cap plus what the sockets buffer; never the whole (endless) body
    assert server.disconnected["endless"]
    assert server.sent["endless"] < 2 * DEFAULT_MAX_RESPONSE_BYTES


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_cap_comes_from_the_environment(server: RunawayServer, transport: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MAX_RESPONSE_BYTES_ENV, str(2 * MB))
    error = await _complete(server, "endless", transport)
    assert str(2 * MB) in str(error)
    await _wait_for(lambda: server.disconnected.get("endless"))
    assert server.sent["endless"] < 40 * MB
    monkeypatch.setenv(MAX_RESPONSE_BYTES_ENV, "lots")
    with pytest.raises(ConfigError, match=MAX_RESPONSE_BYTES_ENV):
        OpenAICompatBackend(server.url)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_deep_nested_json_body_is_a_server_error(server: RunawayServer,
                                                       transport: str) -> None:
    error = await _complete(server, "deep", transport)
    assert "too deeply" in str(error)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_sse_line_over_512k_is_a_server_error(server: RunawayServer,
                                                    transport: str) -> None:
    error = await _complete(server, "long_line", transport, stream=True)
    assert not error.retryable and "line" in str(error)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endless_sse_stream_stops_at_the_cap(server: RunawayServer,
                                                   transport: str) -> None:
    await _complete(server, "endless_sse", transport, stream=True)
    await _wait_for(lambda: server.disconnected.get("endless_sse"))
    assert server.sent["endless_sse"] < 2 * DEFAULT_MAX_RESPONSE_BYTES


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_deep_nested_sse_chunk_is_a_server_error(server: RunawayServer,
                                                       transport: str) -> None:
    error = await _complete(server, "deep_sse", transport, stream=True)
    assert "too deeply" in str(error)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_endless_error_body_still_gives_the_http_error(server: RunawayServer,
                                                             transport: str) -> None:
    error = await _complete(server, "error_big", transport)
    assert error.status == 503 and error.retryable
    await _wait_for(lambda: server.disconnected.get("error_big"))
    assert server.sent["error_big"] < 2 * DEFAULT_MAX_RESPONSE_BYTES


async def test_run_batch_reports_deep_json_as_server_error(server: RunawayServer) -> None:
    url = f"{server.url}/deep"
    results = await asyncio.to_thread(run_batch, "Agent {i}.", [{"i": 0}], backend=url,
                                      model="m", max_retries=2, timeout_per_turn=30.0)
    error = results[0].error
    assert error is not None and error.kind == "server_error", error
    assert "after 1 attempt)" in error.message  # not retried: the same body would come back
