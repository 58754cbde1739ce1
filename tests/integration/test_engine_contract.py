"""The behaviour contract both engines keep, each test run on each engine over real parts.

Embedded: ``submit_batch`` with no Redis, agents as coroutines in this process. Distributed:
``submit_batch`` with a Redis URL, turns and tool calls run by a real ``agentbatch worker``
process. The model is the simulator over real HTTP (one per test, so its scripted faults count
from zero); ``@sim`` directives in the task script each agent's turns and faults.

The worker is shared by every distributed case of this module (a module-scoped fixture on its
own Redis database), so the module does not pay a worker start per test.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from agentbatch import AgentResult, BatchSpecError, submit_batch
from agentbatch.sim.server import SimServer
from agentbatch.turnloop.handle import BatchHandle
from tests.support.contract_tools import gate
from tests.support.pure_tools import stamp
from tests.support.redis_server import RedisServer
from tests.support.tools import Answer, always_fails
from tests.support.workers import WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

CONTRACT_DB = 7  # the shared worker's database: the per-test ``redis_url`` fixture flushes 0
WAIT_S = 180.0  # generous: the machine is shared; every wait below has this deadline


@pytest.fixture(scope="module")
def contract_redis(redis_server: RedisServer) -> str:
    """A Redis database for this module alone (the gate keys, and the distributed batches)."""
    url = redis_server.url.rsplit("/", 1)[0] + f"/{CONTRACT_DB}"
    redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="module")
def shared_worker(contract_redis: str) -> Iterator[WorkerProcess]:
    """One real worker (turns and tools) that every distributed case of the module uses."""
    worker = WorkerProcess(contract_redis, name="contract", concurrency=16).start()
    yield worker
    worker.stop(timeout=15)


@dataclass(frozen=True)
class Engine:
    """Submits a batch to one engine; ``redis_url`` None is the embedded engine."""

    name: str
    backend: str
    redis_url: str | None

    def submit(self, task: str, inputs: list[dict[str, Any]], **kw: Any) -> BatchHandle:
        kw.setdefault("model", "sim-model")
        if self.redis_url is not None:
            kw["redis_url"] = self.redis_url
        return submit_batch(task, inputs, backend=self.backend, **kw)

    def run(self, task: str, inputs: list[dict[str, Any]], **kw: Any) -> list[AgentResult]:
        with self.submit(task, inputs, **kw) as handle:
            return handle.wait(timeout=WAIT_S)


@pytest.fixture(params=["embedded", "distributed"])
def engine(request: pytest.FixtureRequest, sim_url: str, contract_redis: str) -> Engine:
    if request.param == "distributed":
        request.getfixturevalue("shared_worker")
        return Engine("distributed", sim_url, contract_redis)
    return Engine("embedded", sim_url, None)


def faults_injected(sim: SimServer) -> dict[str, int]:
    return dict(sim.state.stats.as_dict()["faults"])


# -- repair turns ----------------------------------------------------------------------------


def test_fenced_trailing_comma_json_is_repaired_without_a_model_turn(engine: Engine) -> None:
    task = 'Agent {i}.\n@sim answer ```json\\n{{"summary": "t", "score": 3,}}\\n```'
    [result] = engine.run(task, [{"i": 0}], output_schema=Answer)
    assert result.ok, result.error
    assert result.output == Answer(summary="t", score=3)
    assert result.turns == 1  # repaired locally, no extra model turn


def test_malformed_output_is_repaired_by_a_repair_turn(engine: Engine, sim: SimServer) -> None:
    results = engine.run("Agent {i}.\n@sim fail malformed_json", [{"i": i} for i in range(3)],
                         output_schema=Answer, max_retries=2)
    assert all(r.ok and isinstance(r.output, Answer) for r in results), \
        [r.error for r in results]
    assert [r.turns for r in results] == [2, 2, 2]  # the bad answer, then the repair turn
    assert faults_injected(sim).get("malformed_json") == 3


def test_output_that_never_validates_is_a_structured_error(engine: Engine) -> None:
    [result] = engine.run("Agent {i}.\n@sim answer not json at all", [{"i": 0}],
                          output_schema=Answer, max_retries=2)
    assert not result.ok and result.error is not None
    assert result.error.kind == "invalid_output"
    assert result.turns == 3  # the answer and two repair turns


# -- max turns -------------------------------------------------------------------------------


def test_a_model_that_never_stops_calling_tools_ends_at_max_turns(engine: Engine) -> None:
    lines = "\n".join(f'@sim tool stamp {{{{"key": "x{j}"}}}}' for j in range(5))
    [result] = engine.run("Agent {i}.\n" + lines, [{"i": 0}], tools=[stamp], max_turns=3)
    assert not result.ok and result.error is not None
    assert result.error.kind == "max_turns"
    assert len(result.tool_calls) == 2
    assert result.turns == 3


# -- backend faults --------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["http_500", "http_429", "malformed_json", "bad_tool_call",
                                   "timeout"])
def test_each_injected_fault_is_recovered(engine: Engine, sim: SimServer, fault: str) -> None:
    task = 'Agent {i}.\n@sim tool stamp {{"key": "k{i}"}}\n@sim fail ' + fault + " times=2"
    # A ``timeout`` fault holds the request 30 s; 5 s per turn is far above a normal turn here.
    results = engine.run(task, [{"i": i} for i in range(4)], tools=[stamp],
                         output_schema=Answer, max_retries=2, timeout_per_turn=5.0)
    assert all(r.ok and isinstance(r.output, Answer) for r in results), \
        [r.error for r in results]
    assert faults_injected(sim).get(fault) == 8  # twice for each of the 4 agents


@pytest.mark.parametrize(("fault", "kind"), [("http_500", "server_error"),
                                           ("http_429", "rate_limited")])
def test_a_backend_that_keeps_failing_ends_only_its_agent(
        engine: Engine, fault: str, kind: str) -> None:
    inputs = [{"i": i, "extra": f"@sim fail {fault} times=50" if i == 3 else ""}
              for i in range(6)]
    results = engine.run("Agent {i}.\n{extra}", inputs, output_schema=Answer, max_retries=1)
    assert [r.ok for r in results] == [i != 3 for i in range(6)]
    error = results[3].error
    assert error is not None and error.kind == kind
    assert "after 2 attempts" in error.message, error.message


# -- tools -----------------------------------------------------------------------------------


def test_a_tool_that_raises_is_fed_back_as_data(engine: Engine) -> None:
    results = engine.run('Agent {i}.\n@sim tool always_fails {{"key": "x{i}"}}',
                         [{"i": i} for i in range(3)], tools=[always_fails],
                         output_schema=Answer)
    assert all(r.ok and r.turns == 2 for r in results), [r.error for r in results]
    for r in results:
        [call] = r.tool_calls
        assert (call.name, call.arguments, call.ok) == ("always_fails", {"key": f"x{r.index}"},
                                                        False)


# -- streaming and cancel --------------------------------------------------------------------


def test_results_stream_in_completion_order_each_index_once(
        engine: Engine, contract_redis: str) -> None:
    key = f"contract:gate:{uuid.uuid4().hex}"
    wait = '@sim tool gate {"url": "' + contract_redis + '", "key": "' + key + '"}'
    inputs = [{"i": i, "wait": wait if i % 2 == 0 else ""} for i in range(6)]
    handle = engine.submit("Agent {i}.\n{wait}", inputs, tools=[gate], output_schema=Answer)
    with handle:
        stream = handle.results(timeout=WAIT_S)
        # The even agents are held in ``gate`` until the key is set: the odd ones come first.
        first = [next(stream) for _ in range(3)]
        redis.from_url(contract_redis).set(key, 1)
        rest = list(stream)
    order = [r.index for r in first + rest]
    assert [r.index for r in first if r.ok] == [r.index for r in first]
    assert {r.index for r in first} == {1, 3, 5}
    assert sorted(order) == list(range(6))  # every index exactly once
    assert all(r.ok for r in rest), [r.error for r in rest]


def test_cancel_ends_agents_held_in_a_tool_call_as_cancelled(
        engine: Engine, contract_redis: str) -> None:
    key = f"contract:gate:{uuid.uuid4().hex}"
    task = 'Agent {i}.\n@sim tool gate {{"url": "' + contract_redis + '", "key": "' + key + '"}}'
    client = redis.from_url(contract_redis)
    with engine.submit(task, [{"i": i} for i in range(8)], tools=[gate]) as handle:
        try:
            deadline = time.monotonic() + WAIT_S
            while client.llen(f"{key}:entered") < 8:  # every agent is inside its tool call
                assert time.monotonic() < deadline, "the agents never reached the tool"
                time.sleep(0.05)
            handle.cancel()
        finally:
            client.set(key, 1)  # let calls still held in the gate return
        results = handle.wait(timeout=WAIT_S)
    assert [r.index for r in results] == list(range(8))
    assert {r.error.kind if r.error else "ok" for r in results} == {"cancelled"}


# -- bad input -------------------------------------------------------------------------------


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
def test_bad_input_is_refused_naming_it_before_anything_is_sent(
        engine: Engine, sim: SimServer, contract_redis: str, kwargs: dict[str, Any],
        message: str) -> None:
    args: dict[str, Any] = {"task": "Do {a}", "inputs": [{"a": 1}], "model": "m", **kwargs}
    engine = Engine(engine.name, args.pop("backend", engine.backend), engine.redis_url)
    client = redis.from_url(contract_redis)
    keys_before = set(client.keys("ab:*"))
    requests_before = sim.state.stats.as_dict()["requests_total"]
    with pytest.raises(BatchSpecError, match=re.escape(message)):
        engine.submit(args.pop("task"), args.pop("inputs"), **args)
    assert sim.state.stats.as_dict()["requests_total"] == requests_before
    assert set(client.keys("ab:*")) == keys_before  # nothing written to Redis either
