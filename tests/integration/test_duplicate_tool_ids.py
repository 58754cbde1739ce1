"""A model reply whose tool calls share one id (issue 11, item 8), over real HTTP.

The server below answers every agent's first turn with two ``lookup`` calls that both carry
the id ``dup``, and records the conversation of the second turn, so the test can check which
result went back under which id. Before the fix, embedded gave both calls the second result
and distributed never ran one call (the fan-in waited for the sweep).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from aiohttp import web

from agentbatch import run_batch, submit_batch, tool
from agentbatch.core.model_io import ModelResponse, ToolCall, unique_call_ids
from tests.support.http_server import ThreadedServer
from tests.support.tools import Answer, lookup

TASK = "Agent {i}: look up a and b."


class ScriptedServer(ThreadedServer):
    """An OpenAI-compatible server on a free port, in a thread of this test process."""

    def __init__(self) -> None:
        super().__init__()
        self.second_turns: dict[str, list[dict[str, Any]]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        messages = body["messages"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        if any(m["role"] == "tool" for m in messages):
            self.second_turns[user] = messages
            message: dict[str, Any] = {"role": "assistant",
                                       "content": json.dumps({"summary": "s", "score": 1})}
            finish = "stop"
        elif not body.get("tools"):  # a warm-up request
            message, finish = {"role": "assistant", "content": "ok"}, "stop"
        else:
            calls = [{"id": "dup", "type": "function",
                      "function": {"name": "lookup", "arguments": json.dumps({"key": k})}}
                     for k in ("a", "b")]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = "tool_calls"
        return web.json_response({
            "id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1},
        })

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer() as srv:
        yield srv


def _assert_each_call_got_its_own_result(messages: list[dict[str, Any]]) -> None:
    assistant = next(m for m in messages if m["role"] == "assistant")
    ids = [c["id"] for c in assistant["tool_calls"]]
    keys = [json.loads(c["function"]["arguments"])["key"] for c in assistant["tool_calls"]]
    assert ids == ["dup", "dup-2"]
    results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
    assert results == {i: f"value-of-{k}" for i, k in zip(ids, keys, strict=True)}


@tool(name="lookup")
async def local_lookup(key: str) -> str:
    """Look up a key.

    Args:
        key: what to look up.
    """
    await asyncio.sleep(0.05 if key == "a" else 0.01)  # b finishes first
    return f"value-of-{key}"


def test_embedded_gives_each_duplicate_id_call_its_own_result(server: ScriptedServer) -> None:
    results = run_batch(TASK, [{"i": i} for i in range(3)], backend=server.url, model="m",
                        tools=[local_lookup], output_schema=Answer, max_retries=0,
                        timeout_per_turn=30.0)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [[c.arguments["key"] for c in r.tool_calls] for r in results] == [["a", "b"]] * 3
    assert len(server.second_turns) == 3
    for messages in server.second_turns.values():
        _assert_each_call_got_its_own_result(messages)


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_runs_both_duplicate_id_calls_and_completes(
        server: ScriptedServer, redis_url: str, start_workers: Any) -> None:
    # A long queue grace: a fan-in that never completes would wait for it (or forever), far
    # past the deadline below.
    start_workers(1, concurrency=8, env={"AGENTBATCH_QUEUE_GRACE_S": "600",
                                         "AGENTBATCH_LEASE_TTL_S": "60",
                                         "AGENTBATCH_WORKER_IMPORTS": "tests.support"})
    handle = submit_batch(TASK, [{"i": i} for i in range(3)], backend=server.url, model="m",
                          tools=[lookup], output_schema=Answer, redis_url=redis_url,
                          max_retries=0, timeout_per_turn=30.0)
    results = handle.wait(timeout=60)
    assert all(r.ok for r in results), [r.error for r in results]
    assert len(server.second_turns) == 3
    for messages in server.second_turns.values():
        _assert_each_call_got_its_own_result(messages)
    r = redis.from_url(redis_url)
    # lookup is not cacheable but coalesces identical concurrent calls across agents
    assert int(r.get("test:exec:lookup:a") or 0) >= 1
    assert int(r.get("test:exec:lookup:b") or 0) >= 1


def test_unique_call_ids_suffixes_repeats_and_names_empty_ids() -> None:
    calls = [ToolCall(id="x", name="f"), ToolCall(id="x", name="g"), ToolCall(id="x-2", name="h"),
             ToolCall(id="", name="f", arguments={"a": 1}), ToolCall(id="x", name="i")]
    ids = [c.id for c in unique_call_ids(calls)]
    assert ids[:3] == ["x", "x-2", "x-2-2"] and ids[4] == "x-3"
    assert ids[3].startswith("call_") and len(set(ids)) == 5
    # stable (replays give identical messages) and idempotent
    assert [c.id for c in unique_call_ids(calls)] == ids
    assert [c.id for c in unique_call_ids(unique_call_ids(calls))] == ids
    # a prefix keeps its ids: a streamed call announced early keeps its id
    assert [c.id for c in unique_call_ids(calls[:2])] == ids[:2]
    # every backend's reply goes through ModelResponse
    assert [c.id for c in ModelResponse(tool_calls=calls).tool_calls] == ids
