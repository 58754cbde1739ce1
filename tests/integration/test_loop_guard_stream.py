"""A streamed JSON reply that loops is stopped, and the server stops generating it.

Against the simulator over real HTTP, in GPU-like mode: the reply streams as the simulated
engine decodes it, and a request whose client goes away is cancelled there (so it never
counts as a success in ``/sim/stats``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.core.model_io import FINISH_LOOP, ModelRequest
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer

SCHEMA = {"name": "Note", "schema": {"type": "object", "properties": {"note": {"type": "string"}},
                                     "required": ["note"]}}
LOOPING = '{"note": "toaster_1009' + "_ticket_1009" * 60 + '"}'
FINE = '{"note": "the toaster costs 12 euros"}'


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(decode_ms=4.0, tokens_per_step=1)) as server:
        yield server


def _request(answer: str, *, schema: bool = True) -> ModelRequest:
    text = f"@sim answer {answer}\n@sim tokens 400"
    return ModelRequest(model="sim", messages=[{"role": "user", "content": text}],
                        json_schema=SCHEMA if schema else None, max_tokens=1000)


async def _stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/sim/stats") as resp:
        return json.loads(await resp.text())


async def _settled(url: str) -> dict[str, Any]:
    """The simulator's counters once nothing runs (a cancelled request leaves at once)."""
    for _ in range(100):
        stats = await _stats(url)
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        await asyncio.sleep(0.05)
    raise AssertionError(f"the simulator still runs a request: {stats}")


async def _complete(sim: SimServer, request: ModelRequest, **kw: Any) -> Any:
    async with aiohttp.ClientSession() as s:
        await s.post(f"{sim.url}/sim/reset")
    backend = OpenAICompatBackend("sim://" + sim.url.split("://", 1)[1], stream=True, **kw)
    try:
        return await backend.complete(request)
    finally:
        await backend.aclose()


async def test_a_looping_json_reply_is_stopped_and_its_generation_cancelled(sim) -> None:
    resp = await _complete(sim, _request(LOOPING))
    assert resp.finish_reason == FINISH_LOOP
    assert resp.text and LOOPING.startswith(resp.text)
    assert len(resp.text) < len(LOOPING) // 4  # stopped early, not read to the end
    stats = await _settled(sim.url)
    assert stats["requests_total"] == 1 and stats["success"] == 0  # cancelled, not finished


async def test_the_same_reply_is_read_whole_without_the_guard_or_a_schema(sim) -> None:
    for request, kw in ((_request(LOOPING), {"stop_loops": False}),
                        (_request(LOOPING, schema=False), {})):
        resp = await _complete(sim, request, **kw)
        assert resp.text == LOOPING and resp.finish_reason != FINISH_LOOP
        assert (await _settled(sim.url))["success"] == 1


async def test_a_reply_that_does_not_loop_is_read_whole(sim) -> None:
    resp = await _complete(sim, _request(FINE))
    assert resp.text == FINE and resp.finish_reason == "stop"
