"""ToolPool behaviour: coalescing, caching, timeouts, rate limits and error outcomes.

No test asserts on wall-clock time: concurrency is driven by events and checked by counters.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError, ToolError
from agentbatch.core.model_io import ToolCall, ToolOutcome, canonical_json
from agentbatch.toolpool import (
    InflightCoalescer,
    NoCoalescing,
    TokenBucket,
    Tool,
    ToolContext,
    ToolPool,
    TTLCache,
    tool,
)
from agentbatch.toolpool import ratelimit as ratelimit_mod


def ctx(i: int = 0, turn: int = 0) -> ToolContext:
    return ToolContext.for_call("batch-1", i, turn, f"call-{i}")


def call(name: str, i: int = 0, **arguments: Any) -> ToolCall:
    return ToolCall(id=f"call-{i}", name=name, arguments=arguments)


def key(pool: ToolPool, name: str, **arguments: Any) -> str:
    """The coalescing key of a call to ``name`` in batch-1 (shared by every agent for tools
    declared safe to share)."""
    t = pool.get(name)
    assert t is not None
    return pool.call_key(t, t.spec.validate(arguments, tool_name=name), ctx())


async def until(predicate: Callable[[], bool], spins: int = 10_000) -> None:
    """Yield to the event loop until ``predicate`` holds (no sleeping on wall time)."""
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def gated_tool(name: str = "slow", *, fail: bool = False) -> tuple[Tool, dict[str, Any]]:
    """An async read-only (``coalesce=True``) tool that blocks until ``state['release']`` is
    set; records what happened."""
    state: dict[str, Any] = {
        "release": asyncio.Event(), "started": asyncio.Event(),
        "executions": 0, "finished": 0, "cancelled": 0,
    }  # fmt: skip

    async def slow(q: str) -> str:
        state["executions"] += 1
        state["started"].set()
        try:
            await state["release"].wait()
        except asyncio.CancelledError:
            state["cancelled"] += 1
            raise
        state["finished"] += 1
        if fail:
            raise ValueError(f"boom {q}")
        return f"result:{q}"

    return tool(name=name, coalesce=True)(slow), state


# -- coalescing ----------------------------------------------------------------------------


async def test_fifty_identical_calls_execute_once() -> None:
    slow, state = gated_tool()
    pool = ToolPool([slow])
    tasks = [asyncio.create_task(pool.run(call("slow", i, q="x"), ctx(i))) for i in range(50)]
    await until(lambda: pool.coalescer.waiters(key(pool, "slow", q="x")) == 50)
    state["release"].set()
    outcomes = await asyncio.gather(*tasks)
    assert state["executions"] == 1
    assert all(o.ok and o.content == "result:x" for o in outcomes)
    assert [o.call_id for o in outcomes] == [f"call-{i}" for i in range(50)]
    assert sum(o.coalesced for o in outcomes) == 49
    stats = pool.stats()
    assert (stats["executions"], stats["coalesced"], stats["calls"]) == (1, 49, 50)
    assert stats["by_tool"]["slow"]["executions"] == 1


async def test_leader_failure_reaches_every_waiter() -> None:
    slow, state = gated_tool(fail=True)
    pool = ToolPool([slow])
    tasks = [asyncio.create_task(pool.run(call("slow", i, q="x"), ctx(i))) for i in range(10)]
    await until(lambda: pool.coalescer.waiters(key(pool, "slow", q="x")) == 10)
    state["release"].set()
    outcomes = await asyncio.gather(*tasks)
    assert state["executions"] == 1
    assert all(not o.ok and o.content == "error: ValueError: boom x" for o in outcomes)
    assert sum(o.coalesced for o in outcomes) == 9
    assert pool.stats()["errors"] == 10


async def test_cancelled_leader_caller_does_not_cancel_the_execution() -> None:
    slow, state = gated_tool()
    pool = ToolPool([slow])
    k = key(pool, "slow", q="x")
    leader = asyncio.create_task(pool.run(call("slow", 0, q="x"), ctx(0)))
    await state["started"].wait()
    others = [asyncio.create_task(pool.run(call("slow", i, q="x"), ctx(i))) for i in range(1, 6)]
    await until(lambda: pool.coalescer.waiters(k) == 6)
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert pool.coalescer.waiters(k) == 5
    state["release"].set()
    outcomes = await asyncio.gather(*others)
    assert all(o.ok and o.content == "result:x" and o.coalesced for o in outcomes)
    assert (state["executions"], state["finished"], state["cancelled"]) == (1, 1, 0)


async def test_leader_caller_timeout_does_not_cancel_the_execution() -> None:
    slow, state = gated_tool()
    pool = ToolPool([slow])
    leader = asyncio.create_task(pool.run(call("slow", 0, q="x"), ctx(0), timeout=0.01))
    await state["started"].wait()
    other = asyncio.create_task(pool.run(call("slow", 1, q="x"), ctx(1)))
    await until(lambda: pool.coalescer.waiters(key(pool, "slow", q="x")) == 2)
    timed_out = await leader
    assert not timed_out.ok and "timed out after 0.01s" in timed_out.content
    state["release"].set()
    outcome = await other
    assert outcome.ok and outcome.content == "result:x"
    assert (state["executions"], state["cancelled"]) == (1, 0)
    assert pool.stats()["timeouts"] == 1


async def test_cancelled_waiter_does_not_disturb_others() -> None:
    slow, state = gated_tool()
    pool = ToolPool([slow])
    k = key(pool, "slow", q="x")
    tasks = [asyncio.create_task(pool.run(call("slow", i, q="x"), ctx(i))) for i in range(5)]
    await until(lambda: pool.coalescer.waiters(k) == 5)
    tasks[3].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[3]
    state["release"].set()
    outcomes = await asyncio.gather(*(t for i, t in enumerate(tasks) if i != 3))
    assert all(o.ok and o.content == "result:x" for o in outcomes)
    assert (state["executions"], state["cancelled"]) == (1, 0)


async def test_key_is_cleared_after_completion() -> None:
    slow, state = gated_tool()
    state["release"].set()
    pool = ToolPool([slow])
    first = await pool.run(call("slow", 0, q="x"), ctx(0))
    second = await pool.run(call("slow", 1, q="x"), ctx(1))
    assert first.ok and second.ok and not second.coalesced
    assert state["executions"] == 2
    assert pool.coalescer.inflight() == 0


async def test_coalesced_execution_uses_the_leaders_context() -> None:
    release = asyncio.Event()

    @tool(coalesce=True)
    async def keyed(q: str, context: ToolContext) -> str:
        await release.wait()
        return context.idempotency_key

    pool = ToolPool([keyed])
    a = asyncio.create_task(pool.run(call("keyed", 0, q="x"), ctx(0)))
    b = asyncio.create_task(pool.run(call("keyed", 1, q="x"), ctx(1)))
    await until(lambda: pool.coalescer.waiters(key(pool, "keyed", q="x")) == 2)
    release.set()
    assert [o.content for o in await asyncio.gather(a, b)] == [ctx(0).idempotency_key] * 2


async def test_execution_cancelled_from_inside_is_an_error_not_a_cancellation() -> None:
    coalescer = InflightCoalescer()

    async def thunk(lease: Any) -> str:
        raise asyncio.CancelledError

    with pytest.raises(ToolError, match="cancelled"):
        await coalescer.run("k", thunk)


async def test_no_coalescing_runs_every_call() -> None:
    slow, state = gated_tool()
    pool = ToolPool([slow], coalescer=NoCoalescing())
    tasks = [asyncio.create_task(pool.run(call("slow", i, q="x"), ctx(i))) for i in range(3)]
    await until(lambda: state["executions"] == 3)
    state["release"].set()
    assert all(o.ok and not o.coalesced for o in await asyncio.gather(*tasks))


# -- timeouts ------------------------------------------------------------------------------


async def test_per_call_timeout() -> None:
    slow, state = gated_tool()
    pool = ToolPool([slow])
    outcome = await pool.run(call("slow", q="x"), ctx(), timeout=0.01)
    assert not outcome.ok
    assert outcome.content == "error: tool 'slow' timed out after 0.01s"
    state["release"].set()  # the execution itself was never cancelled; let it finish
    await until(lambda: pool.coalescer.inflight() == 0)
    assert state["cancelled"] == 0


async def test_tool_timeout_and_default_timeout() -> None:
    never = asyncio.Event()

    @tool(timeout=0.01)
    async def bounded() -> str:
        await never.wait()
        return "no"

    @tool
    async def unbounded() -> str:
        await never.wait()
        return "no"

    pool = ToolPool([bounded, unbounded], default_timeout=0.02)
    first = await pool.run(call("bounded"), ctx())
    second = await pool.run(call("unbounded"), ctx())
    assert "timed out after 0.01s" in first.content and not first.ok
    assert "timed out after 0.02s" in second.content and not second.ok
    await until(lambda: pool.coalescer.inflight() == 0)  # executions bounded too


async def test_sync_tool_timeout_releases_the_caller() -> None:
    gate = threading.Event()

    @tool(timeout=0.01)
    def blocking() -> str:
        gate.wait(30)
        return "late"

    pool = ToolPool([blocking])
    try:
        outcome = await pool.run(call("blocking"), ctx())
        assert not outcome.ok and "timed out" in outcome.content
    finally:
        gate.set()  # the worker thread cannot be killed; let it finish


# -- caching -------------------------------------------------------------------------------


def counting_tool(*, cacheable: bool, fail_first: bool = False) -> tuple[Tool, list[int]]:
    runs: list[int] = []

    def lookup(n: int) -> str:
        runs.append(n)
        if fail_first and len(runs) == 1:
            raise RuntimeError("transient")
        return f"value-{n}"

    return tool(cacheable=cacheable)(lookup), runs


async def test_cacheable_results_are_cached() -> None:
    lookup, runs = counting_tool(cacheable=True)
    pool = ToolPool([lookup])
    first = await pool.run(call("lookup", 0, n=1), ctx(0))
    second = await pool.run(call("lookup", 1, n=1), ctx(1))
    third = await pool.run(call("lookup", 2, n=2), ctx(2))
    assert (first.cached, second.cached, third.cached) == (False, True, False)
    assert second.content == "value-1" and second.ok
    assert runs == [1, 2]
    assert pool.stats()["cache_hits"] == 1


async def test_non_cacheable_results_are_not_cached() -> None:
    lookup, runs = counting_tool(cacheable=False)
    pool = ToolPool([lookup])
    await pool.run(call("lookup", 0, n=1), ctx(0))
    again = await pool.run(call("lookup", 1, n=1), ctx(1))
    assert not again.cached and runs == [1, 1]


async def test_errors_are_not_cached() -> None:
    lookup, runs = counting_tool(cacheable=True, fail_first=True)
    pool = ToolPool([lookup])
    failed = await pool.run(call("lookup", 0, n=1), ctx(0))
    retried = await pool.run(call("lookup", 1, n=1), ctx(1))
    cached = await pool.run(call("lookup", 2, n=1), ctx(2))
    assert not failed.ok and failed.content == "error: RuntimeError: transient"
    assert retried.ok and not retried.cached
    assert cached.cached and runs == [1, 1]


async def test_cache_is_shared_between_pools_and_survives_a_failing_cache() -> None:
    lookup, runs = counting_tool(cacheable=True)
    shared = TTLCache()
    await ToolPool([lookup], cache=shared).run(call("lookup", n=1), ctx())
    assert (await ToolPool([lookup], cache=shared).run(call("lookup", n=1), ctx())).cached

    class BrokenCache:
        async def get(self, key: str) -> str | None:
            raise ConnectionError("down")

        async def set(self, key: str, value: str, ttl: float | None = None) -> None:
            raise ConnectionError("down")

    outcome = await ToolPool([lookup], cache=BrokenCache()).run(call("lookup", n=1), ctx())
    assert outcome.ok and not outcome.cached and runs == [1, 1]


async def test_ttl_cache_expiry_and_lru() -> None:
    now = [0.0]
    cache = TTLCache(max_entries=2, ttl=10, clock=lambda: now[0])
    await cache.set("a", "1")
    await cache.set("b", "2")
    assert await cache.get("a") == "1"  # "a" becomes most recently used
    await cache.set("c", "3")  # evicts "b"
    assert await cache.get("b") is None and len(cache) == 2
    await cache.set("short", "x", ttl=1)
    now[0] = 5.0
    assert await cache.get("short") is None
    assert await cache.get("c") == "3"
    now[0] = 20.0
    assert await cache.get("c") is None


# -- error outcomes ------------------------------------------------------------------------


@tool
def add(a: int, b: int = 0) -> int:
    """Add two numbers."""
    return a + b


async def test_unknown_tool_lists_available_tools() -> None:
    outcome = await ToolPool([add]).run(call("nope"), ctx())
    assert not outcome.ok
    assert "unknown tool 'nope'" in outcome.content and "available tools: add" in outcome.content
    pool = ToolPool([add])
    for i in range(3):
        await pool.run(call(f"invented{i}"), ctx())
    stats = pool.stats()
    assert list(stats["by_tool"]) == ["(unknown tool)"]
    assert stats["errors"] == stats["calls"] == 3


async def test_invalid_arguments() -> None:
    pool = ToolPool([add])
    outcome = await pool.run(call("add", a="seven"), ctx())
    assert not outcome.ok
    assert "invalid arguments for tool 'add'" in outcome.content
    assert "valid integer" in outcome.content
    assert pool.stats()["executions"] == 0


async def test_arguments_error_is_reported() -> None:
    bad = ToolCall(id="c1", name="add", arguments={}, arguments_error="Expecting ',' at 1:7")
    outcome = await ToolPool([add]).run(bad, ctx())
    assert not outcome.ok and "not valid JSON" in outcome.content and outcome.call_id == "c1"


async def test_tool_error_message_is_verbatim_and_results_are_json() -> None:
    class Point(BaseModel):
        x: int

    @tool
    def refuse() -> str:
        raise ToolError("no such record: 42")

    @tool
    async def structured() -> dict[str, Any]:
        return {"b": [1, 2], "a": None}

    @tool
    def model() -> Point:
        return Point(x=1)

    pool = ToolPool([refuse, structured, model, add])
    outs = await pool.run_many(
        [call("refuse", 0), call("structured", 1), call("model", 2), call("add", 3, a=2, b=3)],
        lambda c: ctx(int(c.id.split("-")[1])),
    )
    assert [o.content for o in outs] == [
        "no such record: 42", '{"b":[1,2],"a":null}', '{"x":1}', "5",
    ]
    assert [o.ok for o in outs] == [False, True, True, True]
    assert [o.call_id for o in outs] == ["call-0", "call-1", "call-2", "call-3"]
    assert all(isinstance(o, ToolOutcome) for o in outs)


# -- execution details ---------------------------------------------------------------------


async def test_sync_tool_runs_in_a_thread_and_gets_the_context() -> None:
    @tool
    def where(context: ToolContext) -> str:
        return f"{threading.get_ident()}|{context.idempotency_key}"

    outcome = await ToolPool([where]).run(call("where"), ToolContext.for_call("b", 3, 2, "cx"))
    thread_id, idem = outcome.content.split("|")
    assert int(thread_id) != threading.get_ident()
    assert idem == "b:3:2:cx"


async def test_async_tool_gets_the_idempotency_key() -> None:
    @tool
    async def side_effect(item: str, ctx: ToolContext) -> str:
        return f"{item}@{ctx.idempotency_key}"

    outcome = await ToolPool([side_effect]).run(call("side_effect", item="x"), ctx(7, turn=4))
    assert outcome.content == "x@batch-1:7:4:call-7"


async def test_rate_limit_sleeps_for_the_deficit(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(ratelimit_mod, "_monotonic", lambda: now[0])
    monkeypatch.setattr(ratelimit_mod, "_sleep", fake_sleep)

    @tool(rate_limit=2.0)
    def limited(n: int) -> int:
        return n

    pool = ToolPool([limited])
    for i in range(3):
        assert (await pool.run(call("limited", i, n=i), ctx(i))).content == str(i)
    assert sleeps == [0.5, 0.5]
    now[0] += 10  # idle long enough: the bucket refills (to its burst of 1 only)
    await pool.run(call("limited", 9, n=9), ctx(9))
    await pool.run(call("limited", 10, n=10), ctx(10))
    assert sleeps == [0.5, 0.5, 0.5]


async def test_token_bucket_queues_concurrent_reservations() -> None:
    bucket = TokenBucket(4.0, clock=lambda: 0.0)
    assert [bucket.reserve() for _ in range(4)] == [0.0, 0.25, 0.5, 0.75]


async def test_token_bucket_cancelled_waiter_returns_its_token() -> None:
    sleeping = asyncio.Event()

    async def park(seconds: float) -> None:
        sleeping.set()
        await asyncio.Event().wait()

    bucket = TokenBucket(1.0, clock=lambda: 0.0, sleep=park)
    assert await bucket.acquire() == 0.0
    waiter = asyncio.create_task(bucket.acquire())
    await sleeping.wait()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert bucket.reserve() == 1.0  # not 2.0: the cancelled reservation was handed back


# -- construction --------------------------------------------------------------------------


def test_duplicate_names_rejected_and_schema_order_kept() -> None:
    with pytest.raises(BatchSpecError, match="duplicate tool name 'add'"):
        ToolPool([add, add])
    pool = ToolPool([Tool.web_search, add, "agentbatch.toolpool.builtins:read_file"])
    assert [s["function"]["name"] for s in pool.schemas()] == ["web_search", "add", "read_file"]
    assert canonical_json(pool.schemas()) == canonical_json(pool.schemas())
    assert "add" in pool and len(pool) == 3 and pool.get("add") is add


# -- the fleet-wide coalescer's lock (real redis-server) -----------------------------------


@pytest.mark.redis
async def test_redis_lock_uses_the_tools_ttl_and_is_renewed_while_the_tool_runs(
        redis_url: str) -> None:
    """A healthy leader running past its lock TTL keeps the call: a caller on another
    "worker" (its own coalescer and client) that arrives later waits and shares the result
    instead of running the tool a second time."""
    from agentbatch.distributed.state.connection import async_client
    from agentbatch.distributed.state.keys import TOOL_DONE_CHANNEL, tool_lock
    from agentbatch.distributed.state.note_hub import NoteHub
    from agentbatch.distributed.state.scripts import Scripts
    from agentbatch.distributed.tool_coalesce import RedisCoalescer, key_hash

    def worker() -> tuple[Any, RedisCoalescer]:
        client = async_client(redis_url)
        return client, RedisCoalescer(client, Scripts(client), NoteHub(client, TOOL_DONE_CHANNEL))

    (c1, first), (c2, second) = worker(), worker()
    started, release = asyncio.Event(), asyncio.Event()
    runs: list[tuple[int, bool]] = []

    async def thunk(lease: Any) -> str:
        started.set()
        await release.wait()
        runs.append((lease.fencing_token, await lease.still_held()))
        return "paid"

    lead = asyncio.create_task(first.run("call:k", thunk, lock_ttl=1.0))
    await started.wait()
    pttl = await c1.pttl(tool_lock(key_hash("call:k")))
    assert 0 < pttl <= 1000  # the tool's lock_ttl, not the 30 s default
    await asyncio.sleep(3.5)  # more than three TTLs: only renewals keep the lock
    follow = asyncio.create_task(second.run("call:k", thunk, lock_ttl=1.0))
    await asyncio.sleep(0.5)
    release.set()
    assert await asyncio.wait_for(lead, 30) == ("paid", False)
    assert await asyncio.wait_for(follow, 30) == ("paid", True)
    assert runs == [(1, True)]  # one execution, first fencing token, still the leader
    for client in (c1, c2):
        await client.aclose()
