"""Two workers' turns pinned through the fleet's slot map, on a real llama-server and a real
redis-server: each agent's next turn, whichever worker runs it, goes back to the slot holding
its conversation and computes only what is new.

Two ``LlamaCppBackend`` instances stand for two worker processes, each with its own Redis
client and ``FleetSlots`` (what a worker gets from ``share_fleet_slots``). Turns run one after
another, alternating workers, so the server's choices are deterministic. A picker of each
worker's own would pin the second agent's first turn to slot 0 too, over the first agent's
conversation. The test asserts the ``id_slot`` agentbatch sent, what the map then says, and
that each second turn found its first turn cached (the server's reply).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.distributed.state.keys import slot_map_key
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.slot_map import FleetSlots
from agentbatch.engine import EnginePaths, LlamaServer
from tests.engine.test_llamacpp_slot_restore import MODEL, _messages

pytestmark = [pytest.mark.engine, pytest.mark.redis]


async def _alternating(url: str, redis_url: str) -> tuple[list[Any], list[ModelResponse],
                                                          dict[bytes, bytes]]:
    clients = [aioredis.from_url(redis_url) for _ in range(2)]
    workers = [LlamaCppBackend(url) for _ in range(2)]
    sent: list[Any] = []
    for backend, client in zip(workers, clients, strict=True):
        backend.share_slots(FleetSlots(Scripts(client), backend.name, 2, 120_000))
        build = backend.build_body

        def recording(request: ModelRequest, build: Any = build) -> dict[str, Any]:
            body = build(request)
            sent.append(body.get("id_slot"))
            return dict(body)

        backend.build_body = recording  # type: ignore[method-assign]
    replies: list[ModelResponse] = []
    try:
        # turn 1: t:0 on worker A, t:1 on worker B; turn 2 the other way round
        for turn, order in ((1, (0, 1)), (2, (1, 0))):
            for agent, worker in zip(("t:0", "t:1"), order, strict=True):
                replies.append(await workers[worker].complete(ModelRequest(
                    model=MODEL, max_tokens=1, temperature=0.0, agent_key=agent,
                    messages=_messages(agent, turn))))
        held = await clients[0].hgetall(slot_map_key(workers[0].name))
        return sent, replies, held
    finally:
        for backend in workers:
            await backend.aclose()
        for client in clients:
            await client.aclose()


def test_two_workers_turns_go_back_to_the_slot_holding_the_conversation(
        engine_paths: EnginePaths, redis_url: str) -> None:
    server = LlamaServer(engine_paths, parallel=2).start()
    try:
        sent, replies, held = asyncio.run(_alternating(server.llamacpp_url, redis_url))
    finally:
        server.stop()
    assert sent == [0, 1, 0, 1]
    assert held[b"h0"] == b"t:0" and held[b"h1"] == b"t:1", held
    # each second turn found its first turn cached: it computed its new page, little else
    for one, two in zip(replies[:2], replies[2:], strict=True):
        assert two.usage.cached_tokens >= one.usage.prompt_tokens - 8, (one.usage, two.usage)
