"""``max_retries`` is the whole retry budget of an agent's model calls, HTTP retries included,
and ``timeout_per_turn`` bounds every attempt of one call together. Against a real HTTP
server that fails (or stalls) every request, on both engines."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from aiohttp import web

from agentbatch import run_batch
from tests.support.http_server import ThreadedServer

WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}


class FailingServer(ThreadedServer):
    """Every ``/v1/chat/completions`` answers 500 (retryable) after ``delay_s``."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(name="failing-server")
        self.delay_s = delay_s
        self.chat_requests = 0

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.chat_requests += 1
        await request.read()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._ok)
        app.router.add_get("/health", self._ok)

    @property
    def backend(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def failing() -> Iterator[FailingServer]:
    with FailingServer() as server:
        yield server


@pytest.fixture
def stalling() -> Iterator[FailingServer]:
    with FailingServer(delay_s=3.0) as server:
        yield server


def _run(server: FailingServer, **kw: object) -> list:
    return run_batch("Agent {i}.", [{"i": 0}], model="m", backend=server.backend,
                     warm_prefix=False, **kw)


@pytest.mark.parametrize(("max_retries", "attempts"), [(0, 1), (2, 3)])
def test_max_retries_bounds_http_attempts(failing, max_retries, attempts):
    (result,) = _run(failing, max_retries=max_retries)
    assert result.error is not None and result.error.kind == "server_error"
    assert failing.chat_requests == attempts
    noun = "attempt" if attempts == 1 else "attempts"
    assert f"after {attempts} {noun}" in result.error.message, result.error.message


def test_one_deadline_across_transport_retries(stalling):
    # Each request stalls 3 s: a 1 s turn deadline ends the call after one attempt, instead
    # of timing out attempt after attempt (the transport layer used to try 4 times per turn).
    (result,) = _run(stalling, max_retries=0, timeout_per_turn=1.0)
    assert result.error is not None and result.error.kind == "timeout"
    assert stalling.chat_requests == 1
    assert "after 1 attempt" in result.error.message


@pytest.mark.redis
def test_distributed_max_retries_zero_is_one_attempt(failing, redis_url, start_workers):
    start_workers(1, concurrency=2, env=WORKER_ENV)
    (result,) = _run(failing, max_retries=0, redis_url=redis_url)
    assert result.error is not None and result.error.kind == "server_error"
    assert failing.chat_requests == 1
    assert "after 1 attempt" in result.error.message
