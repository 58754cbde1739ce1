"""Tools for distributed tests: importable by worker processes as ``tests.support.tools:...``.

Each execution is counted in Redis (INCR on the test's Redis), so tests can assert how many
times a call really ran across every worker process.
"""

from __future__ import annotations

import asyncio
import os

import redis.asyncio as aioredis
from pydantic import BaseModel, field_validator, model_validator

from agentbatch import ToolContext, ToolError, tool

_clients: dict[int, aioredis.Redis] = {}


def counting_redis_url() -> str:
    """Where test tools count: ``TEST_REDIS_URL`` (embedded runs), else the Redis of the worker
    they run in, which keeps its URL in memory (it removes ``AGENTBATCH_REDIS_URL`` from its
    environment), else ``AGENTBATCH_REDIS_URL``."""
    from agentbatch.distributed.workers.settings import WorkerSettings

    return os.environ.get("TEST_REDIS_URL") or WorkerSettings.from_env().redis_url


def _redis() -> aioredis.Redis:
    loop_id = id(asyncio.get_running_loop())
    client = _clients.get(loop_id)
    if client is None:
        client = _clients[loop_id] = aioredis.from_url(counting_redis_url())
    return client


def _counting() -> bool:
    """Whether ``lookup`` and ``cached_lookup`` count their executions in Redis; a benchmark
    of agentbatch's own cost per task (``bench_distributed``) sets ``TEST_TOOL_COUNT=0`` so
    that the tools' bookkeeping is not measured with it."""
    return os.environ.get("TEST_TOOL_COUNT", "1") != "0"


@tool
async def lookup(key: str, ctx: ToolContext) -> str:
    """Look up a key (slow, not cacheable: every agent's call runs on its own).

    ``HLEN test:exec:noncacheable`` counts the distinct calls that ran (one idempotency key
    each) and the sum of its values their executions, so re-runs after faults show.

    Args:
        key: what to look up.
    """
    if _counting():
        await _redis().incr(f"test:exec:lookup:{key}")
        await _redis().hincrby("test:exec:noncacheable", ctx.idempotency_key, 1)
    await asyncio.sleep(float(os.environ.get("TEST_TOOL_SLEEP_S", "0.3")))
    return f"value-of-{key}"


@tool(cacheable=True)
async def cached_lookup(key: str) -> str:
    """Look up a key; results are cached fleet-wide.

    Args:
        key: what to look up.
    """
    if _counting():
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


class ShortAnswer(BaseModel):
    """What the fake llama-server answers (tests/integration/test_backend_llamacpp.py)."""

    answer: str


class Exploding(BaseModel):
    """An output schema whose validator raises KeyError (pydantic does not wrap it)."""

    summary: str
    score: int

    @field_validator("summary")
    @classmethod
    def _explode(cls, value: str) -> str:
        raise KeyError(f"validator bug on {value!r}")


class Renamed(BaseModel):
    """A schema whose before-validator transforms its input: valid once, not twice."""

    title: str
    score: int

    @model_validator(mode="before")
    @classmethod
    def _rename(cls, data: dict) -> dict:
        return {"title": data["summary"].upper(), "score": data["score"]}


class ChaosAnswer(BaseModel):
    """The chaos batch's schema: a "boom" summary raises KeyError inside step() (a bug)."""

    summary: str
    score: int

    @field_validator("summary")
    @classmethod
    def _boom(cls, value: str) -> str:
        if value == "boom":
            raise KeyError("boom")
        return value


# -- tool identity, sharing scope and fencing (issue 8 items 1-4) ---------------------------


_count_clients: dict[tuple[int, str], aioredis.Redis] = {}


def _count_redis() -> aioredis.Redis:
    """Where these tools count: ``TEST_REDIS_URL`` (embedded runs, in which setting
    ``AGENTBATCH_REDIS_URL`` would select the distributed engine), else the workers' Redis."""
    url = counting_redis_url()
    key = (id(asyncio.get_running_loop()), url)
    client = _count_clients.get(key)
    if client is None:
        client = _count_clients[key] = aioredis.from_url(url)
    return client


@tool(cacheable=True)
async def price(item: str) -> str:
    """The price of an item in catalogue A (cacheable, shared within one batch).

    Args:
        item: the item.
    """
    await _count_redis().incr(f"test:exec:price:a:{item}")
    return f"a-price-of-{item}"


@tool(cacheable=True, share="fleet")
async def fleet_price(item: str) -> str:
    """A public price list: cacheable and shared by every batch of the fleet.

    Args:
        item: the item.
    """
    await _count_redis().incr(f"test:exec:fleet_price:{item}")
    return f"fleet-price-of-{item}"


@tool
async def pay(invoice: str, ctx: ToolContext) -> str:
    """Pay an invoice: a side effect, so every agent's call must run on its own.

    Args:
        invoice: the invoice to pay.
    """
    r = _count_redis()
    await r.rpush(f"test:pay:{invoice}", ctx.idempotency_key)
    # Hold the call open until a second payment arrives (or 10 s pass), so two agents' calls
    # are in flight at the same moment: the case that used to be merged into one payment.
    deadline = asyncio.get_running_loop().time() + 10
    while await r.llen(f"test:pay:{invoice}") < 2:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    return f"paid-{invoice}"


# Accept a write only with a fencing token above every token seen for this key.
_FENCED_WRITE = """
if tonumber(ARGV[1]) <= tonumber(redis.call('GET', KEYS[1]) or '0') then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""


@tool(lock_ttl=1.0)
async def fenced_pay(invoice: str, ctx: ToolContext) -> str:
    """Pay once however often the call runs: the write is fenced by the lock's token.

    Waits for ``test:fenced:go:<invoice>`` so a test can pause the worker mid-call.

    Args:
        invoice: the invoice to pay.
    """
    r = _count_redis()
    await r.rpush(f"test:fenced:started:{invoice}", f"{os.getpid()}:{ctx.fencing_token}")
    deadline = asyncio.get_running_loop().time() + 120
    while not await r.exists(f"test:fenced:go:{invoice}"):
        if asyncio.get_running_loop().time() > deadline:
            raise ToolError("fenced_pay was never released")
        await asyncio.sleep(0.05)
    leader = await ctx.still_leader()
    wrote = await r.eval(_FENCED_WRITE, 2, f"test:fenced:top:{ctx.idempotency_key}",
                         f"test:fenced:effects:{ctx.idempotency_key}", ctx.fencing_token)
    await r.rpush(f"test:fenced:seen:{invoice}",
                  f"{os.getpid()}:{ctx.fencing_token}:{int(leader)}:{int(wrote)}")
    return f"paid-{invoice}"


@tool
async def counted_call(key: str, ctx: ToolContext) -> str:
    """A non-shareable call that counts its executions per idempotency key.

    ``HLEN test:exec:calls`` is the number of distinct calls that ran and the sum of its
    values the number of executions (for counting re-runs after faults).

    Args:
        key: anything.
    """
    await _count_redis().hincrby("test:exec:calls", ctx.idempotency_key, 1)
    await asyncio.sleep(float(os.environ.get("TEST_TOOL_SLEEP_S", "0.3")))
    return f"counted-{key}"


@tool
def pad(n: int) -> str:
    """2 KB of text for round ``n`` (the linear-history test: big tool results, many rounds).

    Args:
        n: the round.
    """
    return (f"round {n}: " + "x" * 2048)[:2048]
