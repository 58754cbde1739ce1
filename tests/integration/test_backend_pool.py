"""EndpointPool over two real local OpenAI-shaped servers: routing, affinity, ejection when a
server dies mid-test, re-admission when it comes back on the same port, all-ejected errors.

Assertions use request counters, never timings; waits for a background probe are bounded
polls on state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.pool import EndpointPool
from agentbatch.backends.retry import RetryingBackend, RetryPolicy
from agentbatch.core.errors import BackendUnavailable
from agentbatch.core.model_io import ModelRequest


def chat(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }


class Server:
    """A canned server that can be stopped and restarted on the same port."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.agents: list[str] = []  # agent key of every chat request served
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.agents.append(request.headers.get("X-Request-Id", "").split(":")[0])
        if body["model"] == "slow":
            await asyncio.wait_for(self.release.wait(), 60)
        return web.json_response(chat(self.label))

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def servers() -> AsyncIterator[tuple[Server, Server]]:
    a, b = Server("A"), Server("B")
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


def make_pool(servers: tuple[Server, Server], **kw: Any) -> EndpointPool:
    return EndpointPool(
        [OpenAICompatBackend(f"vllm://127.0.0.1:{s.port}", timeout=30) for s in servers], **kw
    )


def req(agent: str, model: str = "m", turn: int = 0, cached_on: str | None = None) -> ModelRequest:
    """A turn of ``agent``; ``cached_on`` is the endpoint its last turn ran on, as the engines
    send it (``ModelResponse.endpoint`` kept in the agent's state)."""
    return ModelRequest(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        agent_key=agent,
        request_id=f"{agent}:{turn}",
        cached_on=cached_on,
    )


def homed(pool: EndpointPool, server: Server, n: int) -> list[str]:
    """``n`` agent keys whose first turn on an idle pool goes to ``server`` (ties of load go
    by the rendezvous ranking of the key over the endpoints)."""
    keys = (f"agent{i}" for i in range(1000))
    return [k for k in keys if str(server.port) in (pool.endpoint_for(k) or "")][:n]


async def no_sleep(seconds: float) -> None:
    return None


async def wait_until(predicate: Any, what: str) -> None:
    for _ in range(400):  # a bounded poll on state, not a timing assertion
        if predicate():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"gave up waiting for {what}")


async def test_least_outstanding_routing(servers: tuple[Server, Server]) -> None:
    a, b = servers
    pool = make_pool(servers)
    try:
        # Two slow turns of one agent whose conversation is on A stay there and keep it busy ...
        name_a = next(n for n in pool.stats() if str(a.port) in n)
        held = [asyncio.create_task(pool.complete(req("busy", "slow", t, cached_on=name_a)))
                for t in range(2)]
        await wait_until(lambda: len(a.agents) + len(b.agents) == 2, "slow requests")
        busy, idle = a, b
        assert busy.agents == ["busy", "busy"]  # affinity: both where its conversation is
        # ... so every new agent's first turn goes to the idle one, turn after turn.
        for i in range(4):
            resp = await pool.complete(req(f"new{i}"))
            assert resp.text == idle.label
        assert idle.agents == ["new0", "new1", "new2", "new3"]
        busy.release.set()
        await asyncio.gather(*held)
        stats = pool.stats()
        assert sum(s["requests"] for s in stats.values()) == 6
        assert all(s["outstanding"] == 0 for s in stats.values())
    finally:
        await pool.aclose()


async def test_affinity_keeps_an_agent_on_its_endpoint(servers: tuple[Server, Server]) -> None:
    a, b = servers
    pool = make_pool(servers)
    try:
        agents = homed(pool, a, 2) + homed(pool, b, 2)
        last: dict[str, str | None] = dict.fromkeys(agents)
        for turn in range(5):
            for agent in agents:
                reply = await pool.complete(req(agent, turn=turn, cached_on=last[agent]))
                last[agent] = reply.endpoint
        for agent in agents:
            on_a, on_b = a.agents.count(agent), b.agents.count(agent)
            assert sorted((on_a, on_b)) == [0, 5], agent
        assert a.agents and b.agents  # homes are spread over both
    finally:
        await pool.aclose()


async def test_ejection_readmission_and_moving_agents(servers: tuple[Server, Server]) -> None:
    a, b = servers
    pool = make_pool(servers, eject_after=2, probe_interval_s=0.05)
    backend = RetryingBackend(pool, RetryPolicy(attempts=4), sleep=no_sleep)
    try:
        # agents homed on each server by construction (homes hash the random ports)
        agents = homed(pool, a, 3) + homed(pool, b, 3)
        fresh = homed(pool, b, 4)
        last = {agent: (await backend.complete(req(agent))).endpoint for agent in agents}
        on_b = [ag for ag in agents if ag in b.agents]
        assert on_b and len(on_b) < len(agents)
        name_b = next(n for n in pool.stats() if str(b.port) in n)

        await b.stop()  # server B dies mid-batch
        for agent in agents:  # every turn still succeeds: the retry lands on A
            resp = await backend.complete(req(agent, turn=1, cached_on=last[agent]))
            assert resp.text == "A"
        stats = pool.stats()[name_b]
        assert stats["ejected"] and stats["ejections"] == 1
        # ejected after one failure whose health check failed too, then avoided
        assert stats["errors"] == 1
        assert backend.retries == 1
        assert pool.moves()["failover"] == len(on_b)  # each of B's agents left its home
        for agent in on_b:  # B's agents moved to A (while B is out)
            assert pool.endpoint_for(agent, cached_on=name_b) != name_b

        b.agents.clear()
        await b.start()  # back on the same port
        await wait_until(lambda: not pool.stats()[name_b]["ejected"], "re-admission")
        for agent in fresh:
            await backend.complete(req(agent))
        assert b.agents  # agents homed on B reach it again
        assert pool.stats()[name_b]["ejections"] == 1
    finally:
        await backend.aclose()


async def test_all_ejected_raises_naming_them(servers: tuple[Server, Server]) -> None:
    a, b = servers
    pool = make_pool(servers, eject_after=1, probe_interval_s=3600)
    try:
        await a.stop()
        await b.stop()
        for agent in ("p", "q"):
            with pytest.raises(BackendUnavailable):
                await pool.complete(req(agent))
        with pytest.raises(BackendUnavailable, match="all 2 endpoints are ejected") as info:
            await pool.complete(req("r"))
        assert str(a.port) in str(info.value) and str(b.port) in str(info.value)
        assert all(s["ejected"] for s in pool.stats().values())
    finally:
        await pool.aclose()


async def test_warm_ejects_endpoints_that_fail_and_needs_one(
    servers: tuple[Server, Server],
) -> None:
    a, b = servers
    pool = make_pool(servers, probe_interval_s=3600)
    try:
        await b.stop()
        await pool.warm(req("w"))  # A warms; B is ejected instead of failing the batch
        assert [s["ejected"] for s in pool.stats().values()] == [False, True]
        await a.stop()
        pool2 = make_pool(servers)
        with pytest.raises(BackendUnavailable, match="no endpoint warmed up"):
            await pool2.warm(req("w"))
        await pool2.aclose()
    finally:
        await pool.aclose()


async def test_health_and_probe_all(servers: tuple[Server, Server]) -> None:
    _a, b = servers
    pool = make_pool(servers, probe_interval_s=3600)
    try:
        assert await pool.health()
        await b.stop()
        result = await pool.probe_all()
        assert list(result.values()) == [True, False]
        assert pool.stats()[next(iter(result))]["ejections"] == 0
    finally:
        await pool.aclose()


async def test_retry_after_refused_connection_goes_elsewhere_before_ejection(
    servers: tuple[Server, Server],
) -> None:
    a, b = servers
    pool = make_pool(servers, eject_after=100, probe_interval_s=3600)
    backend = RetryingBackend(pool, RetryPolicy(attempts=2), sleep=no_sleep)
    try:
        pair = homed(pool, a, 1) + homed(pool, b, 1)
        for agent in pair:
            await backend.complete(req(agent))
        [on_b] = [ag for ag in pair if ag in b.agents]
        name_b = next(n for n in pool.stats() if str(b.port) in n)
        await b.stop()
        # one failure, one retry, on A
        resp = await backend.complete(req(on_b, turn=1, cached_on=name_b))
        assert resp.text == "A" and backend.retries == 1
        stats = pool.stats()[name_b]
        assert (stats["requests"], stats["errors"], stats["outstanding"]) == (2, 1, 0)
        assert pool.moves()["failover"] == 1  # the retry left its home
        assert pool.endpoint_for(on_b, cached_on=name_b) != name_b
    finally:
        await backend.aclose()
