"""Jump-forward on llama.cpp: the text every valid reply starts with is prefilled, not decoded.

``gbnf.split_gbnf`` finds a schema's forced start and the grammar for what follows; the
``llamacpp://`` driver sends the start as a prefilled assistant turn, which llama-server
continues and returns whole. The unit tests check the split; the ``engine`` test checks on a
real llama-server that replies stay valid for every schema shape agentbatch sends, and that
fewer tokens are decoded.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, Field

from agentbatch.backends.gbnf import split_gbnf
from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.backends.registry import backend_from_url
from agentbatch.core.model_io import ModelRequest
from agentbatch.core.output import OutputContract
from agentbatch.turnloop.json_tool_calling import union_schema
from tests.engine.reviews import REVIEWS, TASK, Verdict
from tests.engine.schemas import Outer


class Answer(BaseModel):
    item: str = Field(max_length=20)
    price: str = Field(max_length=40)


TOOL = {"type": "function", "function": {"name": "price", "parameters": {
    "type": "object", "properties": {"item": {"type": "string",
                                              "enum": ["kettle", "toaster"]}},
    "required": ["item"], "additionalProperties": False}}}
OPEN_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}
ANSWER = OutputContract(Answer).json_schema

SCHEMAS: dict[str, dict[str, Any]] = {
    "verdict": Verdict.model_json_schema(),
    "nested": Outer.model_json_schema(),
    "calls_only": union_schema([TOOL], ANSWER, allow_final=False, max_calls=1),
    "calls_only_two_tools": union_schema([TOOL, OPEN_TOOL], ANSWER, allow_final=False),
    "final_only": union_schema([TOOL], ANSWER, allow_tools=False),
    "union": union_schema([TOOL], ANSWER, max_calls=1),
}


def test_the_forced_start_of_each_schema() -> None:
    prefix = {name: (split_gbnf(s) or ("",))[0] for name, s in SCHEMAS.items()}
    assert prefix == {
        "verdict": '{"label":"',
        "nested": '{"kind":"',
        "calls_only": '{"tool_calls":[{"name":"price","arguments":{"item":"',
        "calls_only_two_tools": '{"tool_calls":[{"name":"',
        "final_only": "",  # a free string would follow: not prefilled (see split_gbnf)
        "union": '{"',
    }


def test_a_start_followed_by_a_free_string_is_not_split() -> None:
    free = union_schema([OPEN_TOOL], ANSWER, allow_final=False, max_calls=1)
    assert split_gbnf(free) is None  # '{"tool_calls":[{"name":"lookup","arguments":{"key":"'
    assert split_gbnf(SCHEMAS["final_only"]) is None


def test_nothing_forced_or_nothing_left_is_no_split() -> None:
    assert split_gbnf({"type": "integer"}) is None  # nothing forced
    assert split_gbnf({"const": {"a": 1}}) is None  # nothing left to generate
    assert split_gbnf({"type": "object", "properties": {"a": {"const": 1}},
                       "required": ["a"]}) is None


def test_a_start_too_short_to_pay_is_not_prefilled() -> None:
    backend = backend_from_url("llamacpp://127.0.0.1:1")
    assert isinstance(backend, LlamaCppBackend)
    request = ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                           json_schema={"name": "t", "schema": SCHEMAS["union"]})
    body = backend.build_body(request)  # '{"' is one token: sent whole, no prefill
    assert body["messages"][-1]["role"] == "user" and "grammar" in body


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


@pytest.mark.engine
def test_prefilled_replies_are_whole_valid_and_cheaper(llama_server: Any) -> None:
    """For every schema shape, llama-server's reply to the prefilled request is the whole
    value and validates; the same requests without jump-forward decode more tokens."""
    jump = backend_from_url(llama_server.llamacpp_url + "?stream=0")
    assert isinstance(jump, LlamaCppBackend)
    whole = LlamaCppBackend(jump.target, jump_forward=False, stream=False)
    decoded = {"jump": 0, "whole": 0}
    for schema in SCHEMAS.values():
        for i, text in enumerate(REVIEWS[:2]):
            request = ModelRequest(
                model="smollm2", max_tokens=96, temperature=0.0,
                messages=[{"role": "system", "content": "Reply in JSON."},
                          {"role": "user", "content": TASK.format(i=i, text=text)}],
                json_schema={"name": "t", "schema": schema})
            for mode, backend in (("jump", jump), ("whole", whole)):
                reply = _post(llama_server.http_url, backend.build_body(request))
                choice = reply["choices"][0]
                if choice["finish_reason"] == "length":
                    continue  # cut off mid-string by max_tokens: not a grammar question
                value = json.loads(choice["message"]["content"])
                jsonschema.validate(value, schema)
                decoded[mode] += reply["usage"]["completion_tokens"]
    print(f"tokens decoded over {len(SCHEMAS) * 2} replies: {decoded}")
    assert decoded["jump"] < decoded["whole"]


async def test_a_reply_without_its_prefill_is_made_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that returns only the continuation of a prefill (llama-server returns the
    whole reply) still yields the whole value."""
    from agentbatch.backends.openai_compat import OpenAICompatBackend
    from agentbatch.core.model_io import ModelResponse

    async def continuation_only(self: Any, request: ModelRequest) -> ModelResponse:
        return ModelResponse(text='positive","reason":"kind staff"}')

    monkeypatch.setattr(OpenAICompatBackend, "complete", continuation_only)
    backend = backend_from_url("llamacpp://127.0.0.1:1")
    request = ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                           json_schema={"name": "v", "schema": SCHEMAS["verdict"]})
    reply = await backend.complete(request)
    assert Verdict.model_validate_json(reply.text or "").label == "positive"
