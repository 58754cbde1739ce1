"""complete_batch: one /v1/completions call for many prompts, mapped by choice index, with a
per-prompt fallback when the batched call fails. Local canned server plus the simulator."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from agentbatch.backends.batch_prompting import shares, split_usage
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ModelResponse, Usage


class CompletionsServer:
    """Echoes each prompt upper-cased; misbehaves on request (see ``complete``)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.request_ids: list[str] = []
        self.reverse = False
        self.drop_index: int | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        if any("BAD" in p for p in prompts):
            return web.json_response(
                {"error": {"message": "engine crashed on a prompt"}}, status=500
            )
        choices = [
            {"index": i, "text": p.upper(), "finish_reason": "stop"} for i, p in enumerate(prompts)
        ]
        if self.reverse:
            choices.reverse()  # completion order, not prompt order
        if self.drop_index is not None and len(choices) > 1:
            choices = [c for c in choices if c["index"] != self.drop_index]
        total_prompt = sum(len(p) for p in prompts)
        total_out = sum(len(p) for p in prompts)
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": body["model"],
                "choices": choices,
                "usage": {
                    "prompt_tokens": total_prompt,
                    "completion_tokens": total_out,
                    "total_tokens": total_prompt + total_out,
                    "prompt_tokens_details": {"cached_tokens": total_prompt // 2},
                },
            }
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]


@pytest.fixture
async def server() -> AsyncIterator[CompletionsServer]:
    srv = CompletionsServer()
    await srv.start()
    yield srv
    assert srv.runner is not None
    await srv.runner.cleanup()


@pytest.fixture
async def backend(server: CompletionsServer) -> AsyncIterator[OpenAICompatBackend]:
    b = OpenAICompatBackend(f"vllm://127.0.0.1:{server.port}", timeout=30)
    yield b
    await b.aclose()


def texts(results: list[ModelResponse | Exception]) -> list[str | None]:
    return [r.text if isinstance(r, ModelResponse) else None for r in results]


async def test_three_prompts_one_request(
    server: CompletionsServer, backend: OpenAICompatBackend
) -> None:
    prompts = ["alpha", "bravo bravo", "c"]
    results = await backend.complete_batch(
        prompts, model="m", max_tokens=16, temperature=0.0, request_id="batch7"
    )
    assert texts(results) == ["ALPHA", "BRAVO BRAVO", "C"]
    assert len(server.bodies) == 1 and backend.requests_sent == 1
    assert server.bodies[0] == {
        "model": "m",
        "prompt": prompts,
        "max_tokens": 16,
        "temperature": 0.0,
    }
    assert server.request_ids == ["batch7"]
    usages = [r.usage for r in results if isinstance(r, ModelResponse)]
    total = sum(usages, Usage())
    assert total == Usage(prompt_tokens=17, cached_tokens=8, completion_tokens=17)
    assert usages[1].prompt_tokens > usages[0].prompt_tokens > usages[2].prompt_tokens
    assert all(r.finish_reason == "stop" for r in results if isinstance(r, ModelResponse))


async def test_choices_mapped_by_index_not_position(
    server: CompletionsServer, backend: OpenAICompatBackend
) -> None:
    server.reverse = True
    results = await backend.complete_batch(["one", "two", "three"], model="m")
    assert texts(results) == ["ONE", "TWO", "THREE"]
    assert len(server.bodies) == 1


async def test_bad_prompt_falls_back_to_singles(
    server: CompletionsServer, backend: OpenAICompatBackend
) -> None:
    results = await backend.complete_batch(
        ["ok one", "BAD prompt", "ok two"], model="m", request_id="b1"
    )
    assert texts(results) == ["OK ONE", None, "OK TWO"]
    assert isinstance(results[1], ServerError) and "engine crashed" in str(results[1])
    assert len(server.bodies) == 4  # the batch, then one per prompt
    assert backend.requests_sent == 4
    assert sorted(b["prompt"] for b in server.bodies[1:]) == ["BAD prompt", "ok one", "ok two"]
    assert sorted(server.request_ids[1:]) == ["b1:0", "b1:1", "b1:2"]


async def test_reply_missing_a_choice_falls_back(
    server: CompletionsServer, backend: OpenAICompatBackend
) -> None:
    server.drop_index = 1
    results = await backend.complete_batch(["a", "b", "c"], model="m")
    assert texts(results) == ["A", "B", "C"]
    assert len(server.bodies) == 4


async def test_single_prompt_and_empty(
    server: CompletionsServer, backend: OpenAICompatBackend
) -> None:
    assert await backend.complete_batch([], model="m") == []
    results = await backend.complete_batch(
        ["solo"], model="m", json_schema={"name": "A", "schema": {"type": "object"}}
    )
    assert texts(results) == ["SOLO"]
    assert server.bodies[-1]["prompt"] == "solo"
    assert server.bodies[-1]["response_format"]["type"] == "json_schema"
    assert len(server.bodies) == 1


async def test_against_the_simulator() -> None:
    sim_server = pytest.importorskip("agentbatch.sim.server")
    sim_config = pytest.importorskip("agentbatch.sim.config")
    with sim_server.SimServer(sim_config.SimConfig(fixed_ms=1)) as sim:
        b = OpenAICompatBackend("sim://" + sim.url.split("://")[1])
        try:
            results = await b.complete_batch(
                ["first prompt", "@sim answer second", "@sim answer third"], model="sim"
            )
        finally:
            await b.aclose()
    assert texts(results)[1:] == ["second", "third"]
    assert isinstance(results[0], ModelResponse) and results[0].text
    assert b.requests_sent == 1


def test_usage_split_is_exact() -> None:
    assert shares(10, [1, 1, 1]) == [4, 3, 3]
    assert shares(7, [0, 0]) == [4, 3]
    assert shares(0, [5, 1]) == [0, 0]
    total = Usage(prompt_tokens=101, cached_tokens=64, completion_tokens=33)
    parts = split_usage(total, ["a" * 10, "b" * 30, "c"], ["xx", "", "yyyyyy"])
    assert sum(parts, Usage()) == total
    assert parts[1].completion_tokens == 0
