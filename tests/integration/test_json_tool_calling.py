"""``tool_calling="json"`` over real HTTP, on the embedded and distributed engines.

The model is a local aiohttp server that knows nothing of native tools: it reads the JSON
schema each request carries, answers with a reply that the schema accepts (it checks that
with ``jsonschema``; a reply the schema refuses is a 400 and fails the test), and follows a
script written in the task: which tool calls to make, round by round, then the final answer.
Tools count their executions in the test's Redis (``tests/support/tools.py``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import redis
from aiohttp import web

from agentbatch import AgentResult, run_batch, submit_batch
from agentbatch.core.turns import REPAIR_PROMPT
from agentbatch.sim.schema_fill import fill_schema
from agentbatch.turnloop.json_tool_calling import RESULTS_HEADER, SCHEMA_NAME
from tests.support.recording_http import RecordingServer
from tests.support.tools import Answer, counted_call, price

pytestmark = [pytest.mark.redis, pytest.mark.slow]

IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}
SCRIPT = "SCRIPT "
REPAIR_START = REPAIR_PROMPT.split("{", 1)[0]
GARBAGE = "Let me think about which tool to use first."


@dataclass
class JsonModel(RecordingServer):
    """A chat server that answers only through the JSON schema it is sent."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        try:
            text = self.reply_for(body)
        except Exception as exc:  # surfaced by the test through ``errors``
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        return web.json_response({
            "id": "c1", "object": "chat.completion",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        })

    def reply_for(self, body: dict[str, Any]) -> str:
        if body.get("tools") or body.get("tool_choice"):
            raise AssertionError("json mode sent native tools")
        fmt = body["response_format"]
        assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == SCHEMA_NAME
        schema = fmt["json_schema"]["schema"]
        messages = body["messages"]
        assert all(m["role"] in ("system", "user", "assistant") for m in messages), messages
        script = json.loads(messages[1]["content"].split(SCRIPT, 1)[1])
        results = [m["content"] for m in messages
                   if m["role"] == "user" and m["content"].startswith(RESULTS_HEADER)]
        replied = [m for m in messages if m["role"] == "assistant"]
        variants = schema.get("anyOf", [schema])
        can_call = any("tool_calls" in v["properties"] for v in variants)
        if script.get("garbage_first") and not replied:
            return GARBAGE  # neither form: the client must send a repair turn
        rounds = script["rounds"]
        if can_call and len(results) < len(rounds):
            value: Any = {"tool_calls": rounds[len(results)]}
        else:
            final = next(v for v in variants if "final" in v["properties"])
            value = fill_schema({**final, "$defs": schema.get("$defs", {})}, "k")
            seen = [json.loads(line)["result"]
                    for block in results for line in block.splitlines()[1:]
                    if line.startswith("{")]
            if isinstance(value["final"], dict):
                value["final"]["summary"] = ",".join(seen)
            else:
                value["final"] = ",".join(seen)
        jsonschema.validate(value, schema)  # the reply a guided decoder would allow
        return json.dumps(value)


@pytest.fixture
def model() -> Any:
    server = JsonModel().start()
    yield server
    server.stop()


def _task(rounds: list[list[dict[str, Any]]], **extra: Any) -> str:
    script = json.dumps({"rounds": rounds, **extra}).replace("{", "{{").replace("}", "}}")
    return "Agent {i}: find the prices.\n" + SCRIPT + script.replace('"AGENT"', '"{i}"')


@pytest.fixture(params=["embedded", "distributed"])
def engine(request: pytest.FixtureRequest, redis_url: str,
           monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The redis_url to submit with (None: embedded); tools count in the test's Redis."""
    monkeypatch.setenv("TEST_REDIS_URL", redis_url)
    if request.param == "embedded":
        return None
    request.getfixturevalue("start_workers")(1, concurrency=4, env=IMPORTS)
    return redis_url


def _run(model: JsonModel, task: str, n: int, redis: str | None, **kw: Any) -> list[AgentResult]:
    handle = submit_batch(task, [{"i": i} for i in range(n)], backend=model.url, model="m",
                          tools=[price, counted_call], tool_calling="json", redis_url=redis,
                          **kw)
    results = handle.wait(timeout=120)
    assert not model.errors, model.errors
    return results


def test_multi_turn_tool_use_through_json_ends_in_valid_output_with_coalescing(
        model: JsonModel, engine: str | None, redis_url: str) -> None:
    item, other = uuid.uuid4().hex[:8], uuid.uuid4().hex[:8]
    rounds = [
        [{"name": "price", "arguments": {"item": item}},  # the same key in every agent
         {"name": "counted_call", "arguments": {"key": "AGENT"}}],
        [{"name": "price", "arguments": {"item": other}}],
    ]
    n = 6
    results = _run(model, _task(rounds), n, engine, output_schema=Answer)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for r in results:
        assert isinstance(r.output, Answer)
        assert r.output.summary == f"a-price-of-{item},counted-{r.index},a-price-of-{other}"
        assert [(c.turn, c.name) for c in r.tool_calls] == [
            (1, "price"), (1, "counted_call"), (2, "price")]
        assert all(c.ok for c in r.tool_calls)
    client = redis.from_url(redis_url)
    # The shared cacheable key ran once for the whole batch; each agent's own call ran once.
    assert int(client.get(f"test:exec:price:a:{item}") or 0) == 1
    assert int(client.get(f"test:exec:price:a:{other}") or 0) == 1
    assert client.hlen("test:exec:calls") == n
    assert sum(int(v) for v in client.hvals("test:exec:calls")) == n
    assert len(model.bodies) == 3 * n  # two tool turns and the final one per agent
    # The history the server saw on the last turn: JSON replies and results as user text.
    last = max(model.bodies, key=lambda b: len(b["messages"]))
    roles = [m["role"] for m in last["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "- price: The price of an item" in last["messages"][0]["content"]


def test_a_reply_in_neither_form_gets_the_usual_repair_turn(
        model: JsonModel, engine: str | None) -> None:
    item = uuid.uuid4().hex[:8]
    rounds = [[{"name": "price", "arguments": {"item": item}}]]
    results = _run(model, _task(rounds, garbage_first=True), 2, engine, output_schema=Answer)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    repairs = [b for b in model.bodies
               if b["messages"][-1]["content"].startswith(REPAIR_START)]
    assert len(repairs) == 2
    for body in repairs:
        assert '"tool_calls"' in body["messages"][-1]["content"]  # the error says the format
        schema = body["response_format"]["json_schema"]["schema"]
        assert "anyOf" not in schema and list(schema["properties"]) == ["final"]
    # The repair turn may not call tools, so these agents answered without the tool.
    assert all(r.tool_calls == [] and r.output.summary == "" for r in results)


def test_without_an_output_schema_the_final_answer_is_a_string(
        model: JsonModel, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_REDIS_URL", redis_url)  # where the tool counts
    item = uuid.uuid4().hex[:8]
    results = run_batch(_task([[{"name": "price", "arguments": {"item": item}}]]),
                        [{"i": 0}], backend=model.url, model="m", tools=[price],
                        tool_calling="json")
    assert not model.errors, model.errors
    [r] = results
    assert r.ok and r.output == f"a-price-of-{item}"
    assert json.loads(r.text or "") == {"final": r.output}  # text: the raw JSON reply


def test_native_mode_still_sends_native_tools(model: JsonModel) -> None:
    run_batch("Agent {i}", [{"i": 0}], backend=model.url, model="m", tools=[price],
              max_retries=0)
    assert model.bodies and model.bodies[0].get("tools")
    assert "response_format" not in model.bodies[0]
