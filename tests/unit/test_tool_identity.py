"""Tool identity, sharing scope, unmerged side effects and the execution lease (issue 8).

In-process: the pool and coalescer the embedded engine uses. The distributed side is covered
with real workers in tests/integration/test_tool_sharing.py.
"""

from __future__ import annotations

import asyncio
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ToolCall
from agentbatch.core.tool_context import LocalLease
from agentbatch.toolpool import Tool, ToolContext, ToolPool, TTLCache, tool
from agentbatch.turnloop.turn_io import EarlyTools
from tests.support import tools, tools_other


def ctx(batch: str = "b1", i: int = 0, call_id: str = "c0") -> ToolContext:
    return ToolContext.for_call(batch, i, 0, call_id)


def call(name: str, call_id: str = "c0", **arguments: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


def key(pool: ToolPool, t: Tool, context: ToolContext, **arguments: Any) -> str:
    return pool.call_key(t, t.spec.validate(arguments, tool_name=t.name), context)


async def wait_until(predicate: Any, spins: int = 10_000) -> None:
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def module_price(item: str) -> str:
    """A module-level function wrapped without @tool.

    Args:
        item: the item.
    """
    return item


# -- identity ------------------------------------------------------------------------------


def test_identity_is_import_path_and_version_not_name() -> None:
    a, b = tools.price, tools_other.price
    assert a.name == b.name == "price"
    assert a.identity.startswith("tests.support.tools:price@")
    assert b.identity.startswith("tests.support.tools_other:price@")
    pool_a, pool_b = ToolPool([a]), ToolPool([b])
    assert key(pool_a, a, ctx(), item="x") != key(pool_b, b, ctx(), item="x")


def test_version_is_explicit_or_a_hash_of_signature_and_source() -> None:
    def f(item: str) -> str:
        return item

    def g(item: str) -> str:
        return item.upper()

    assert tool(version="v2")(f).identity.endswith("@v2")
    hashed_f = tool(name="f")(f).identity.split("@")[1]
    assert hashed_f == tool(name="f")(f).identity.split("@")[1]  # stable
    assert hashed_f != tool(name="f")(g).identity.split("@")[1]  # edited body, new version


def test_closures_with_the_same_code_are_different_tools() -> None:
    def make(root: str) -> Tool:
        def read(path: str) -> str:
            return root + path

        return tool(cacheable=True)(read)

    assert make("/a").identity != make("/b").identity


def test_a_tool_without_import_path_pickles_with_its_settings() -> None:
    t = Tool(name="p", fn=module_price, cacheable=True, share="fleet", lock_ttl=2.0,
             version="7")
    copy = pickle.loads(pickle.dumps(t))
    assert (copy.share, copy.lock_ttl, copy.version, copy.identity) == (
        "fleet", 2.0, "7", t.identity)


@pytest.mark.parametrize(("options", "word"), [
    ({"share": "fleet"}, "share='fleet' needs cacheable=True or coalesce=True"),
    ({"share": "world", "cacheable": True}, "share must be 'batch' or 'fleet'"),
    ({"lock_ttl": 0}, "lock_ttl must be a positive number"),
    ({"lock_ttl": float("inf")}, "lock_ttl must be a positive number"),
    ({"version": ""}, "version must be a non-empty string"),
])
def test_bad_sharing_options_are_refused(options: dict[str, Any], word: str) -> None:
    with pytest.raises(BatchSpecError, match=word.replace("(", r"\(").replace(")", r"\)")):
        tool(**options)(module_price)


# -- scope ---------------------------------------------------------------------------------


def test_keys_are_scoped_to_the_batch_unless_the_tool_says_fleet() -> None:
    batch = tool(cacheable=True)(module_price)
    fleet = tool(cacheable=True, share="fleet")(module_price)
    plain = tool(module_price)
    pool = ToolPool([batch])

    def k(t: Tool, context: ToolContext) -> str:
        return key(pool, t, context, item="x")

    assert k(batch, ctx("b1", 0)) == k(batch, ctx("b1", 5, "c9"))
    assert k(batch, ctx("b1")) != k(batch, ctx("b2"))
    assert k(fleet, ctx("b1")) == k(fleet, ctx("b2", 3))
    assert k(plain, ctx("b1", 0)) != k(plain, ctx("b1", 1))
    assert k(plain, ctx("b1", 0)) == k(plain, ctx("b1", 0))


async def test_fleet_results_are_shared_by_pools_of_one_process() -> None:
    runs: list[str] = []

    @tool(cacheable=True, share="fleet")
    async def rate(item: str) -> str:
        runs.append(item)
        return f"rate-{item}"

    @tool(cacheable=True)
    async def local_rate(item: str) -> str:
        runs.append("local-" + item)
        return f"rate-{item}"

    for batch in ("b1", "b2"):  # two batches, each with its own per-batch cache
        pool = ToolPool([rate, local_rate], cache=TTLCache())
        for name in ("rate", "local_rate"):
            assert (await pool.run(call(name, item="x"), ctx(batch))).ok
    assert sorted(runs) == ["local-x", "local-x", "x"]


# -- side effects --------------------------------------------------------------------------


async def test_a_plain_tool_runs_once_per_agent_call_with_its_own_key() -> None:
    release = asyncio.Event()
    seen: list[str] = []

    @tool
    async def pay(invoice: str, context: ToolContext) -> str:
        seen.append(context.idempotency_key)
        await release.wait()
        return "paid"

    pool = ToolPool([pay])
    calls = [asyncio.create_task(pool.run(call("pay", invoice="i1"), ctx(i=i)))
             for i in range(2)]
    await wait_until(lambda: len(seen) == 2)  # both run at the same moment
    release.set()
    outcomes = await asyncio.gather(*calls)
    assert seen == [ctx(i=0).idempotency_key, ctx(i=1).idempotency_key]
    assert not any(o.coalesced for o in outcomes)


async def test_duplicate_deliveries_of_one_call_are_still_merged() -> None:
    release = asyncio.Event()
    seen: list[str] = []

    @tool
    async def pay(invoice: str, context: ToolContext) -> str:
        seen.append(context.idempotency_key)
        await release.wait()
        return "paid"

    pool = ToolPool([pay])
    calls = [asyncio.create_task(pool.run(call("pay", invoice="i1"), ctx())) for _ in range(2)]
    await wait_until(lambda: pool.coalescer.waiters(key(pool, pay, ctx(), invoice="i1")) == 2)
    release.set()
    outcomes = await asyncio.gather(*calls)
    assert seen == [ctx().idempotency_key]
    assert [o.coalesced for o in outcomes] == [False, True]


async def test_only_tools_safe_to_share_start_early_from_a_stream() -> None:
    started: list[str] = []

    def make(name: str, **options: Any) -> Tool:
        async def fn(q: str) -> str:
            started.append(name)
            return q

        return tool(name=name, **options)(fn)

    pool = ToolPool([make("plain"), make("cached", cacheable=True),
                     make("read_only", coalesce=True)])
    rt = SimpleNamespace(tools=pool, plan=SimpleNamespace(batch_id="b1", timeout_per_tool=None))
    early = EarlyTools(rt, SimpleNamespace(index=0, steps=0))  # type: ignore[arg-type]
    for i, name in enumerate(("plain", "cached", "read_only")):
        early(call(name, f"c{i}", q="x"))
    await asyncio.gather(*early.tasks.values())
    assert sorted(early.tasks) == ["c1", "c2"]
    assert sorted(started) == ["cached", "read_only"]


# -- lease ---------------------------------------------------------------------------------


async def test_in_process_executions_get_increasing_fencing_tokens_and_stay_leader() -> None:
    seen: list[tuple[int, bool]] = []

    @tool
    async def fenced(q: str, context: ToolContext) -> str:
        seen.append((context.fencing_token, await context.still_leader()))
        return q

    pool = ToolPool([fenced])
    for i in range(2):
        assert (await pool.run(call("fenced", q="x"), ctx(i=i))).ok
    (first, held1), (second, held2) = seen
    assert 0 < first < second and held1 and held2
    assert LocalLease().fencing_token > second
    assert ctx().fencing_token == 0  # outside a pool: no execution, no token


def test_decorated_functions_are_versioned_by_their_own_source() -> None:
    """The source is read once per code object; a shared wrapper's code must not stand in
    for the functions it wraps (``inspect.getsource`` follows ``__wrapped__``)."""
    import functools

    def logged(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    @logged
    def f(item: str) -> str:
        return item

    @logged
    def g(item: str) -> str:
        return item.upper()

    assert f.__code__ is g.__code__  # the wrapper's
    assert tool(name="f")(f).identity.split("@")[1] != tool(name="f")(g).identity.split("@")[1]
