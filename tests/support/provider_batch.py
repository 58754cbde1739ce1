"""What the provider-batch tests share: the model and its price table, the simulator's
counters they read, and a chat-only server (one without any batch API)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aiohttp import web

from agentbatch.sim import SimServer
from agentbatch.sim.batch_api import BATCH_API
from agentbatch.sim.config import SimConfig

MODEL = "sim-model"
# list prices and half-price batch prices, per million tokens
PRICES = {MODEL: {"prompt": 3.0, "cached_prompt": 0.3, "completion": 15.0,
                  "batch_prompt": 1.5, "batch_cached_prompt": 0.15, "batch_completion": 7.5}}


def batch_sim(latency_s: float) -> Iterator[SimServer]:
    """A simulator whose provider batches all take ``latency_s`` (no spread)."""
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=latency_s,
                             batch_latency_spread=0.0)) as server:
        yield server


def sim_url(sim: SimServer) -> str:
    return "sim://" + sim.url.split("://", 1)[1]


def chat_requests(sim: SimServer) -> int:
    """Sync chat requests the simulator served."""
    return int(sim.state.stats.as_dict()["requests_total"])


def jobs(sim: SimServer) -> list[Any]:
    """The provider batches the simulator was sent."""
    return list(sim._runner.app[BATCH_API].jobs.values())  # type: ignore[union-attr]


def batch_items(sim: SimServer) -> int:
    return sum(len(job.items) for job in jobs(sim))


def chat_only(app: web.Application) -> None:
    """Routes of a server with the chat APIs (OpenAI's and Anthropic's) and no batch API."""
    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"content": "hi"}}]})
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/messages", chat)
