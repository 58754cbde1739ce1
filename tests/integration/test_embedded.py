"""The embedded engine end to end, against the real simulator over HTTP."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
from pydantic import BaseModel

from agentbatch import BatchSpecError, arun_batch, run_batch, submit_batch, tool
from tests.support.waits import poll_until


class Brief(BaseModel):
    title: str
    score: int


CALLS: dict[str, int] = {}
_lock = threading.Lock()


@tool
async def fetch(key: str) -> str:
    """Fetch a value by key.

    Args:
        key: what to fetch.
    """
    with _lock:
        CALLS[key] = CALLS.get(key, 0) + 1
    await asyncio.sleep(0.2)
    return f"data for {key}"


RELEASE = threading.Event()  # set by a test when its tool calls may return


async def released(within_s: float = 60.0) -> None:
    """Wait (bounded) for the test to set ``RELEASE``: a tool held on an event, not a sleep."""
    deadline = time.monotonic() + within_s
    while not RELEASE.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


@tool(coalesce=True)  # read-only: only tools declared safe to share merge agents' calls
async def fetch_slowly(key: str) -> str:
    """Fetch until released, so every agent's first turn lands inside the one execution.

    Args:
        key: what to fetch.
    """
    with _lock:
        CALLS[key] = CALLS.get(key, 0) + 1
    await released()
    return f"data for {key}"


@tool
async def fetch_when_released(key: str) -> str:
    """Fetch once the test has released it.

    Args:
        key: what to fetch.
    """
    await released()
    return f"data for {key}"


@tool
async def slow(key: str) -> str:
    """A tool that takes a long time.

    Args:
        key: anything.
    """
    await asyncio.sleep(30)
    return "late"


@pytest.fixture(autouse=True)
def _reset_calls():
    CALLS.clear()
    RELEASE.clear()


def _run(sim_url, task, inputs, **kw):
    kw.setdefault("model", "sim-model")
    kw.setdefault("backend", sim_url)
    return run_batch(task, inputs, **kw)


def test_tools_and_schema_end_to_end(sim_url):
    task = ('Brief on {name}.\n@sim tool fetch {{"key": "{name}-a"}}\n'
            '@sim tool fetch {{"key": "{name}-b"}}')
    results = _run(sim_url, task, [{"name": f"n{i}"} for i in range(20)], tools=[fetch],
                   output_schema=Brief, max_turns=4)
    assert [r.index for r in results] == list(range(20))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(isinstance(r.output, Brief) for r in results)
    assert all(r.turns == 3 and len(r.tool_calls) == 2 for r in results)
    assert results[0].tool_calls[0].arguments == {"key": "n0-a"}
    assert all(r.usage.prompt_tokens > 0 for r in results)
    assert sum(CALLS.values()) == 40


def test_identical_concurrent_calls_execute_once(sim_url):
    task = 'Agent {i}.\n@sim tool fetch_slowly {{"key": "shared"}}'
    handle = submit_batch(task, [{"i": i} for i in range(50)], model="sim-model",
                          backend=sim_url, tools=[fetch_slowly], output_schema=Brief)
    poll_until(handle.progress, lambda p: p.awaiting_tools == 50,  # all inside the one call
               lambda p: f"not every agent awaits the call: {p}", timeout=60, poll_s=0.05)
    RELEASE.set()
    results = handle.wait(timeout=60)
    assert all(r.ok for r in results)
    assert CALLS == {"shared": 1}
    assert sum(r.tool_calls[0].coalesced for r in results) == 49


@pytest.mark.parametrize("fault", ["malformed_json", "bad_tool_call", "http_500", "http_429",
                                   "timeout"])
def test_each_injected_fault_is_recovered(sim, sim_url, fault):
    task = 'Agent {i}.\n@sim tool fetch {{"key": "k{i}"}}\n@sim fail ' + fault
    results = _run(sim_url, task, [{"i": i} for i in range(4)], tools=[fetch],
                   output_schema=Brief, timeout_per_turn=1.0, max_retries=2)
    assert all(r.ok for r in results), [r.error for r in results]
    assert sim.state.stats.as_dict()["faults"].get(fault, 0) >= 4


def test_permanent_failure_is_isolated(sim_url):
    inputs = [{"i": i, "extra": "@sim fail http_500 times=50" if i == 3 else ""}
              for i in range(10)]
    results = _run(sim_url, "Agent {i}.\n{extra}", inputs, output_schema=Brief, max_retries=1)
    assert [r.ok for r in results] == [i != 3 for i in range(10)]
    assert results[3].error.kind == "server_error"
    assert "after 2 attempts" in results[3].error.message


def test_output_that_never_validates_is_a_structured_error(sim_url):
    results = _run(sim_url, "Agent {i}.\n@sim answer not json at all", [{"i": 0}],
                   output_schema=Brief, max_retries=2)
    assert not results[0].ok and results[0].error.kind == "invalid_output"
    assert results[0].turns == 3  # the answer and two repair turns


def test_repair_turn_fixes_fenced_trailing_comma_json(sim_url):
    task = 'Agent {i}.\n@sim answer ```json\\n{{"title": "t", "score": 3,}}\\n```'
    results = _run(sim_url, task, [{"i": 0}], output_schema=Brief)
    assert results[0].ok and results[0].output == Brief(title="t", score=3)
    assert results[0].turns == 1  # repaired locally, no extra model turn


def test_model_that_never_stops_calling_tools_hits_max_turns(sim_url):
    lines = "\n".join(f'@sim tool fetch {{{{"key": "x{j}"}}}}' for j in range(5))
    results = _run(sim_url, "Agent {i}.\n" + lines, [{"i": 0}], tools=[fetch], max_turns=3)
    assert results[0].error.kind == "max_turns"
    assert len(results[0].tool_calls) == 2


def test_free_text_output(sim_url):
    results = _run(sim_url, "Say hi to {who}.", [{"who": "ann"}])
    assert results[0].ok and isinstance(results[0].output, str) and results[0].output


def test_cancel_ends_unfinished_agents_as_cancelled(sim_url):
    handle = submit_batch('Agent {i}.\n@sim tool slow {{"key": "k"}}', [{"i": i} for i in range(8)],
                          model="m", backend=sim_url, tools=[slow])
    first = handle.results()
    handle.cancel()
    results = handle.wait(timeout=30)
    assert len(results) == 8
    assert {r.error.kind for r in results} == {"cancelled"}
    assert list(first)  # an earlier reader still sees every result


def test_leaving_results_early_keeps_the_batch_owned(sim_url):
    with submit_batch("Agent {i}.", [{"i": i} for i in range(30)], model="m",
                      backend=sim_url) as handle:
        for _ in handle.results():
            break
        results = handle.wait(timeout=30)
    assert len(results) == 30 and all(r.ok for r in results)


def test_on_result_exception_never_hangs_the_batch(sim_url):
    seen = []

    def callback(result):
        seen.append(result.index)
        raise RuntimeError("user bug")

    results = _run(sim_url, "Agent {i}.", [{"i": i} for i in range(10)], on_result=callback)
    assert len(results) == 10 and sorted(seen) == list(range(10))


async def test_async_api_and_async_callback(sim_url):
    seen = []

    async def callback(result):
        seen.append(result.index)

    results = await arun_batch("Agent {i}.", [{"i": i} for i in range(10)], model="m",
                               backend=sim_url, on_result=callback)
    await asyncio.sleep(0)
    assert len(results) == 10 and all(r.ok for r in results)
    assert sorted(seen) == list(range(10))


def test_results_stream_in_completion_order(sim_url):
    inputs = [{"i": i, "extra": '@sim tool fetch_when_released {"key": "s"}'
               if i % 2 == 0 else ""} for i in range(6)]
    handle = submit_batch("Agent {i}.\n{extra}", inputs, model="m", backend=sim_url,
                          tools=[fetch_when_released])
    order = []
    for r in handle.results(timeout=60):
        order.append(r.index)
        if len(order) == 3:  # the tool-free agents are out: the others' tools may return
            RELEASE.set()
    assert sorted(order) == list(range(6))
    assert set(order[:3]) == {1, 3, 5}  # tool-free agents are streamed as each finishes


def test_unreachable_backend_fails_at_warmup_before_dispatch():
    from agentbatch.core.errors import BackendError

    with pytest.raises(BackendError, match="warm-up"):
        run_batch("x {i}", [{"i": 1}, {"i": 2}], model="m", backend="vllm://127.0.0.1:1",
                  timeout_per_turn=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inputs": [{"a": 1}, {"b": 2}]}, "input 1: template variable(s) 'a' missing"),
        ({"tools": ["no_such_module:thing"]}, "tools[0]"),
        ({"output_schema": dict}, "output_schema must be a Pydantic model"),
        ({"backend": "gopher://x"}, "gopher"),
        ({"max_turns": 0}, "max_turns must be an integer >= 1"),
        ({"inputs": [{"a": 1}, 5]}, "input 1: each input must be a dict"),
        ({"task": "{}"}, "positional"),
    ],
)
def test_bad_input_is_refused_before_anything_is_sent(sim, kwargs, message):
    args = {"task": "Do {a}", "inputs": [{"a": 1}], "model": "m",
            "backend": "sim://" + sim.url.split("://")[1], **kwargs}
    before = sim.state.stats.as_dict()["requests_total"]
    with pytest.raises(ValueError, match=re.escape(message)):
        run_batch(args.pop("task"), args.pop("inputs"), **args)
    assert isinstance(BatchSpecError("x"), ValueError)
    assert sim.state.stats.as_dict()["requests_total"] == before
