"""Reduce and plan -> map -> reduce, on both engines, against the simulator over real HTTP.

Every request the simulator receives is recorded (its port, model, tools and first user
message), so the tests read the reduce prompts exactly as the reduce agents got them, and
count the reduce agents of each tree level. The schemas live in this module: the distributed
case's worker imports it (``AGENTBATCH_WORKER_IMPORTS``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from pydantic import BaseModel

from agentbatch import (
    AgentResult,
    BatchSpecError,
    PipelineError,
    arun_with_map_reduce,
    arun_with_reduce,
    run_with_map_reduce,
    run_with_reduce,
)
from agentbatch.sim import handlers
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from tests.support.pure_tools import stamp
from tests.support.redis_server import RedisServer
from tests.support.workers import WorkerProcess

pytestmark = [pytest.mark.redis]

PATTERNS_DB = 9  # the module's worker has its own database (the ``redis_url`` fixture flushes 0)
WORKER_IMPORTS = "tests.support,tests.integration.test_patterns_reduce"
REDUCE = ('REDUCE level={level} n={n} ok={ok} failed={failed}\n'
          '@sim answer {{"summary": "s", "count": {ok}}}')


class Claim(BaseModel):
    claim: str


class Summary(BaseModel):
    summary: str
    count: int


class Plan(BaseModel):
    items: list[str]


class Questions(BaseModel):
    questions: list[str]


@dataclass
class Seen:
    """What the simulator received: one entry per HTTP request."""

    requests: list[dict[str, Any]] = field(default_factory=list)

    def reduce_prompts(self, level: int | None = None) -> list[str]:
        """Each reduce agent's prompt once (a retried request repeats its first message)."""
        marker = "REDUCE level=" + ("" if level is None else f"{level} ")
        texts = [r["text"] for r in self.requests if r["text"].startswith(marker)]
        return list(dict.fromkeys(texts))


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    record = Seen()
    original = handlers.chat_completions

    async def recording(request: Any) -> Any:
        body = await request.json()  # aiohttp keeps the body: the handler reads it again
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        if body.get("max_tokens") == 1 and users and users[0]["content"] == "ok":
            return await original(request)  # the prefix warm-up, not an agent's turn
        record.requests.append({"port": request.url.port, "model": body.get("model"),
                                "tools": body.get("tools"),
                                "text": users[0]["content"] if users else ""})
        return await original(request)

    monkeypatch.setattr(handlers, "chat_completions", recording)
    return record


def _sim_url(server: SimServer) -> str:
    return "sim://" + server.url.split("://", 1)[1]


@pytest.fixture
def sim_backend(seen: Seen) -> Iterator[str]:
    """A simulator started after ``seen`` patched its handler (its app looks it up at build)."""
    with SimServer(SimConfig(fixed_ms=5)) as server:
        yield _sim_url(server)


@pytest.fixture(scope="module")
def patterns_redis(redis_server: RedisServer) -> str:
    url = redis_server.url.rsplit("/", 1)[0] + f"/{PATTERNS_DB}"
    redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="module")
def patterns_worker(patterns_redis: str) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(patterns_redis, name="patterns", concurrency=16,
                           env={"AGENTBATCH_WORKER_IMPORTS": WORKER_IMPORTS}).start()
    yield worker
    worker.stop(timeout=15)


@pytest.fixture(params=["embedded", "distributed"])
def engine(request: pytest.FixtureRequest, sim_backend: str) -> dict[str, Any]:
    """The keyword arguments that pick the engine (and the backend and model)."""
    kw: dict[str, Any] = {"backend": sim_backend, "model": "sim-model"}
    if request.param == "distributed":
        request.getfixturevalue("patterns_worker")
        kw["redis_url"] = request.getfixturevalue("patterns_redis")
    return kw


def _json_lines(prompt: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in prompt.splitlines() if line.startswith("{")]


def _claims(n: int, failing: set[int]) -> list[dict[str, Any]]:
    return [{"i": i, "script": "@sim answer not json" if i in failing
             else f'@sim answer {{"claim": "c{i}"}}'} for i in range(n)]


# -- reduce ----------------------------------------------------------------------------------


def test_partial_map_failures_reach_the_reducer(engine: dict[str, Any], seen: Seen) -> None:
    results, reduced = run_with_reduce(
        "Claim {i}.\n{script}", _claims(6, {1, 4}), output_schema=Claim, max_retries=0,
        reduce=REDUCE, reduce_schema=Summary, **engine)
    assert [r.ok for r in results] == [True, False, True, True, False, True]
    assert reduced == Summary(summary="s", count=4)
    [prompt] = seen.reduce_prompts()
    assert prompt.startswith("REDUCE level=1 n=6 ok=4 failed=2\n")
    lines = _json_lines(prompt)
    outputs = [x for x in lines if "output" in x]
    assert outputs == [{"index": i, "output": {"claim": f"c{i}"}} for i in (0, 2, 3, 5)]
    failures = [x for x in lines if "kind" in x]
    assert failures == [{"index": i, "kind": "invalid_output",
                         "message": results[i].error.message} for i in (1, 4)]
    assert all(f["message"] for f in failures)


def test_a_failed_reduce_agent_is_returned_as_its_result(engine: dict[str, Any]) -> None:
    results, reduced = run_with_reduce(
        "Claim {i}.\n{script}", _claims(3, {2}), output_schema=Claim, max_retries=0,
        reduce="REDUCE level={level} n={n}\n@sim fail http_500 times=99",
        reduce_schema=Summary, **engine)
    assert [r.ok for r in results] == [True, True, False]
    assert isinstance(reduced, AgentResult) and not reduced.ok
    assert reduced.error is not None and reduced.error.kind == "server_error"
    # the prompt the failed reduce agent had, failures included
    prompt = reduced.input["reduce_prompt"]
    assert prompt.startswith("REDUCE level=1 n=3\n")
    assert [x["index"] for x in _json_lines(prompt) if "kind" in x] == [2]


def test_tree_levels_have_the_fan_in(engine: dict[str, Any], seen: Seen) -> None:
    results, reduced = run_with_reduce(
        "Claim {i}.\n{script}", _claims(10, set()), output_schema=Claim,
        reduce=REDUCE, reduce_schema=Summary, reduce_fan_in=3, **engine)
    assert all(r.ok for r in results)
    # 10 outputs -> 4 groups (3, 3, 3, 1) -> 2 groups (3, 1) -> 1 group of 2
    expected = {1: [3, 3, 3, 1], 2: [3, 1], 3: [2]}
    for level, sizes in expected.items():
        prompts = seen.reduce_prompts(level)
        assert sorted(len(_json_lines(p)) for p in prompts) == sorted(sizes), level
        assert sorted(int(p.split(" n=")[1].split()[0]) for p in prompts) == sorted(sizes)
    assert seen.reduce_prompts(4) == []
    # level 1 reduces map outputs in input order; level 2 reduces level 1's Summary outputs
    level1 = sorted(seen.reduce_prompts(1), key=lambda p: _json_lines(p)[0]["index"])
    assert [[x["index"] for x in _json_lines(p)] for p in level1] == \
        [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    for p in seen.reduce_prompts(2):
        assert all(set(x["output"]) == {"summary", "count"} for x in _json_lines(p))
    assert reduced == Summary(summary="s", count=2)


def test_reduce_model_backend_and_tools_override_the_map_stage(seen: Seen,
                                                               sim_backend: str) -> None:
    with SimServer(SimConfig(fixed_ms=5)) as other:
        _, reduced = run_with_reduce(
            "Claim {i}.\n{script}", _claims(2, set()), output_schema=Claim, tools=[stamp],
            model="map-model", backend=sim_backend, reduce=REDUCE, reduce_schema=Summary,
            reduce_model="reduce-model", reduce_backend=_sim_url(other), reduce_tools=[])
        other_port = other.port
    assert reduced == Summary(summary="s", count=2)
    maps = [r for r in seen.requests if r["text"].startswith("Claim")]
    reduces = [r for r in seen.requests if r["text"].startswith("REDUCE")]
    assert len(maps) == 2 and len(reduces) == 1
    assert {r["model"] for r in maps} == {"map-model"}
    assert all(r["tools"] for r in maps) and all(r["port"] != other_port for r in maps)
    assert reduces[0]["model"] == "reduce-model" and reduces[0]["port"] == other_port
    assert not reduces[0]["tools"]


def test_a_map_stage_over_the_reduce_context_fails_unless_fanned_in(seen: Seen,
                                                                    sim_backend: str) -> None:
    long = "x" * 200
    inputs = [{"i": i, "script": f'@sim answer {{"claim": "{long}{i}"}}'} for i in range(20)]
    kw: dict[str, Any] = {"output_schema": Claim, "model": "m", "backend": sim_backend,
                          "reduce": REDUCE, "reduce_schema": Summary}
    with pytest.raises(PipelineError, match="reduce_fan_in") as info:
        run_with_reduce("Claim {i}.\n{script}", inputs, reduce_context_tokens=400, **kw)
    assert info.value.stage == "reduce"
    assert [r.index for r in info.value.results] == list(range(20))  # the map is not lost
    assert seen.reduce_prompts() == []  # refused before the reduce ran, nothing truncated
    _, reduced = run_with_reduce("Claim {i}.\n{script}", inputs, reduce_context_tokens=400,
                                 reduce_fan_in=2, **kw)
    assert isinstance(reduced, Summary)
    assert [len(seen.reduce_prompts(level)) for level in range(1, 7)] == [10, 5, 3, 2, 1, 0]


def test_async_reduce_and_map_reduce(seen: Seen, sim_backend: str) -> None:
    kw: dict[str, Any] = {"model": "m", "backend": sim_backend}

    async def main() -> tuple[Any, Any]:
        return (await arun_with_reduce("Claim {i}.\n{script}", _claims(3, {0}),
                                       output_schema=Claim, max_retries=0, reduce=REDUCE,
                                       reduce_schema=Summary, **kw),
                await arun_with_map_reduce(
                    'Plan.\n@sim answer {{"items": ["a", "b"]}}', {}, Plan,
                    'Do {item}.\n@sim answer {{"claim": "{item}"}}', Claim, REDUCE, Summary,
                    **kw))

    (results, reduced), (mapped, mreduced) = asyncio.run(main())
    assert [r.ok for r in results] == [False, True, True]
    assert reduced == Summary(summary="s", count=2)
    assert [r.input for r in mapped] == [{"item": "a"}, {"item": "b"}]
    assert mreduced == Summary(summary="s", count=2)


# -- plan -> map -> reduce --------------------------------------------------------------------

PLAN = 'Plan for {topic}.\n@sim answer {{"items": ["alpha", "beta", "gamma"]}}'
TASK = 'Research {item}.\n@sim answer {{"claim": "about {item}"}}'


def test_map_reduce_items_land_in_each_map_result(engine: dict[str, Any], seen: Seen) -> None:
    engine = {**engine, "model": None}
    results, reduced = run_with_map_reduce(
        PLAN, {"topic": "kv caches"}, Plan, TASK, Claim, REDUCE, Summary,
        planner_model="planner-m", worker_model="worker-m", reducer_model="reducer-m", **engine)
    assert [r.input for r in results] == [{"item": s} for s in ("alpha", "beta", "gamma")]
    assert [r.output for r in results] == [Claim(claim=f"about {s}")
                                           for s in ("alpha", "beta", "gamma")]
    assert reduced == Summary(summary="s", count=3)
    models = {r["text"].split()[0]: r["model"] for r in seen.requests}
    assert models == {"Plan": "planner-m", "Research": "worker-m", "REDUCE": "reducer-m"}
    [prompt] = seen.reduce_prompts()
    assert [x["output"]["claim"] for x in _json_lines(prompt)] == \
        ["about alpha", "about beta", "about gamma"]


def test_plan_items_names_another_field(seen: Seen, sim_backend: str) -> None:
    results, _ = run_with_map_reduce(
        'Plan.\n@sim answer {{"questions": ["q1", "q2"]}}', {}, Questions, TASK, Claim,
        REDUCE, Summary, plan_items="questions", model="m", backend=sim_backend)
    assert [r.input for r in results] == [{"item": "q1"}, {"item": "q2"}]


@pytest.mark.parametrize(("planner", "message"), [
    ('@sim answer {{"items": []}}', "empty"),
    ("@sim fail http_500 times=99", "the planner failed (server_error"),
])
def test_an_empty_or_failed_plan_runs_no_map_stage(seen: Seen, sim_backend: str, planner: str,
                                                   message: str) -> None:
    with pytest.raises(PipelineError, match=message.replace("(", r"\(")) as info:
        run_with_map_reduce("Plan.\n" + planner, {}, Plan, TASK, Claim, REDUCE, Summary,
                            model="m", backend=sim_backend, max_retries=0)
    assert info.value.stage == "plan" and len(info.value.results) == 1
    assert {r["text"].split()[0] for r in seen.requests} == {"Plan."}


# -- bad input -------------------------------------------------------------------------------

BAD_REDUCE: list[tuple[dict[str, Any], str]] = [
    ({"reduce": "Merge {total} lists"}, r"\{total\}.*\{n\}, \{ok\}, \{failed\}"),
    ({"reduce_fan_in": 1}, "reduce_fan_in must be an int >= 2"),
    ({"reduce_fan_in": True}, "reduce_fan_in"),
    ({"reduce_schema": dict}, "reduce_schema must be a Pydantic model"),
    ({"reduce_context_tokens": 0}, "reduce_context_tokens"),
    ({"reduce_fanin": 3}, "did you mean 'reduce_fan_in'"),
    ({"max_concurent": 3}, "max_concurent"),  # a map option: refused by run_batch itself
]


@pytest.mark.parametrize(("bad", "message"), BAD_REDUCE)
def test_bad_reduce_input_is_refused_before_anything_is_enqueued(
        engine: dict[str, Any], seen: Seen, bad: dict[str, Any], message: str) -> None:
    batch_id = "bad-" + uuid.uuid4().hex[:8]
    kw = {"reduce": REDUCE, "reduce_schema": Summary, **bad}
    with pytest.raises(BatchSpecError, match=message):
        run_with_reduce("Claim {i}.\n{script}", _claims(2, set()), output_schema=Claim,
                        batch_id=batch_id, **kw, **engine)
    _nothing_sent(engine, seen, batch_id)


BAD_PLAN: list[tuple[dict[str, Any], str]] = [
    ({"plan_output_schema": Questions}, r"Questions has no 'items' field.*plan_items="),
    ({"plan_items": "topics"}, "has no 'topics' field"),
    ({"plan_output_schema": Claim, "plan_items": "claim"}, r"Claim.claim must be list\[str\]"),
    ({"task": "Research this."}, r"does not use \{item\}"),
    ({"task": "Research {item} for {user}."}, r"names \{user\}"),
    ({"plan_inputs": ["a", "b"]}, "plan_inputs must be one dict"),
    ({"reduce": "Merge {items}"}, r"\{items\}"),
    ({"reduce_fan_in": 0}, "reduce_fan_in"),
]


@pytest.mark.parametrize(("bad", "message"), BAD_PLAN)
def test_bad_plan_input_is_refused_before_the_planner_runs(
        engine: dict[str, Any], seen: Seen, bad: dict[str, Any], message: str) -> None:
    batch_id = "bad-" + uuid.uuid4().hex[:8]
    args: dict[str, Any] = {"plan_prompt": PLAN, "plan_inputs": {"topic": "t"},
                            "plan_output_schema": Plan, "task": TASK, "output_schema": Claim,
                            "reduce": REDUCE, "reduce_schema": Summary}
    extra = {k: v for k, v in bad.items() if k not in args}
    args.update({k: v for k, v in bad.items() if k in args})
    with pytest.raises(BatchSpecError, match=message):
        run_with_map_reduce(**args, batch_id=batch_id, **extra, **engine)
    _nothing_sent(engine, seen, batch_id)


def _nothing_sent(engine: dict[str, Any], seen: Seen, batch_id: str) -> None:
    assert seen.requests == []
    if engine.get("redis_url"):
        client = redis.from_url(engine["redis_url"])
        assert [k for k in client.scan_iter(f"*{batch_id}*")] == []
