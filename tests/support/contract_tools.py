"""Tools for the engine contract tests (``tests/integration/test_engine_contract.py``).

``gate`` holds an agent inside a tool call until the test opens it, through a Redis key at a
URL the task passes in: the same tool then blocks in the test's own process (embedded) and in
a worker process (distributed), so "these agents cannot have finished yet" is a fact, not a
timing guess.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from agentbatch import ToolError, tool

GATE_DEADLINE_S = 120.0


@tool
async def gate(url: str, key: str) -> str:
    """Wait until ``key`` exists in the Redis at ``url`` (the test opens it), then return;
    each call pushes 1 on ``<key>:entered`` first, so the test can see who is held.

    Args:
        url: the Redis URL the test opens the gate in.
        key: the key whose existence opens the gate.
    """
    client = aioredis.from_url(url)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GATE_DEADLINE_S
    try:
        await client.rpush(f"{key}:entered", 1)
        while not await client.exists(key):
            if loop.time() > deadline:
                raise ToolError(f"gate {key!r} was never opened")
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()
    return f"opened {key}"
