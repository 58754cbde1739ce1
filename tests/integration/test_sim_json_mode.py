"""The simulator speaks json-mode turns (``tool_calling="json"``), over real HTTP.

In json mode agentbatch sends no native tools: each turn carries one guided-JSON schema
(``{"tool_calls": [...]}`` or ``{"final": ...}``, only the first when ``tool_choice`` is
``"required"``), its history renders calls as JSON and results as one user message. The
simulator's scripted model must answer in that form, follow the ``@sim tool`` script through
it and end with ``{"final": ...}``; before, it filled the union schema blindly and every agent
ended ``max_turns``.
"""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
from pydantic import BaseModel

from agentbatch import submit_batch, tool
from agentbatch.sim.model import plan_chat
from agentbatch.sim.server import SimServer
from agentbatch.turnloop.json_tool_calling import SCHEMA_NAME, render_history, union_schema

CALLS: Counter[str] = Counter()


@tool
async def lookup(item: str) -> str:
    """The price of an item.

    Args:
        item: the item.
    """
    CALLS[item] += 1
    return f"price-of-{item}"


class Quote(BaseModel):
    item: str
    price: str


def test_json_mode_follows_the_script_and_ends_ok(sim: SimServer, sim_url: str) -> None:
    CALLS.clear()
    task = ('Agent {i}: quote the kettle.\n@sim tool lookup {{"item": "kettle{i}"}}\n'
            '@sim tool lookup {{"item": "cup{i}"}}')
    handle = submit_batch(task, [{"i": i} for i in range(4)], tools=[lookup],
                          output_schema=Quote, backend=sim_url, model="m",
                          tool_calling="json", max_turns=6)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [(r.error, r.turns) for r in results if not r.ok]
    for r in results:
        assert [c.name for c in r.tool_calls] == ["lookup", "lookup"] and r.turns == 3
        assert isinstance(r.output, Quote)
        assert json.loads(r.text or "")["final"] == r.output.model_dump()  # json mode indeed
    assert sum(CALLS.values()) == 8


def test_json_mode_with_tool_choice_required_calls_a_tool_first(sim: SimServer,
                                                                 sim_url: str) -> None:
    """No ``@sim tool`` directive: only the forced first call makes the agent use the tool."""
    CALLS.clear()
    handle = submit_batch("Agent {i}: what does the kettle cost?", [{"i": i} for i in range(4)],
                          tools=[lookup], output_schema=Quote, backend=sim_url, model="m",
                          tool_calling="json", tool_choice="required", max_turns=6)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [(r.error, r.turns) for r in results if not r.ok]
    assert all([c.name for c in r.tool_calls] == ["lookup"] and r.turns == 2 for r in results)
    assert sum(CALLS.values()) >= 1  # forced calls of one agent key may share a cached result


def _body(schema: dict, messages: list[dict]) -> dict:
    return {"model": "m", "messages": messages,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": SCHEMA_NAME, "schema": schema}}}


def test_every_json_mode_reply_fits_the_schema_it_was_sent() -> None:
    """What a guided decoder would enforce: the reply validates against the turn's schema, for
    the scripted call, a required call, the final answer and a repair turn (final only)."""
    tools, output = [lookup.openai_schema()], Quote.model_json_schema()
    both = union_schema(tools, output)
    calls_only = union_schema(tools, output, allow_final=False)
    final_only = union_schema(tools, output, allow_tools=False)
    system = {"role": "system", "content": "Reply with exactly one JSON object."}
    scripted = {"role": "user", "content": 'Quote it.\n@sim tool lookup {"item": "kettle"}'}
    plain = {"role": "user", "content": "Quote it."}
    call = {"role": "assistant", "content": '{"tool_calls":[{"name":"lookup",'
                                            '"arguments":{"item":"kettle"}}]}'}
    results = {"role": "user", "content": render_history([
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "jc0_0", "type": "function",
             "function": {"name": "lookup", "arguments": '{"item": "kettle"}'}}]},
        {"role": "tool", "tool_call_id": "jc0_0", "content": "price-of-kettle"}])[1]["content"]}
    cases = [
        (both, [system, scripted], "tool_calls"),
        (both, [system, scripted, call, results], "final"),
        (calls_only, [system, plain], "tool_calls"),
        (final_only, [system, scripted], "final"),
    ]
    for schema, messages, form in cases:
        reply = json.loads(plan_chat(_body(schema, messages)).reply.content or "")
        jsonschema.validate(reply, schema)
        assert list(reply) == [form], (form, reply)
    first = json.loads(plan_chat(_body(both, [system, scripted])).reply.content or "")
    assert first["tool_calls"] == [{"name": "lookup", "arguments": {"item": "kettle"}}]


def test_a_user_schema_with_a_final_field_is_not_taken_for_json_mode() -> None:
    schema = {"type": "object", "properties": {"final": {"type": "string"},
                                               "score": {"type": "integer"}},
              "required": ["final", "score"]}
    reply = json.loads(plan_chat(_body(schema, [{"role": "user", "content": "Go."}])).reply
                       .content or "")
    jsonschema.validate(reply, schema)
