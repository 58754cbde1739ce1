"""ToolPool's per-call trims (issue 26 item 5) keep what the code they replace did: the call
key is ``json.dumps``'s text, a tool that takes a context gets the caller's as seen under
the execution's lease, the timeout is the first given of call, tool and pool, and who shares
an execution, and what the stats and metrics count, is unchanged."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from agentbatch.core.model_io import ToolCall, canonical_json
from agentbatch.core.tool_context import Lease, LocalLease
from agentbatch.metrics import metrics
from agentbatch.toolpool import Tool, ToolContext, ToolPool, tool


def ctx(i: int = 0, batch: str = "b-1", call_id: str | None = None) -> ToolContext:
    return ToolContext.for_call(batch, i, 0, call_id or f"call-{i}")


def call(name: str, i: int = 0, **arguments: Any) -> ToolCall:
    return ToolCall(id=f"call-{i}", name=name, arguments=arguments)


async def until(predicate: Any, spins: int = 10_000) -> None:
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


# --- call_key: json.dumps's text ------------------------------------------------------------


async def _echo(q: str) -> str:
    return q


@pytest.mark.parametrize("kind", ["own", "batch", "fleet", "keyed"])
@pytest.mark.parametrize("q", ["x", 'qu"ote\\', "naïve ☃ 𝄞", "\x00\n", ""])
@pytest.mark.parametrize("batch", ["b-1", 'b"2', "bä"])
def test_the_call_key_is_json_dumps_text(kind: str, q: str, batch: str) -> None:
    table: dict[str, dict[str, Any]] = {
        "own": {}, "batch": {"coalesce": True}, "fleet": {"cacheable": True, "share": "fleet"},
        "keyed": {"cacheable": True, "cache_key": lambda q: {"k": q[:3], "n": len(q)}},
    }
    options = table[kind]
    t = Tool(name="echo", fn=_echo, **options)
    pool = ToolPool([t])
    c = ctx(3, batch, call_id='c"1')
    args = t.spec.validate({"q": q}, tool_name="echo")
    if not t.shares_calls:
        scope = f"call:{c.idempotency_key}"
    elif t.share == "fleet":
        scope = "fleet"
    else:
        scope = f"batch:{c.batch_id}"
    part = args.canonical
    if t.cache_key is not None and t.shares_calls:
        part = "key:" + canonical_json(t.sharing_key(args.kwargs))
    want = json.dumps([scope, t.identity, part], separators=(",", ":"))
    assert pool.call_key(t, args, c) == want


# --- a tool's context: the caller's, under the execution's lease ---------------------------


@pytest.mark.parametrize("options", [{}, {"coalesce": True}, {"cacheable": True}])
async def test_a_tool_gets_the_callers_context_under_the_lease(options: dict[str, Any]) -> None:
    seen: list[ToolContext] = []

    async def peek(q: str, context: ToolContext) -> str:
        seen.append(context)
        return q

    pool = ToolPool([Tool(name="peek", fn=peek, **options)])
    mine = ctx(5)
    out = await pool.run(call("peek", 5, q="a"), mine)
    assert out.ok and out.content == "a"
    [got] = seen
    assert isinstance(got.lease, LocalLease)
    assert got == mine.under(got.lease)  # every other field the caller's
    assert got.fencing_token == got.lease.fencing_token


async def test_a_held_lease_reaches_the_tool_unchanged() -> None:
    seen: list[ToolContext] = []

    async def peek(q: str, context: ToolContext) -> str:
        seen.append(context)
        return q

    lease: Lease = LocalLease()
    mine = ctx(1).under(lease)  # the distributed engine's call, its lease already taken
    out = await ToolPool([Tool(name="peek", fn=peek)]).run(call("peek", 1, q="b"), mine)
    assert out.ok and seen == [mine.under(lease)] and seen[0].lease is lease


async def test_a_tool_without_a_context_parameter_gets_none() -> None:
    async def plain(q: str) -> str:
        return q

    async def extra(q: str, **rest: Any) -> str:
        return f"{q} {sorted(rest)}"

    pool = ToolPool([Tool(name="plain", fn=plain), Tool(name="extra", fn=extra)])
    assert (await pool.run(call("plain", q="c"), ctx())).content == "c"
    assert (await pool.run(call("extra", q="d"), ctx())).content == "d []"


# --- the timeout: the first given of the call's, the tool's, the pool's ---------------------


@pytest.mark.parametrize(("given", "own", "pool_default", "applied"), [
    (0.01, 50.0, 60.0, "0.01s"), (None, 0.02, 60.0, "0.02s"), (None, None, 0.03, "0.03s"),
    (0.0, 50.0, 60.0, "0s"), (0.04, None, None, "0.04s"), (0.05, None, 60.0, "0.05s"),
])
async def test_the_timeout_applied_is_the_first_given(
        given: float | None, own: float | None, pool_default: float | None,
        applied: str) -> None:
    never = asyncio.Event()

    async def stuck() -> str:
        await never.wait()
        return "no"

    pool = ToolPool([Tool(name="stuck", fn=stuck, timeout=own)], default_timeout=pool_default)
    out = await pool.run(call("stuck"), ctx(), timeout=given)
    assert not out.ok and out.content.endswith(f"timed out after {applied}")
    assert pool.stats()["timeouts"] == 1
    never.set()


async def test_with_no_timeout_anywhere_none_applies() -> None:
    release = asyncio.Event()

    async def gated() -> str:
        await release.wait()
        return "done"

    pool = ToolPool([Tool(name="gated", fn=gated)])
    task = asyncio.create_task(pool.run(call("gated"), ctx()))
    await until(lambda: pool.coalescer.inflight() == 1)  # type: ignore[attr-defined]
    for _ in range(50):
        await asyncio.sleep(0)
    assert not task.done()
    release.set()
    assert (await task).content == "done"


# --- who shares, and what is counted ---------------------------------------------------------


def _metric(name: str, tool_name: str, **labels: str) -> float | None:
    return metrics().registry.get_sample_value(name, {"tool": tool_name, **labels})


@pytest.mark.parametrize("share", ["own", "coalesce"])
async def test_sharing_and_counters(share: str) -> None:
    """Two agents with the same arguments and one duplicate delivery, all at once: a tool
    with side effects runs once per call (the duplicate joins it), a read-only one once."""
    release = asyncio.Event()
    runs: list[str] = []
    name = f"trim_{share}"

    async def act(q: str) -> str:
        runs.append(q)
        await release.wait()
        return f"did {q}"

    pool = ToolPool([Tool(name=name, fn=act, coalesce=share == "coalesce")])
    tasks = [asyncio.create_task(pool.run(call(name, i, q="same"), ctx(i)))
             for i in (0, 1, 0)]  # agent 0's call delivered twice
    await until(lambda: len(runs) == (2 if share == "own" else 1))
    for _ in range(20):
        await asyncio.sleep(0)
    release.set()
    outs = await asyncio.gather(*tasks)
    assert [o.content for o in outs] == ["did same"] * 3
    expected_runs = 2 if share == "own" else 1
    assert len(runs) == expected_runs
    assert [o.coalesced for o in outs] == ([False, False, True] if share == "own"
                                           else [False, True, True])
    stats = pool.stats()["by_tool"][name]
    assert stats == {"calls": 3, "executions": expected_runs, "cache_hits": 0,
                     "coalesced": 3 - expected_runs, "errors": 0, "timeouts": 0}
    assert _metric("agentbatch_tool_calls_total", name) == 3
    assert _metric("agentbatch_tool_executions_total", name) == expected_runs
    assert _metric("agentbatch_tool_shared_total", name, how="coalesced") == 3 - expected_runs
    assert _metric("agentbatch_tool_shared_total", name, how="cached") == 0  # made at 0
    assert _metric("agentbatch_tool_errors_total", name) == 0
    assert _metric("agentbatch_tool_timeouts_total", name) == 0


async def test_cached_errors_and_unknown_are_counted_as_before() -> None:
    name = "trim_cached"
    pool = ToolPool([tool(name=name, cacheable=True)(_echo)])
    first = await pool.run(call(name, 0, q="z"), ctx(0))
    second = await pool.run(call(name, 1, q="z"), ctx(1))
    bad = await pool.run(call(name, 2, q=3), ctx(2))
    ghost = await pool.run(call("trim_ghost", 3), ctx(3))
    assert (first.cached, second.cached) == (False, True) and not bad.ok and not ghost.ok
    assert pool.stats()["by_tool"][name] == {"calls": 3, "executions": 1, "cache_hits": 1,
                                             "coalesced": 0, "errors": 1, "timeouts": 0}
    assert _metric("agentbatch_tool_shared_total", name, how="cached") == 1
    assert _metric("agentbatch_tool_errors_total", name) == 1
    assert _metric("agentbatch_tool_calls_total", name) == 3
