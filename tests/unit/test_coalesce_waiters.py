"""``InflightCoalescer`` without ``asyncio.shield`` (issue 26 item 5): every caller waits on a
future of its own that the execution's task resolves, and bounds that wait with its own timer.
What the shield gave must still hold, for the single caller of a call nobody joins too:

- a caller cancelled, or past its timeout, stops only its own wait: the execution runs on to
  its end (and a caller arriving meanwhile still joins it), the other callers get its result;
- a failure reaches every waiter as that error, never as a hang, and is never logged as "never
  retrieved" (every caller gone, or cancelled as the error arrived);
- the execution cancelled (from inside or from outside) is an error for its waiters, not their
  cancellation; a caller's own cancel is never swallowed, even when the result came with it;
- one task per execution: the execution's timeout runs in that task (``asyncio.timeout``), not
  in one more (``wait_for``), and the caller's timeout makes none either.

No timing asserts: concurrency is driven by events, outcomes checked by counters.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from agentbatch.core.errors import ToolError
from agentbatch.core.model_io import ToolCall
from agentbatch.core.tool_context import Lease
from agentbatch.toolpool import InflightCoalescer, Tool, ToolContext, ToolPool


def ctx(i: int = 0) -> ToolContext:
    return ToolContext.for_call("batch-w", i, 0, f"call-{i}")


def call(name: str, i: int = 0, **arguments: Any) -> ToolCall:
    return ToolCall(id=f"call-{i}", name=name, arguments=arguments)


async def until(predicate: Callable[[], bool], spins: int = 10_000) -> None:
    for _ in range(spins):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


class Gate:
    """A thunk that runs until released; counts starts, ends and cancellations."""

    def __init__(self, *, fail: bool = False) -> None:
        self.release = asyncio.Event()
        self.fail = fail
        self.started = self.finished = self.cancelled = 0

    async def __call__(self, lease: Lease) -> str:
        self.started += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        if self.fail:
            raise ValueError("boom")
        return "result"


@contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """What the running loop's exception handler is given (e.g. "exception was never
    retrieved", "Task was destroyed but it is pending") while the block runs."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
    finally:
        gc.collect()  # a future's unretrieved error is reported when it is collected
        loop.set_exception_handler(old)


# --- a caller stops only its own wait --------------------------------------------------------


async def test_the_sole_caller_cancelled_leaves_the_execution_running_and_joinable() -> None:
    co, gate = InflightCoalescer(), Gate()
    first = asyncio.create_task(co.run("k", gate))
    await until(lambda: gate.started == 1)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert (co.inflight(), co.waiters("k"), gate.cancelled) == (1, 0, 0)
    late = asyncio.create_task(co.run("k", gate))  # still in flight: joins it
    await until(lambda: co.waiters("k") == 1)
    gate.release.set()
    assert await late == ("result", True)
    assert (gate.started, gate.finished, gate.cancelled, co.inflight()) == (1, 1, 0, 0)


async def test_the_sole_callers_timeout_ends_its_wait_not_the_execution() -> None:
    co, gate = InflightCoalescer(), Gate()
    with pytest.raises(asyncio.TimeoutError):
        await co.run("k", gate, timeout=0.01)
    assert (gate.started, gate.cancelled, co.inflight()) == (1, 0, 1)
    late = asyncio.create_task(co.run("k", gate, timeout=60.0))
    await until(lambda: co.waiters("k") == 1)
    gate.release.set()
    assert await late == ("result", True)
    assert (gate.finished, gate.cancelled, co.inflight()) == (1, 0, 0)


async def test_a_timed_out_caller_leaves_the_others_their_result() -> None:
    co, gate = InflightCoalescer(), Gate()
    patient = [asyncio.create_task(co.run("k", gate)) for _ in range(3)]
    hasty = asyncio.create_task(co.run("k", gate, timeout=0.01))
    with pytest.raises(asyncio.TimeoutError):
        await hasty
    assert co.waiters("k") == 3
    gate.release.set()
    assert await asyncio.gather(*patient) == [("result", False), ("result", True),
                                              ("result", True)]
    assert (gate.started, gate.cancelled) == (1, 0)


async def test_the_pool_per_call_timeout_keeps_the_execution_for_a_later_caller() -> None:
    """Through ``ToolPool.run`` (the path that hands the caller's timeout to the coalescer):
    the timed-out call is an outcome counted once under timeouts; a duplicate delivery of the
    same call arriving afterwards joins the execution that is still running."""
    gate = asyncio.Event()
    runs: list[str] = []

    async def act(q: str) -> str:  # a tool with side effects: keyed by the call itself
        runs.append(q)
        await gate.wait()
        return f"did {q}"

    pool = ToolPool([Tool(name="w_act", fn=act)])
    timed_out = await pool.run(call("w_act", 0, q="x"), ctx(0), timeout=0.01)
    assert not timed_out.ok and timed_out.content == "error: tool 'w_act' timed out after 0.01s"
    again = asyncio.create_task(pool.run(call("w_act", 0, q="x"), ctx(0), timeout=60.0))
    t = pool.tools[0]
    key = pool.call_key(t, t.spec.validate({"q": "x"}, tool_name="w_act"), ctx(0))
    await until(lambda: pool.coalescer.waiters(key) == 1)  # type: ignore[attr-defined]
    gate.set()
    out = await again
    assert out.ok and out.content == "did x" and out.coalesced
    assert runs == ["x"]
    stats = pool.stats()["by_tool"]["w_act"]
    assert (stats["timeouts"], stats["errors"], stats["executions"]) == (1, 1, 1)


async def test_side_effect_calls_of_two_agents_are_never_merged() -> None:
    gate = asyncio.Event()
    runs: list[int] = []

    async def act(q: str, context: ToolContext) -> str:
        runs.append(context.agent_index)
        await gate.wait()
        return f"{q} by {context.agent_index}"

    pool = ToolPool([Tool(name="w_side", fn=act)])
    tasks = [asyncio.create_task(pool.run(call("w_side", i, q="same"), ctx(i), timeout=60.0))
             for i in range(3)]
    await until(lambda: len(runs) == 3)
    gate.set()
    outs = await asyncio.gather(*tasks)
    assert [o.content for o in outs] == ["same by 0", "same by 1", "same by 2"]
    assert not any(o.coalesced for o in outs) and sorted(runs) == [0, 1, 2]


# --- failures and cancellations reach every waiter -------------------------------------------


async def test_a_failure_reaches_every_waiter_and_is_never_logged() -> None:
    co, gate = InflightCoalescer(), Gate(fail=True)
    with loop_errors() as seen:
        tasks = [asyncio.create_task(co.run("k", gate)) for _ in range(4)]
        await until(lambda: co.waiters("k") == 4)
        gate.release.set()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(o, ValueError) and str(o) == "boom" for o in outcomes)
        del outcomes, tasks  # (the error's traceback holds the execution's task)
    assert seen == []


async def test_a_failure_with_every_caller_gone_is_not_logged() -> None:
    co, gate = InflightCoalescer(), Gate(fail=True)
    with loop_errors() as seen:
        tasks = [asyncio.create_task(co.run("k", gate)) for _ in range(2)]
        await until(lambda: co.waiters("k") == 2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        gate.release.set()
        await until(lambda: co.inflight() == 0)
        await asyncio.sleep(0)
    assert gate.finished == 1 and seen == []


async def test_a_cancel_arriving_with_the_outcome_is_raised_and_the_error_not_logged() -> None:
    for fail in (False, True):
        co, gate = InflightCoalescer(), Gate(fail=fail)
        with loop_errors() as seen:
            waiter = asyncio.create_task(co.run("k", gate))
            await until(lambda: co.waiters("k") == 1)  # noqa: B023
            gate.release.set()
            await until(lambda: co.inflight() == 0)  # noqa: B023 (resolved, not yet resumed)
            assert not waiter.done()
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            del waiter
        assert seen == []


@pytest.mark.parametrize("where", ["inside", "outside"])
async def test_the_execution_cancelled_is_an_error_for_every_waiter(where: str) -> None:
    co = InflightCoalescer()
    started = asyncio.Event()

    async def thunk(lease: Lease) -> str:
        started.set()
        if where == "inside":
            raise asyncio.CancelledError
        await asyncio.Event().wait()
        return "never"

    before = asyncio.all_tasks()
    tasks = [asyncio.create_task(co.run("k", thunk)) for _ in range(3)]
    await started.wait()
    if where == "outside":  # e.g. the loop shutting down cancels every task
        (execution,) = asyncio.all_tasks() - before - set(tasks) - {asyncio.current_task()}
        execution.cancel()
    # (bounded: a waiter left hanging fails here instead of stalling the run)
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    assert all(isinstance(o, ToolError) and "cancelled" in str(o) for o in outcomes)
    assert co.inflight() == 0


# --- one task per execution --------------------------------------------------------------------


@contextmanager
def counted_tasks() -> Iterator[list[Any]]:
    loop = asyncio.get_running_loop()
    made: list[Any] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    old = loop.get_task_factory()
    loop.set_task_factory(factory)  # type: ignore[arg-type]
    try:
        yield made
    finally:
        loop.set_task_factory(old)


@pytest.mark.parametrize(("own", "given"), [(None, None), (None, 60.0), (30.0, None),
                                            (30.0, 60.0), (30.0, 30.0)])
async def test_one_task_per_call_whatever_the_timeouts(own: float | None,
                                                       given: float | None) -> None:
    async def quick(q: str) -> str:
        await asyncio.sleep(0)
        return q

    pool = ToolPool([Tool(name="w_quick", fn=quick, timeout=own)])
    with counted_tasks() as made:
        out = await pool.run(call("w_quick", q="a"), ctx(), timeout=given)
    assert out.ok and out.content == "a"
    assert len(made) == 1  # the execution's; wait_for would add one, shield none but callbacks


async def test_the_execution_timeout_still_ends_the_execution_for_every_waiter() -> None:
    cancelled: list[str] = []

    async def stuck(q: str) -> str:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(q)
            raise
        return q

    pool = ToolPool([Tool(name="w_stuck", fn=stuck, timeout=0.01, coalesce=True)])
    outs = await asyncio.gather(*(pool.run(call("w_stuck", i, q="s"), ctx(i), timeout=60.0)
                                  for i in range(3)))
    assert [o.content for o in outs] == ["error: tool 'w_stuck' timed out after 0.01s"] * 3
    assert cancelled == ["s"]  # the execution's own timeout cancels it, once
    assert pool.stats()["by_tool"]["w_stuck"]["timeouts"] == 3
    assert pool.coalescer.inflight() == 0  # type: ignore[attr-defined]


async def test_a_tools_own_timeout_error_is_an_error_not_a_timeout() -> None:
    async def raises(q: str) -> str:
        raise TimeoutError("upstream slow")

    pool = ToolPool([Tool(name="w_raises", fn=raises, timeout=30.0)])
    out = await pool.run(call("w_raises", q="a"), ctx(), timeout=60.0)
    assert not out.ok and out.content == "error: TimeoutError: upstream slow"
    stats = pool.stats()["by_tool"]["w_raises"]
    assert (stats["timeouts"], stats["errors"]) == (0, 1)
