"""The loop guard against the real engine: llama-server with SmolLM2-135M.

Asked for a price through ``tool_calling="json"``'s turn grammar, SmolLM2 often writes the
item's name on and on ("toaster_1013_ticket_1013_ticket_1013...") until ``max_tokens``. A
streamed turn is stopped once the string loops, and llama.cpp then stops generating: its own
``tokens_predicted_total`` counter rises by less than ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

import pytest
from pydantic import BaseModel, Field

from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.backends.prom import metric_sum, parse_prometheus
from agentbatch.core.model_io import FINISH_LOOP, ModelRequest
from agentbatch.core.output import OutputContract
from agentbatch.turnloop.json_tool_calling import instructions, union_schema
from tests.support.tools import price

pytestmark = pytest.mark.engine

MAX_TOKENS = 96
SYSTEM = ("You are a shop assistant. You do not know any prices: to learn the price of an "
          "item, call the price tool with the item's name. After the tool result arrives, "
          "give the final answer with the item and its price.")
# Prompts whose first reply looped to the token limit on this engine, streamed or not.
ASKS = [("toaster", 1013), ("toaster", 1009), ("mixer", 1011)]


class PriceReport(BaseModel):
    item: str = Field(max_length=20)
    price: str = Field(max_length=40)


def _predicted(http_url: str) -> float:
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=30) as resp:
        samples = parse_prometheus(resp.read().decode())
    return metric_sum(samples, "llamacpp:tokens_predicted_total") or 0.0


def _request(item: str, ticket: int) -> ModelRequest:
    tools = [price.openai_schema()]
    out = OutputContract(PriceReport).json_schema
    system = "\n\n".join([SYSTEM, instructions(tools, out)])
    schema = {"name": "agent_turn", "schema": union_schema(tools, out, max_calls=1)}
    return ModelRequest(
        model="smollm2", json_schema=schema, max_tokens=MAX_TOKENS, temperature=0.0,
        messages=[{"role": "system", "content": system},
                  {"role": "user", "content": f"What is the price of the {item}? (ticket "
                                              f"{ticket})"}])


async def _ask_all(llama_server: Any) -> list[tuple[str, float, str]]:
    """(finish reason, tokens llama.cpp generated, text) of each ask, one at a time."""
    backend = LlamaCppBackend(llama_server.llamacpp_url, stream=True)
    seen = []
    try:
        for item, ticket in ASKS:
            before = _predicted(llama_server.http_url)
            resp = await backend.complete(_request(item, ticket))
            await asyncio.sleep(0.5)  # the cancelled slot is released by then
            seen.append((resp.finish_reason or "", _predicted(llama_server.http_url) - before,
                         resp.text or ""))
    finally:
        await backend.aclose()
    return seen


def test_a_looping_streamed_turn_is_stopped_and_llama_cpp_stops_generating(
        llama_server: Any) -> None:
    seen = asyncio.run(_ask_all(llama_server))
    print("loop guard on SmolLM2:", [(r, n, t[:80]) for r, n, t in seen])
    stopped = [(n, text) for reason, n, text in seen if reason == FINISH_LOOP]
    # Which of the three loops can vary with the engine's slot state; all three did here.
    assert stopped, seen
    for generated, text in stopped:
        assert generated < MAX_TOKENS, seen  # the server stopped, not only the client
        assert text.startswith('{"tool_calls"'), text
