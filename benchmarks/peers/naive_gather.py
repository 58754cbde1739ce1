"""The baseline a user would write: ``asyncio.gather`` over every agent, one aiohttp session.

Each agent runs the same multi-turn loop as the engines do: a chat completion with the tool
schema (and the output schema as ``response_format``), run the tool calls it asks for, send
the results back, read the final answer and validate it with ``Model.model_validate_json``,
asking once more if it does not validate. No concurrency limit, no retries of failed HTTP
calls, no coalescing: the simplest correct program.

It uses aiohttp, the client library agentbatch's OpenAI-compatible backend uses, so the
comparison is about the engine, not the HTTP library.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from pydantic import BaseModel, ValidationError

from benchmarks.peers import RunOutcome
from benchmarks.workloads import (
    MODEL,
    SYSTEM_PROMPT,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_PARAMETERS,
    ToolCounter,
    Workload,
    make_lookup,
)

NAME = "naive_gather"
LABEL = "naive asyncio.gather (aiohttp)"
SETTINGS = {"http_client": "aiohttp.ClientSession (TCPConnector(limit=0))", "concurrency": None}


def _tools() -> list[dict[str, Any]]:
    return [{
        "type": "function",
        "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                     "parameters": TOOL_PARAMETERS},
    }]


def _response_format(schema: type[BaseModel]) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": schema.__name__, "schema": schema.model_json_schema()}}


async def _chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        data = await resp.json()
    return data["choices"][0]["message"]


async def run_agent(
    session: aiohttp.ClientSession,
    url: str,
    workload: Workload,
    task: str,
    tools: dict[str, Any],
    tally: dict[str, int],
) -> BaseModel:
    """One agent: model turn -> tool calls -> model turn ... -> validated output."""
    schema = workload.schema
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task},
    ]
    base = {"model": MODEL, "tools": _tools(), "response_format": _response_format(schema)}
    retried = False
    for _ in range(workload.max_turns + 1):  # + 1: room for the one validation retry
        message = await _chat(session, url, {**base, "messages": messages})
        calls = message.get("tool_calls") or []
        if calls:
            tally["tool_calls"] += len(calls)
            messages.append({"role": "assistant", "content": message.get("content"),
                             "tool_calls": calls})
            results = await asyncio.gather(*(
                tools[c["function"]["name"]](**json.loads(c["function"]["arguments"] or "{}"))
                for c in calls
            ))
            for call, result in zip(calls, results, strict=True):
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": json.dumps(result)})
            continue
        content = message.get("content") or ""
        try:
            return schema.model_validate_json(content)
        except ValidationError as exc:
            if retried:
                raise
            retried = True
            messages.append({"role": "assistant", "content": content})
            messages.append({"role": "user", "content": f"That did not validate: {exc}. "
                                                        "Reply with the JSON object only."})
    raise RuntimeError("out of turns")


async def run(base_url: str, workload: Workload, agents: int, counter: ToolCounter) -> RunOutcome:
    """Run ``agents`` agents of ``workload`` against the OpenAI-compatible server at base_url."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    tools = {TOOL_NAME: make_lookup(workload, counter)}
    tasks = [workload.task.format(**item) for item in workload.inputs(agents)]
    tally = {"tool_calls": 0}
    connector = aiohttp.TCPConnector(limit=0)  # unlimited, like the gather itself
    async with aiohttp.ClientSession(connector=connector) as session:
        results = await asyncio.gather(
            *(run_agent(session, url, workload, t, tools, tally) for t in tasks),
            return_exceptions=True,
        )
    outcome = RunOutcome(agents=agents, ok=0, tool_calls=tally["tool_calls"], tool_calls_shared=0)
    for r in results:
        if isinstance(r, workload.schema):
            outcome.ok += 1
        else:
            outcome.add_error(f"{type(r).__name__}: {r}")
    return outcome
