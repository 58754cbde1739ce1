"""Tools for distributed tests: importable by worker processes as ``tests.support.tools:...``.

Each execution is counted in Redis (INCR on the test's Redis), so tests can assert how many
times a call really ran across every worker process.
"""

from __future__ import annotations

import asyncio
import os

import redis.asyncio as aioredis
from pydantic import BaseModel

from agentbatch import ToolContext, ToolError, tool

_clients: dict[int, aioredis.Redis] = {}


def _redis() -> aioredis.Redis:
    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None:
        client = _clients[loop_id] = aioredis.from_url(os.environ["AGENTBATCH_REDIS_URL"])
    return client


@tool
async def lookup(key: str, ctx: ToolContext) -> str:
    """Look up a key (slow, not cacheable; coalesced when concurrent).

    Args:
        key: what to look up.
    """
    await _redis().incr(f"test:exec:lookup:{key}")
    await asyncio.sleep(float(os.environ.get("TEST_TOOL_SLEEP_S", "0.3")))
    return f"value-of-{key}"


@tool(cacheable=True)
async def cached_lookup(key: str) -> str:
    """Look up a key; results are cached fleet-wide.

    Args:
        key: what to look up.
    """
    await _redis().incr(f"test:exec:cached_lookup:{key}")
    await asyncio.sleep(0.05)
    return f"cached-{key}"


@tool
def always_fails(key: str) -> str:
    """A tool that raises on every call.

    Args:
        key: anything.
    """
    raise ToolError(f"always_fails refuses {key!r}")


class Answer(BaseModel):
    """The output schema distributed tests use."""

    summary: str
    score: int
